//! Compiles the C++ kernels against the headers of the libmlx that mlx-sys
//! links (it publishes the library folder as DEP_MLX_LIBDIR; the headers sit
//! beside it in the wheel's `include/`).

use std::{env, path::PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=csrc");
    let lib_dir =
        PathBuf::from(env::var("DEP_MLX_LIBDIR").expect("mlx-sys did not publish DEP_MLX_LIBDIR"));
    let include = lib_dir.join("../include");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        // MLX's headers as system headers: their warnings are not ours.
        .flag(format!("-isystem{}", include.display()))
        .include("csrc")
        .opt_level(3)
        .flag_if_supported("-fno-math-errno")
        .files([
            "csrc/primitive.cpp",
            "csrc/decode_layer.cpp",
            "csrc/qmm.cpp",
            "csrc/qmm_int8.cpp",
            "csrc/pool.cpp",
            "csrc/experts.cpp",
            "csrc/qmm_scalar.cpp",
            "csrc/sgemm.cpp",
            "csrc/elementwise.cpp",
        ]);
    // The SIMD variants set their own targets per file and are chosen at run time.
    if env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64") {
        build.files([
            "csrc/qmm_avx2.cpp",
            "csrc/qmm_avx512.cpp",
            "csrc/qmm_int8_avx2.cpp",
            "csrc/qmm_int8_avx512.cpp",
            "csrc/elementwise_avx2.cpp",
            "csrc/elementwise_avx512.cpp",
        ]);
    }
    build.compile("emlx_axon_kernels");
    // Tests of this crate load libmlx at run time, and export our
    // `cblas_sgemm` for libmlx to bind (see src/lib.rs).
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-arg=-Wl,--export-dynamic-symbol=cblas_sgemm");
    }
}
