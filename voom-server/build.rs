//! Gives the `voom` binary and the tests the rpath to `libmlx` when libvoom links MLX
//! (its build script passes the directory as DEP_VOOM_MLX_LIB_DIR): a link argument
//! of libvoom's does not reach this package's binaries.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_VOOM_MLX_LIB_DIR");
    if let Ok(dir) = std::env::var("DEP_VOOM_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
