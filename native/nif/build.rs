// The NIF finds libmlx next to itself, wherever priv/ is copied: the Mix
// compiler installs the library as priv/native/libemlx_axon_nif.so and the
// MLX wheel's lib/ as priv/native/mlx/lib/ (with the wheel's bundled
// libraries beside it, where libmlx's own relative rpath expects them).
fn main() {
    let origin = match std::env::var("CARGO_CFG_TARGET_OS").as_deref() {
        Ok("macos") => "@loader_path",
        _ => "$ORIGIN",
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{origin}/mlx/lib");
}
