// CUDA kernels of our own, compiled once and launched as MLX graph nodes.
//
// MLX's `cuda_kernel` compiles its source with NVRTC in every process (its
// custom kernels skip MLX's disk cache) and prepends MLX's device headers,
// about a second per kernel variant. This glue lets the engine compile a
// self-contained source itself (NVRTC as loaded by a CUDA libmlx, found at
// run time so that CPU builds link too) and cache the binary, then launch
// it through MLX's `precompiled_cuda_kernel`, which MLX-C does not wrap.
#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "mlx/c/error.h"
#include "shim_util.h"
#include "mlx/c/private/array.h"
#include "mlx/c/private/enums.h"
#include "mlx/c/private/stream.h"
#include "mlx/c/private/vector.h"
#include "mlx/fast.h"
#include "mlx/version.h"

namespace {

using nvrtc_program = void*;
using nvrtc_result = int;

using emlx::bind;
using emlx::copy_out;
using emlx::symbol;

struct Nvrtc {
  nvrtc_result (*version)(int*, int*);
  nvrtc_result (*create)(
      nvrtc_program*,
      const char*,
      const char*,
      int,
      const char* const*,
      const char* const*);
  nvrtc_result (*compile)(nvrtc_program, int, const char* const*);
  nvrtc_result (*log_size)(nvrtc_program, size_t*);
  nvrtc_result (*log)(nvrtc_program, char*);
  nvrtc_result (*cubin_size)(nvrtc_program, size_t*);
  nvrtc_result (*cubin)(nvrtc_program, char*);
  nvrtc_result (*destroy)(nvrtc_program*);

  // Whether every entry point is here (each set where found).
  bool load() {
    return bind(version, "nvrtcVersion") &&
        bind(create, "nvrtcCreateProgram") &&
        bind(compile, "nvrtcCompileProgram") &&
        bind(log_size, "nvrtcGetProgramLogSize") &&
        bind(log, "nvrtcGetProgramLog") &&
        bind(cubin_size, "nvrtcGetCUBINSize") &&
        bind(cubin, "nvrtcGetCUBIN") &&
        bind(destroy, "nvrtcDestroyProgram");
  }
};

struct Kernel {
  std::string name;
  // What MLX is given as the compiled source: the binary, or a short token
  // naming it in MLX's module cache (below).
  std::string source;
};

// Writes `data` to `path` whole: into a file of this process first, then
// renamed, so that no reader sees part of it.
bool write_whole(const std::filesystem::path& path, const std::string& data) {
  std::error_code error;
  auto tmp = path;
  tmp += "." + std::to_string(getpid()) + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    out.write(data.data(), data.size());
    if (!out.good()) {
      return false;
    }
  }
  std::filesystem::rename(tmp, path, error);
  return !error;
}

bool holds(const std::filesystem::path& path, size_t size) {
  std::error_code error;
  auto n = std::filesystem::file_size(path, error);
  return !error && n == size;
}

// MLX hashes a kernel's compiled source at every launch to name its module
// (30 KB of binary: ~4 us) and, before building a module, reads MLX's disk
// cache under that name. So the binary is put in that cache under the name
// the short `token` (unique to the binary) gets, and MLX is given the token.
// The cache folder and the module name are MLX 0.32's (jit_module.cpp,
// custom_kernel.cpp); where the file cannot be written MLX is given the
// binary itself.
std::string staged_source(
    const std::string& name,
    const std::string& token,
    const std::string& binary) {
  namespace fs = std::filesystem;
  char module[32];
  std::snprintf(
      module, sizeof module, "_%zx", std::hash<std::string>{}(token));
  if (name.size() + 20 > 245) {
    return binary; // MLX would split the file name into folders.
  }
  try {
    fs::path dir;
    if (const char* c = std::getenv("MLX_PTX_CACHE_DIR")) {
      dir = c;
    } else {
      dir = fs::temp_directory_path() / "mlx" / mlx::core::version() / "ptx";
    }
    auto ptx = dir / (name + module + ".ptx");
    auto list = dir / (name + module + ".txt");
    std::string kernels = name + "\t" + name + "\n";
    if (holds(list, kernels.size()) && holds(ptx, binary.size())) {
      return token;
    }
    std::error_code error;
    fs::create_directories(dir, error);
    // The kernel list first: MLX takes the module as cached once the
    // binary is there, then reads the list.
    if (write_whole(list, kernels) && write_whole(ptx, binary) &&
        holds(ptx, binary.size())) {
      return token;
    }
  } catch (...) {
  }
  return binary;
}

} // namespace

