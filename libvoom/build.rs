//! The MLX backend's link. With the `mlx` feature, or on macOS whenever MLX is
//! found, this finds MLX's headers and `libmlx` in the Python wheels that ship them
//! (the Python of `VOOM_MLX_PYTHON`, else `python3`), compiles the C++ shim of
//! `src/backend/mlx/shim.cpp` against them, links `libmlx` (with an rpath to it)
//! and sets `cfg(voom_mlx)`. No download: with the feature, a missing MLX stops
//! the build saying what to install; on macOS without it, the build goes on
//! without MLX.

use std::path::PathBuf;
use std::process::Command;

const INSTALL: &str = "the `mlx` feature links MLX from its official Python wheels: \
    `python3 -m pip install mlx mlx-cpu` (Linux) or `python3 -m pip install mlx` (macOS), \
    or set VOOM_MLX_PYTHON to a Python that has them";

fn main() {
    println!("cargo:rerun-if-env-changed=VOOM_MLX_PYTHON");
    println!("cargo:rustc-check-cfg=cfg(voom_mlx)");
    let wanted = std::env::var_os("CARGO_FEATURE_MLX").is_some();
    let macos = std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos");
    if !wanted && !macos {
        return;
    }
    match mlx_dir() {
        Ok(dir) => build(&dir),
        Err(why) if wanted => panic!("{why}; {INSTALL}"),
        Err(why) => println!("cargo:warning=building without the MLX backend: {why}"),
    }
}

/// The `mlx` package directory holding `include/mlx/mlx.h` and `lib/`.
fn mlx_dir() -> Result<PathBuf, String> {
    let python = std::env::var("VOOM_MLX_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .args([
            "-c",
            "import mlx, os\nfor p in mlx.__path__:\n    if os.path.exists(os.path.join(p, 'include', 'mlx', 'mlx.h')):\n        print(p)\n        break",
        ])
        .output()
        .map_err(|e| format!("running {python} to find MLX: {e}"))?;
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || dir.is_empty() {
        return Err(format!(
            "{python} has no MLX with its C++ headers ({})",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(PathBuf::from(dir))
}

fn build(dir: &std::path::Path) {
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
    // For dependents' build scripts (DEP_VOOM_MLX_LIB_DIR): link arguments do not
    // reach another package's binaries, so each gives its own the rpath.
    println!("cargo:lib_dir={}", lib.display());
    println!("cargo:rustc-cfg=voom_mlx");
}
