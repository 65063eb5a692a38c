// Tests, examples and benches of this crate load libmlx at run time: embed the
// directory mlx-sys found it in, since a dependency's link args never reach us.
fn main() {
    if let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    // Export emlx_axon_kernels' `cblas_sgemm` so libmlx's float32 matmul binds to it.
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-arg=-Wl,--export-dynamic-symbol=cblas_sgemm");
    }
}