// The device's compute capability and multiprocessor count (device 0, the
// one MLX uses) and NVRTC's version; nonzero where this process has no CUDA
// driver or NVRTC.
extern "C" int emlx_cuda_target(
    int* cc_major,
    int* cc_minor,
    int* multiprocessors,
    int* nvrtc_major,
    int* nvrtc_minor) {
  Nvrtc nvrtc;
  auto init = symbol<int (*)(unsigned)>("cuInit");
  auto get = symbol<int (*)(int*, int)>("cuDeviceGet");
  auto attribute = symbol<int (*)(int*, int, int)>("cuDeviceGetAttribute");
  if (!nvrtc.load() || !init || !get || !attribute) {
    return 1;
  }
  int device = 0;
  // 75 and 76: CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR; 16:
  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT.
  if (init(0) != 0 || get(&device, 0) != 0 ||
      attribute(cc_major, 75, device) != 0 ||
      attribute(cc_minor, 76, device) != 0 ||
      attribute(multiprocessors, 16, device) != 0 ||
      nvrtc.version(nvrtc_major, nvrtc_minor) != 0) {
    return 2;
  }
  return 0;
}

// Compiles `source` to a cubin for `arch` ("sm_90"). On success `*binary`
// (`*size` bytes) holds it; otherwise `*log` says why. Both are malloc'd.
extern "C" int emlx_cuda_compile(
    const char* source,
    const char* arch,
    char** binary,
    size_t* size,
    char** log) {
  *binary = nullptr;
  *log = nullptr;
  Nvrtc nvrtc;
  if (!nvrtc.load()) {
    *log = copy_out("NVRTC is not loaded (libmlx is not a CUDA build)");
    return 1;
  }
  nvrtc_program program = nullptr;
  if (nvrtc.create(&program, source, "emlx_axon.cu", 0, nullptr, nullptr) !=
      0) {
    *log = copy_out("NVRTC could not create a program");
    return 1;
  }
  std::string arch_flag = std::string("--gpu-architecture=") + arch;
  // Lambdas in the kernels (generic ones too) are device code: NVRTC 13.0
  // takes a generic lambda's call operator for a host function otherwise
  // (13.5 does not).
  const char* options[] = {
      arch_flag.c_str(),
      "--std=c++17",
      "--device-as-default-execution-space"};
  int status = nvrtc.compile(program, 3, options);
  if (status != 0) {
    size_t n = 0;
    nvrtc.log_size(program, &n);
    std::string text(n, '\0');
    nvrtc.log(program, text.data());
    *log = copy_out(text);
  } else {
    nvrtc.cubin_size(program, size);
    *binary = static_cast<char*>(std::malloc(*size));
    if (*binary == nullptr || nvrtc.cubin(program, *binary) != 0) {
      std::free(*binary);
      *binary = nullptr;
      *log = copy_out("NVRTC gave no binary");
      status = 1;
    }
  }
  nvrtc.destroy(&program);
  return status;
}

extern "C" void emlx_cuda_free(char* p) {
  std::free(p);
}

