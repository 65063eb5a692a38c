//! Builds MLX-C against a prebuilt libmlx and generates its Rust bindings.
//!
//! The published mlx-sys 0.7.0 builds MLX from a git clone and links Apple
//! frameworks, which works on macOS only. This build instead:
//! - takes the unmodified MLX-C sources from the crates.io package mlx-sys 0.7.0
//!   (resolved with `cargo metadata`, or `MLX_C_SRC`);
//! - compiles them with cmake against the libmlx shipped in the official PyPI
//!   wheels (`mlx-cpu`, `mlx-cuda-13` or `mlx-metal`, pinned to MLX 0.32.2),
//!   found from `MLX_PREFIX`, the project's `.venv`, or `python3`;
//! - links libmlx dynamically and publishes its directory as `DEP_MLX_LIBDIR`
//!   so that final artifacts can embed an rpath to it.
//!
//! CMake records absolute paths (its own build folder, MLX's) in its cache.
//! A checkout that moved, or a different MLX, would make it fail or link the
//! old libmlx, so the CMake build folder is started afresh when its cache
//! names another place or another libmlx.

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

const MLX_C_CRATE_VERSION: &str = "0.7.0";

fn main() {
    for var in ["MLX_PREFIX", "MLX_C_SRC", "PYTHON"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed=compat");

    let mlx_c = mlx_c_source(&out_dir);
    let prefix = mlx_prefix(&manifest_dir);
    let compat = manifest_dir.join("compat");

    build_mlx_c(&mlx_c, &prefix, &compat);
    build_shim(&mlx_c, &prefix, &compat, "array_shim");
    if env::var("CARGO_CFG_TARGET_ARCH").as_deref() != Ok("aarch64") {
        build_shim(&mlx_c, &prefix, &compat, "half_shim");
    }
    // Apple's libmlx is a Metal build: no CUDA kernels to launch there.
    if env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("macos") {
        build_shim(&mlx_c, &prefix, &compat, "cuda_kernel_shim");
        build_shim(&mlx_c, &prefix, &compat, "cuda_step_shim");
    }
    link_mlx(&prefix);
    generate_bindings(&mlx_c, &out_dir);
}

fn fail(message: String) -> ! {
    panic!("\n\nmlx-sys: {message}\n\n");
}

/// Directory of MLX-C (`.../mlx-sys-0.7.0/src/mlx-c`) from the crates.io package.
fn mlx_c_source(out_dir: &Path) -> PathBuf {
    if let Some(dir) = env::var_os("MLX_C_SRC") {
        return PathBuf::from(dir);
    }
    // A throwaway manifest outside our workspace, so `cargo metadata` resolves
    // (and downloads) the real crates.io package rather than this patch.
    let locator = out_dir.join("mlx-c-locator");
    fs::create_dir_all(locator.join("src")).unwrap();
    fs::write(
        locator.join("Cargo.toml"),
        format!(
            "[package]\nname = \"mlx-c-locator\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n\
             [dependencies]\nmlx-sys = {{ version = \"={MLX_C_CRATE_VERSION}\", default-features = false }}\n\n\
             [workspace]\n"
        ),
    )
    .unwrap();
    fs::write(locator.join("src/lib.rs"), "").unwrap();

    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(locator.join("Cargo.toml"))
        .env_remove("CARGO_TARGET_DIR")
        .output()
        .unwrap_or_else(|e| fail(format!("could not run cargo metadata: {e}")));
    if !output.status.success() {
        fail(format!(
            "cargo metadata could not resolve mlx-sys {MLX_C_CRATE_VERSION} for its MLX-C sources \
             (set MLX_C_SRC to an mlx-c checkout to skip this):\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| fail(format!("bad cargo metadata output: {e}")));
    let manifest = metadata["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "mlx-sys" && p["version"] == MLX_C_CRATE_VERSION)
        .and_then(|p| p["manifest_path"].as_str())
        .unwrap_or_else(|| fail("cargo metadata did not list mlx-sys".into()));
    let dir = Path::new(manifest).parent().unwrap().join("src/mlx-c");
    if !dir.join("CMakeLists.txt").exists() {
        fail(format!("no MLX-C sources at {}", dir.display()));
    }
    dir
}

/// The installed `mlx` Python package folder holding `lib/`, `include/` and `share/cmake/MLX`.
fn mlx_prefix(manifest_dir: &Path) -> PathBuf {
    let is_prefix = |p: &Path| p.join("share/cmake/MLX/MLXConfig.cmake").exists();
    if let Some(prefix) = env::var_os("MLX_PREFIX") {
        let prefix = PathBuf::from(prefix);
        if !is_prefix(&prefix) {
            fail(format!(
                "MLX_PREFIX={} has no share/cmake/MLX/MLXConfig.cmake",
                prefix.display()
            ));
        }
        return prefix;
    }
    // The project's own venv (made by scripts/setup) two levels above this crate.
    let venv_lib = manifest_dir.join("../../.venv/lib");
    if let Ok(entries) = fs::read_dir(&venv_lib) {
        for entry in entries.flatten() {
            let candidate = entry.path().join("site-packages/mlx");
            if is_prefix(&candidate) {
                println!("cargo:rerun-if-changed={}", candidate.display());
                return candidate.canonicalize().unwrap_or(candidate);
            }
        }
    }
    let python = env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if let Ok(out) = Command::new(&python)
        .args(["-c", "import mlx; print(list(mlx.__path__)[0])"])
        .output()
    {
        let candidate = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && is_prefix(&candidate) {
            return candidate;
        }
    }
    fail(
        "no prebuilt MLX found. Run scripts/setup (it makes .venv with mlx==0.32.2 and \
         mlx-cpu==0.32.2), or set MLX_PREFIX to the installed `mlx` package folder of an \
         mlx-cpu / mlx-cuda-13 / mlx-metal 0.32.2 wheel."
            .into(),
    )
}

/// Removes the CMake build folder when its cache was made in another place
/// (CMake refuses it) or found libmlx outside `prefix` (it would link that).
fn reset_stale_cmake_build(out_dir: &Path, prefix: &Path) {
    let build_dir = out_dir.join("build");
    let Ok(cache) = fs::read_to_string(build_dir.join("CMakeCache.txt")) else {
        return;
    };
    let value = |key: &str| {
        cache
            .lines()
            .find_map(|line| line.strip_prefix(key))
            .map(|v| PathBuf::from(v.trim()))
    };
    let moved = value("CMAKE_CACHEFILE_DIR:INTERNAL=").is_some_and(|dir| dir != build_dir);
    let other_mlx = value("MLX_LIBRARY:FILEPATH=").is_some_and(|lib| !lib.starts_with(prefix));
    if moved || other_mlx {
        println!(
            "cargo:warning=mlx-sys: rebuilding MLX-C from scratch ({})",
            if moved {
                "the build folder moved"
            } else {
                "MLX changed"
            }
        );
        fs::remove_dir_all(&build_dir)
            .unwrap_or_else(|e| fail(format!("could not remove {}: {e}", build_dir.display())));
    }
}

fn build_mlx_c(mlx_c: &Path, prefix: &Path, compat: &Path) {
    reset_stale_cmake_build(&PathBuf::from(env::var("OUT_DIR").unwrap()), prefix);
    let dst = cmake::Config::new(mlx_c)
        .profile("Release")
        .define("MLX_C_USE_SYSTEM_MLX", "ON")
        .define("MLX_DIR", prefix.join("share/cmake/MLX"))
        .define("MLX_C_BUILD_EXAMPLES", "OFF")
        .define("BUILD_SHARED_LIBS", "OFF")
        .cxxflag(format!(
            "-include {}",
            compat.join("mlx_c_compat.h").display()
        ))
        .build_target("mlxc")
        .build();
    println!("cargo:rustc-link-search=native={}/build", dst.display());
    println!("cargo:rustc-link-lib=static=mlxc");
}

/// One C++ file of `compat/` over MLX-C's private helpers and MLX's headers.
fn build_shim(mlx_c: &Path, prefix: &Path, compat: &Path, name: &str) {
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .include(mlx_c)
        .include(prefix.join("include"))
        .flag(format!(
            "-include{}",
            compat.join("mlx_c_compat.h").display()
        ))
        .warnings(false)
        .file(compat.join(format!("{name}.cpp")))
        .compile(&format!("mlx_{name}"));
}

fn link_mlx(prefix: &Path) {
    let lib_dir = prefix.join("lib");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
        println!("cargo:rustc-link-lib=dylib=c++");
    } else {
        println!("cargo:rustc-link-lib=dylib=stdc++");
        // compat/cuda_*_shim.cpp find NVRTC and the CUDA driver with dlsym.
        println!("cargo:rustc-link-lib=dylib=dl");
    }
    // Link args of a dependency never reach the final binary; dependents read
    // this as DEP_MLX_LIBDIR and set their own rpath.
    println!("cargo:libdir={}", lib_dir.display());
    println!("cargo:prefix={}", prefix.display());
}

fn generate_bindings(mlx_c: &Path, out_dir: &Path) {
    let mut headers: Vec<PathBuf> = fs::read_dir(mlx_c.join("mlx/c"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "h"))
        .collect();
    headers.sort();
    let builder = headers.iter().fold(
        bindgen::Builder::default()
            .rust_target("1.73.0".parse().expect("rust target"))
            .clang_arg(format!("-I{}", mlx_c.display()))
            .blocklist_function("malloc")
            .blocklist_function("realloc"),
        |b, h| b.header(h.to_string_lossy()),
    );
    builder
        .generate()
        .unwrap_or_else(|e| fail(format!("bindgen failed on MLX-C headers: {e}")))
        .write_to_file(out_dir.join("bindings.rs"))
        .unwrap();
}
