//! With the `mlx` feature: finds MLX's headers and `libmlx` in the Python wheels
//! that ship them (the Python of `VOOM_MLX_PYTHON`, else `python3`), compiles the C++
//! shim of `src/backend/mlx/shim.cpp` against them, and links `libmlx` (with an
//! rpath to it). No download: a missing MLX stops the build saying what to install.

fn main() {
    println!("cargo:rerun-if-env-changed=VOOM_MLX_PYTHON");
    if std::env::var_os("CARGO_FEATURE_MLX").is_some() {
        #[cfg(feature = "mlx")]
        mlx::build();
    }
}

#[cfg(feature = "mlx")]
mod mlx {
    use std::path::PathBuf;
    use std::process::Command;

    const INSTALL: &str = "the `mlx` feature links MLX from its official Python wheels: \
        `python3 -m pip install mlx mlx-cpu` (Linux) or `python3 -m pip install mlx` (macOS), \
        or set VOOM_MLX_PYTHON to a Python that has them";

    /// The `mlx` package directory holding `include/mlx/mlx.h` and `lib/`.
    fn mlx_dir() -> PathBuf {
        let python = std::env::var("VOOM_MLX_PYTHON").unwrap_or_else(|_| "python3".into());
        let out = Command::new(&python)
            .args([
                "-c",
                "import mlx, os\nfor p in mlx.__path__:\n    if os.path.exists(os.path.join(p, 'include', 'mlx', 'mlx.h')):\n        print(p)\n        break",
            ])
            .output()
            .unwrap_or_else(|e| panic!("running {python} to find MLX: {e}; {INSTALL}"));
        let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !out.status.success() || dir.is_empty() {
            panic!(
                "{python} has no MLX with its C++ headers ({}); {INSTALL}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        PathBuf::from(dir)
    }

    pub fn build() {
        let dir = mlx_dir();
        let lib = dir.join("lib");
        println!("cargo:rerun-if-changed=src/backend/mlx/shim.cpp");
        cc::Build::new()
            .cpp(true)
            .std("c++20")
            .file("src/backend/mlx/shim.cpp")
            .include(dir.join("include"))
            .flag_if_supported("-Wno-unused-parameter")
            .compile("voom_mlx_shim");
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-lib=dylib=mlx");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        println!("cargo:rustc-env=VOOM_MLX_DIR={}", dir.display());
    }
}