// How many blocks of `threads` threads of kernel `name` in the cubin
// `binary` one multiprocessor of device 0 holds at once (registers, shared
// memory and warps allowed), through the driver's occupancy query on a
// module loaded for the purpose in the device's primary context, the one
// MLX's runtime calls use. Nonzero where it cannot be told.
extern "C" int emlx_cuda_occupancy(
    const char* binary,
    const char* name,
    int threads,
    int* blocks) {
  using Context = void*;
  using Module = void*;
  using Function = void*;
  auto retain = symbol<int (*)(Context*, int)>("cuDevicePrimaryCtxRetain");
  auto release = symbol<int (*)(int)>("cuDevicePrimaryCtxRelease_v2");
  auto push = symbol<int (*)(Context)>("cuCtxPushCurrent_v2");
  auto pop = symbol<int (*)(Context*)>("cuCtxPopCurrent_v2");
  auto load = symbol<int (*)(Module*, const void*)>("cuModuleLoadData");
  auto unload = symbol<int (*)(Module)>("cuModuleUnload");
  auto function =
      symbol<int (*)(Function*, Module, const char*)>("cuModuleGetFunction");
  auto occupancy = symbol<int (*)(int*, Function, int, size_t)>(
      "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  auto get = symbol<int (*)(int*, int)>("cuDeviceGet");
  auto capture_mode =
      symbol<int (*)(int*)>("cuThreadExchangeStreamCaptureMode");
  if (!retain || !release || !push || !pop || !load || !unload ||
      !function || !occupancy || !get || !capture_mode) {
    return 1;
  }
  // Relaxed for this thread (2: CU_STREAM_CAPTURE_MODE_RELAXED): loading a
  // module must not invalidate a graph another thread is capturing.
  int mode = 2;
  capture_mode(&mode);
  int device = 0;
  Context context = nullptr;
  if (get(&device, 0) != 0 || retain(&context, device) != 0) {
    capture_mode(&mode);
    return 2;
  }
  int status = 3;
  if (push(context) == 0) {
    Module module = nullptr;
    Function f = nullptr;
    if (load(&module, binary) == 0) {
      if (function(&f, module, name) == 0 &&
          occupancy(blocks, f, threads, 0) == 0) {
        status = 0;
      }
      unload(module);
    }
    Context popped = nullptr;
    pop(&popped);
  }
  release(device);
  capture_mode(&mode);
  return status;
}

// A compiled kernel held for launches (MLX copies its source into each
// node); `token` names this binary and no other.
extern "C" void* emlx_cuda_kernel_new(
    const char* name,
    const char* token,
    const char* binary,
    size_t size) {
  try {
    std::string n(name);
    return new Kernel{n, staged_source(n, token, std::string(binary, size))};
  } catch (...) {
    return nullptr;
  }
}

extern "C" void emlx_cuda_kernel_free(void* kernel) {
  delete static_cast<Kernel*>(kernel);
}

// The kernel's node on `stream`: its parameters are the inputs' and
// outputs' data pointers, then `scalars` (int each). `shapes` holds the
// outputs' shapes one after another, `ndims[i]` dimensions each.
extern "C" int emlx_cuda_kernel_apply(
    mlx_vector_array* res,
    const void* kernel,
    const mlx_vector_array inputs,
    const int* shapes,
    const size_t* ndims,
    const mlx_dtype* dtypes,
    size_t outputs,
    const int* scalars,
    size_t n_scalars,
    int gx,
    int gy,
    int gz,
    int tx,
    int ty,
    int tz,
    const mlx_stream stream) {
  try {
    auto& k = *static_cast<const Kernel*>(kernel);
    std::vector<mlx::core::Shape> output_shapes;
    std::vector<mlx::core::Dtype> output_dtypes;
    for (size_t i = 0; i < outputs; i++) {
      output_shapes.emplace_back(shapes, shapes + ndims[i]);
      shapes += ndims[i];
      output_dtypes.push_back(mlx_dtype_to_cpp(dtypes[i]));
    }
    std::vector<mlx::core::fast::ScalarArg> args(
        scalars, scalars + n_scalars);
    auto result = mlx::core::fast::precompiled_cuda_kernel(
        k.name,
        k.source,
        mlx_vector_array_get_(inputs),
        output_shapes,
        output_dtypes,
        args,
        {gx, gy, gz},
        {tx, ty, tz},
        0,
        std::nullopt,
        false,
        mlx_stream_get_(stream));
    mlx_vector_array_set_(*res, std::move(result));
    return 0;
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
}
