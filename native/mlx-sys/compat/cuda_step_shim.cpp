// A decode step's kernels launched outside MLX's graph, on a CUDA stream of
// our own, as one captured CUDA graph.
//
// MLX spends host time on every node it evaluates; a small model's step of
// about 120 kernels is bound by that. Here the same kernels (the binaries the
// engine compiled, with the buffers of a step MLX ran once) are captured once
// and replayed with one launch a step. Each step's tokens land in pinned
// host memory that the device writes directly (a ring, one slot a step), and
// an event a slot says when a step is done. The driver API is found at run
// time, as the kernel glue does, so that CPU builds link too.
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "mlx/array.h"
#include "mlx/c/error.h"
#include "shim_util.h"
#include "mlx/c/private/array.h"

namespace {

using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUmodule = void*;
using CUfunction = void*;
using CUstream = void*;
using CUevent = void*;
using CUgraph = void*;
using CUgraphExec = void*;
using CUdeviceptr = unsigned long long;

using emlx::bind;
using emlx::copy_out;
using emlx::symbol;

// The driver entry points, by the names CUDA 12 and 13's cuda.h map them to.
struct Driver {
  CUresult (*device_get)(CUdevice*, int);
  CUresult (*retain)(CUcontext*, CUdevice);
  CUresult (*release)(CUdevice);
  CUresult (*push)(CUcontext);
  CUresult (*pop)(CUcontext*);
  CUresult (*module_load)(CUmodule*, const void*);
  CUresult (*module_function)(CUfunction*, CUmodule, const char*);
  CUresult (*module_unload)(CUmodule);
  CUresult (*stream_create)(CUstream*, unsigned);
  CUresult (*stream_destroy)(CUstream);
  CUresult (*stream_sync)(CUstream);
  CUresult (*event_create)(CUevent*, unsigned);
  CUresult (*event_record)(CUevent, CUstream);
  CUresult (*event_sync)(CUevent);
  CUresult (*event_destroy)(CUevent);
  CUresult (*launch)(
      CUfunction,
      unsigned,
      unsigned,
      unsigned,
      unsigned,
      unsigned,
      unsigned,
      unsigned,
      CUstream,
      void**,
      void**);
  // For timing launches alone, where found.
  CUresult (*event_elapsed)(float*, CUevent, CUevent) = nullptr;
  CUresult (*begin_capture)(CUstream, int);
  CUresult (*end_capture)(CUstream, CUgraph*);
  CUresult (*instantiate)(CUgraphExec*, CUgraph, unsigned long long);
  CUresult (*graph_launch)(CUgraphExec, CUstream);
  CUresult (*exec_destroy)(CUgraphExec);
  CUresult (*graph_destroy)(CUgraph);
  CUresult (*host_alloc)(void**, size_t, unsigned);
  CUresult (*host_device_pointer)(CUdeviceptr*, void*, unsigned);
  CUresult (*host_free)(void*);
  CUresult (*error_name)(CUresult, const char**);
  CUresult (*capture_mode)(int*);
  CUresult (*copy_to_device)(CUdeviceptr, const void*, size_t, CUstream);

  // Whether every entry point is here (each set where found).
  bool load() {
    bind(event_elapsed, "cuEventElapsedTime_v2") || bind(event_elapsed, "cuEventElapsedTime");
    return bind(device_get, "cuDeviceGet") &&
        bind(retain, "cuDevicePrimaryCtxRetain") &&
        bind(release, "cuDevicePrimaryCtxRelease_v2") &&
        bind(push, "cuCtxPushCurrent_v2") &&
        bind(pop, "cuCtxPopCurrent_v2") &&
        bind(module_load, "cuModuleLoadData") &&
        bind(module_function, "cuModuleGetFunction") &&
        bind(module_unload, "cuModuleUnload") &&
        bind(stream_create, "cuStreamCreate") &&
        bind(stream_destroy, "cuStreamDestroy_v2") &&
        bind(stream_sync, "cuStreamSynchronize") &&
        bind(event_create, "cuEventCreate") &&
        bind(event_record, "cuEventRecord") &&
        bind(event_sync, "cuEventSynchronize") &&
        bind(event_destroy, "cuEventDestroy_v2") &&
        bind(launch, "cuLaunchKernel") &&
        bind(begin_capture, "cuStreamBeginCapture_v2") &&
        bind(end_capture, "cuStreamEndCapture") &&
        bind(instantiate, "cuGraphInstantiateWithFlags") &&
        bind(graph_launch, "cuGraphLaunch") &&
        bind(exec_destroy, "cuGraphExecDestroy") &&
        bind(graph_destroy, "cuGraphDestroy") &&
        bind(host_alloc, "cuMemHostAlloc") &&
        bind(host_device_pointer, "cuMemHostGetDevicePointer_v2") &&
        bind(host_free, "cuMemFreeHost") &&
        bind(error_name, "cuGetErrorName") &&
        bind(capture_mode, "cuThreadExchangeStreamCaptureMode") &&
        bind(copy_to_device, "cuMemcpyHtoDAsync_v2");
  }
};

// MLX 0.32's CUDA buffer (backend/cuda/allocator.h, which needs CUDA's
// headers to include): what an array's buffer points to on a CUDA build.
struct CudaBuffer {
  void* data;
  size_t size;
  int device;
};

struct Launch {
  CUfunction function;
  unsigned grid[3];
  unsigned block[3];
  // Every parameter in 8 bytes; a 4-byte int is read from the low half
  // (x86-64 and aarch64 are little-endian).
  std::vector<uint64_t> values;
  std::vector<void*> params;
};

struct Step {
  Driver cu;
  CUdevice device = 0;
  CUcontext context = nullptr;
  CUstream stream = nullptr;
  std::vector<Launch> launches;
  // The launches before `split` (the head) and from it (the tail), each a
  // graph where capture worked; `split` 0: one part, the whole step.
  size_t split = 0;
  CUgraph graphs[2] = {nullptr, nullptr};
  CUgraphExec execs[2] = {nullptr, nullptr};
  bool head_queued = false;
  // Pinned memory the host's uploads are copied from, and the event of the
  // last copy from it.
  void* staging = nullptr;
  size_t staging_bytes = 0;
  CUevent staged = nullptr;
  std::vector<CUevent> events;
  unsigned* ring = nullptr;
  CUdeviceptr ring_device = 0;
  int rows = 0;
  uint64_t launched = 0;
  std::string error;

  // False, with `error` set, where `status` is a failure.
  bool ok(CUresult status, const char* what) {
    if (status == 0) {
      return true;
    }
    const char* name = nullptr;
    if (cu.error_name(status, &name) != 0 || name == nullptr) {
      name = "unknown error";
    }
    error = std::string(what) + ": " + name + " (" +
        std::to_string(status) + ")";
    return false;
  }

  // Runs `f` with the device's primary context (MLX's) current; the
  // context is popped however `f` ends.
  template <typename F>
  bool in_context(F f) {
    if (!ok(cu.push(context), "making the device's context current")) {
      return false;
    }
    struct Pop {
      Driver& cu;
      ~Pop() {
        CUcontext popped = nullptr;
        cu.pop(&popped);
      }
    } pop{cu};
    return f();
  }

  void release() {
    if (context == nullptr) {
      return;
    }
    in_context([&] {
      if (stream != nullptr) {
        cu.stream_sync(stream);
      }
      for (int p = 0; p < 2; p++) {
        if (execs[p] != nullptr) {
          cu.exec_destroy(execs[p]);
        }
        if (graphs[p] != nullptr) {
          cu.graph_destroy(graphs[p]);
        }
      }
      if (staged != nullptr) {
        cu.event_destroy(staged);
      }
      if (staging != nullptr) {
        cu.host_free(staging);
      }
      for (auto e : events) {
        cu.event_destroy(e);
      }
      if (stream != nullptr) {
        cu.stream_destroy(stream);
      }
      if (ring != nullptr) {
        cu.host_free(ring);
      }
      return true;
    });
    cu.release(device);
    context = nullptr;
  }
};

// Modules by a key naming their cubin, loaded once per process (the
// device's primary context lives as long).
std::mutex modules_mutex;
std::unordered_map<std::string, CUmodule> modules;

// Runs an entry point's body, turning a C++ exception into a failure with
// `*error` set: none may cross into Rust.
template <typename F>
int guarded(char** error, F f) {
  *error = nullptr;
  try {
    return f();
  } catch (std::exception& e) {
    *error = copy_out(e.what());
  } catch (...) {
    *error = copy_out("an unknown C++ exception");
  }
  return 1;
}

} // namespace

// Whether `a` was scheduled or computed (not a lazy node yet to run).
extern "C" int emlx_array_scheduled(const mlx_array a) {
  try {
    return mlx_array_get_(a).status() !=
        mlx::core::array::Status::unscheduled;
  } catch (...) {
    return 0;
  }
}

// The device address of an evaluated array's first element on a CUDA build
// of MLX (as MLX's kernels are given it), and its size in bytes. Nonzero
// where the array holds no data. Reading the array on the host afterwards
// may move its buffer (MLX moves device memory to unified memory then).
extern "C" int emlx_array_device_ptr(
    const mlx_array a,
    unsigned long long* ptr,
    size_t* bytes) {
  // Only a CUDA build's buffers are `CudaBuffer`s; it loads the driver.
  static const bool cuda = symbol<void*>("cuDeviceGet") != nullptr;
  if (!cuda) {
    return 4;
  }
  try {
    auto& arr = mlx_array_get_(a);
    if (arr.status() == mlx::core::array::Status::unscheduled) {
      return 1;
    }
    auto* buffer = static_cast<CudaBuffer*>(arr.buffer().ptr());
    if (buffer == nullptr || buffer->data == nullptr) {
      return 2;
    }
    *ptr = reinterpret_cast<unsigned long long>(
        static_cast<char*>(buffer->data) + arr.offset());
    *bytes = arr.nbytes();
    return 0;
  } catch (...) {
    return 3;
  }
}

// A step of `rows` tokens with `slots` ring slots (steps in flight at most).
// Null, with `*error` (malloc'd) saying why, where it cannot be made.
extern "C" void* emlx_cuda_step_new(
    int rows,
    int slots,
    unsigned long long* ring_device,
    char** error) {
  Step* made = nullptr;
  guarded(error, [&] {
    auto step = std::make_unique<Step>();
    auto fail = [&](const std::string& why) {
      *error = copy_out(why);
      step->release();
      return 1;
    };
    if (rows < 1 || slots < 1) {
      return fail("a step needs rows and ring slots");
    }
    if (!step->cu.load()) {
      return fail("the CUDA driver's entry points are not loaded");
    }
    step->rows = rows;
    if (!step->ok(step->cu.device_get(&step->device, 0), "cuDeviceGet") ||
        !step->ok(
            step->cu.retain(&step->context, step->device),
            "retaining the primary context")) {
      step->context = nullptr;
      return fail(step->error);
    }
    bool ready = step->in_context([&] {
      // 1: CU_STREAM_NON_BLOCKING; 1 | 2: CU_EVENT_BLOCKING_SYNC |
      // CU_EVENT_DISABLE_TIMING (a waiting host thread sleeps: it runs a
      // step ahead, so waking late does not idle the device); 1 | 2:
      // CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP.
      if (!step->ok(step->cu.stream_create(&step->stream, 1), "cuStreamCreate")) {
        return false;
      }
      for (int i = 0; i < slots; i++) {
        CUevent e = nullptr;
        if (!step->ok(step->cu.event_create(&e, 3), "cuEventCreate")) {
          return false;
        }
        step->events.push_back(e);
      }
      void* host = nullptr;
      size_t bytes = sizeof(unsigned) * static_cast<size_t>(rows) * slots;
      if (!step->ok(step->cu.host_alloc(&host, bytes, 3), "cuMemHostAlloc")) {
        return false;
      }
      step->ring = static_cast<unsigned*>(host);
      std::memset(host, 0, bytes);
      return step->ok(
          step->cu.host_device_pointer(&step->ring_device, host, 0),
          "cuMemHostGetDevicePointer");
    });
    if (!ready) {
      return fail(step->error);
    }
    *ring_device = step->ring_device;
    made = step.release();
    return 0;
  });
  return made;
}

// Appends a kernel launch: kernel `name` of the cubin `binary`, which `key`
// names (its module is loaded once per process and key), `grid` blocks of
// `block` threads, parameters `values` (pointers and ints, 8 bytes each).
extern "C" int emlx_cuda_step_add(
    void* handle,
    const char* key,
    const char* binary,
    const char* name,
    const unsigned* grid,
    const unsigned* block,
    const unsigned long long* values,
    size_t n,
    char** error) {
  auto* step = static_cast<Step*>(handle);
  return guarded(error, [&] {
    Launch l;
    std::memcpy(l.grid, grid, sizeof l.grid);
    std::memcpy(l.block, block, sizeof l.block);
    l.values.assign(values, values + n);
    bool added = step->in_context([&] {
      std::lock_guard<std::mutex> lock(modules_mutex);
      auto found = modules.find(key);
      CUmodule module = nullptr;
      if (found != modules.end()) {
        module = found->second;
      } else {
        // Relaxed for this thread (2: CU_STREAM_CAPTURE_MODE_RELAXED):
        // loading a module must not invalidate a graph another thread is
        // capturing.
        int mode = 2;
        step->cu.capture_mode(&mode);
        bool loaded =
            step->ok(step->cu.module_load(&module, binary), "cuModuleLoadData");
        step->cu.capture_mode(&mode);
        if (!loaded) {
          return false;
        }
        modules.emplace(key, module);
      }
      return step->ok(
          step->cu.module_function(&l.function, module, name),
          "cuModuleGetFunction");
    });
    if (!added) {
      *error = copy_out(step->error);
      return 1;
    }
    step->launches.push_back(std::move(l));
    auto& last = step->launches.back();
    for (auto& v : last.values) {
      last.params.push_back(&v);
    }
    return 0;
  });
}

namespace {

// One launch, after everything queued before it.
bool launch_plain(Step& step, Launch& l) {
  return step.ok(
      step.cu.launch(
          l.function,
          l.grid[0],
          l.grid[1],
          l.grid[2],
          l.block[0],
          l.block[1],
          l.block[2],
          0,
          step.stream,
          l.params.data(),
          nullptr),
      "cuLaunchKernel");
}

// The launches of part `p` (0 the head, 1 the tail; with no split, part 1
// is the whole step).
bool launch_part(Step& step, int p) {
  size_t from = p == 0 ? 0 : step.split;
  size_t to = p == 0 ? step.split : step.launches.size();
  for (size_t i = from; i < to; i++) {
    auto& l = step.launches[i];
    if (!launch_plain(step, l)) {
      return false;
    }
  }
  return true;
}

} // namespace

// Captures the launches as CUDA graphs: one, or with `split` between 0 and
// the number of launches, the head (the launches before it) and the tail.
// Nonzero, with `*error`, where capture fails; the step then launches kernel
// by kernel.
extern "C" int emlx_cuda_step_capture(void* handle, size_t split, char** error) {
  auto* step = static_cast<Step*>(handle);
  return guarded(error, [&] {
    step->split = split < step->launches.size() ? split : 0;
    bool captured = step->in_context([&] {
      for (int p = step->split > 0 ? 0 : 1; p < 2; p++) {
        // 1: CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, so that MLX's own threads'
        // calls meanwhile neither fail nor break the capture.
        if (!step->ok(
                step->cu.begin_capture(step->stream, 1),
                "cuStreamBeginCapture")) {
          return false;
        }
        bool launched = launch_part(*step, p);
        CUgraph graph = nullptr;
        CUresult ended = step->cu.end_capture(step->stream, &graph);
        if (!launched || !step->ok(ended, "cuStreamEndCapture")) {
          if (graph != nullptr) {
            step->cu.graph_destroy(graph);
          }
          return false;
        }
        step->graphs[p] = graph;
        if (!step->ok(
                step->cu.instantiate(&step->execs[p], graph, 0),
                "cuGraphInstantiate")) {
          return false;
        }
      }
      return true;
    });
    if (!captured) {
      for (int p = 0; p < 2; p++) {
        if (step->execs[p] != nullptr) {
          step->in_context([&] { return step->cu.exec_destroy(step->execs[p]) == 0; });
        }
        step->execs[p] = nullptr;
      }
      *error = copy_out(step->error);
      return 1;
    }
    return 0;
  });
}

namespace {

bool queue_part(Step& step, int p) {
  return step.execs[p] != nullptr
      ? step.ok(step.cu.graph_launch(step.execs[p], step.stream), "cuGraphLaunch")
      : launch_part(step, p);
}

} // namespace

// Queues the head of the next step (a step with a split), whose tail
// `emlx_cuda_step_launch` queues.
extern "C" int emlx_cuda_step_launch_head(void* handle, char** error) {
  auto* step = static_cast<Step*>(handle);
  return guarded(error, [&] {
    if (step->split == 0 || step->head_queued) {
      *error = copy_out("no head to queue: a step without a split, or queued");
      return 1;
    }
    if (!step->in_context([&] { return queue_part(*step, 0); })) {
      *error = copy_out(step->error);
      return 1;
    }
    step->head_queued = true;
    return 0;
  });
}

// Copies `bytes` from the host's `data` to the device's `to` on the step's
// stream, after what is queued there: through pinned memory, so the copy
// does not wait for the stream, and `data` may be reused at once.
extern "C" int emlx_cuda_step_upload(
    void* handle,
    unsigned long long to,
    const void* data,
    size_t bytes,
    char** error) {
  auto* step = static_cast<Step*>(handle);
  return guarded(error, [&] {
    bool copied = step->in_context([&] {
      if (step->staged != nullptr &&
          !step->ok(step->cu.event_sync(step->staged), "cuEventSynchronize")) {
        return false;
      }
      if (step->staging_bytes < bytes) {
        if (step->staging != nullptr) {
          step->cu.host_free(step->staging);
          step->staging = nullptr;
          step->staging_bytes = 0;
        }
        if (!step->ok(step->cu.host_alloc(&step->staging, bytes, 0), "cuMemHostAlloc")) {
          return false;
        }
        step->staging_bytes = bytes;
      }
      if (step->staged == nullptr &&
          !step->ok(step->cu.event_create(&step->staged, 3), "cuEventCreate")) {
        return false;
      }
      std::memcpy(step->staging, data, bytes);
      return step->ok(
                 step->cu.copy_to_device(to, step->staging, bytes, step->stream),
                 "cuMemcpyHtoDAsync") &&
          step->ok(step->cu.event_record(step->staged, step->stream), "cuEventRecord");
    });
    if (!copied) {
      *error = copy_out(step->error);
      return 1;
    }
    return 0;
  });
}

// Queues one step (its graphs, or each kernel where there are none), or the
// tail of one whose head is queued, and marks its slot's event.
extern "C" int emlx_cuda_step_launch(void* handle, char** error) {
  auto* step = static_cast<Step*>(handle);
  return guarded(error, [&] {
    bool queued = step->in_context([&] {
      bool head = step->split == 0 || step->head_queued || queue_part(*step, 0);
      return head && queue_part(*step, 1) &&
          step->ok(
              step->cu.event_record(
                  step->events[step->launched % step->events.size()],
                  step->stream),
              "cuEventRecord");
    });
    step->head_queued = false;
    if (!queued) {
      *error = copy_out(step->error);
      return 1;
    }
    step->launched++;
    return 0;
  });
}

// Waits for step `n` (counted from 0 in launch order, one of the last
// `slots` launched) and copies its `rows` tokens to `tokens`.
extern "C" int emlx_cuda_step_wait(
    void* handle,
    unsigned long long n,
    unsigned* tokens,
    char** error) {
  auto* step = static_cast<Step*>(handle);
  return guarded(error, [&] {
    size_t slots = step->events.size();
    // Launch n + slots reuses n's slot and event.
    if (n >= step->launched || n + slots <= step->launched) {
      *error = copy_out("that step is not in the ring");
      return 1;
    }
    bool done = step->in_context([&] {
      return step->ok(
          step->cu.event_sync(step->events[n % slots]), "cuEventSynchronize");
    });
    if (!done) {
      *error = copy_out(step->error);
      return 1;
    }
    const volatile unsigned* slot = step->ring + (n % slots) * step->rows;
    for (int r = 0; r < step->rows; r++) {
      tokens[r] = slot[r];
    }
    return 0;
  });
}

// Each of the first `count` launches alone, after the one before it has
// finished, `reps` times: the median of each one's device time in
// microseconds into `us`. The launches run again on the step's buffers, so
// `count` must leave out any whose rerun is not harmless (the one that
// moves the positions on).
extern "C" int emlx_cuda_step_time(
    void* handle,
    int reps,
    size_t count,
    float* us,
    char** error) {
  auto* step = static_cast<Step*>(handle);
  return guarded(error, [&] {
    if (step->cu.event_elapsed == nullptr) {
      *error = copy_out("the CUDA driver has no cuEventElapsedTime");
      return 1;
    }
    if (count > step->launches.size() || reps < 1) {
      *error = copy_out("more launches than the step has, or no repetitions");
      return 1;
    }
    CUevent start = nullptr, end = nullptr;
    bool timed = step->in_context([&] {
      // 1: CU_EVENT_BLOCKING_SYNC, timing kept.
      if (!step->ok(step->cu.event_create(&start, 1), "cuEventCreate") ||
          !step->ok(step->cu.event_create(&end, 1), "cuEventCreate") ||
          !step->ok(step->cu.stream_sync(step->stream), "cuStreamSynchronize")) {
        return false;
      }
      std::vector<float> times(static_cast<size_t>(reps));
      for (size_t i = 0; i < count; i++) {
        for (int r = 0; r < reps; r++) {
          float ms = 0.f;
          if (!step->ok(step->cu.event_record(start, step->stream), "cuEventRecord") ||
              !launch_plain(*step, step->launches[i]) ||
              !step->ok(step->cu.event_record(end, step->stream), "cuEventRecord") ||
              !step->ok(step->cu.event_sync(end), "cuEventSynchronize") ||
              !step->ok(step->cu.event_elapsed(&ms, start, end), "cuEventElapsedTime")) {
            return false;
          }
          times[r] = ms * 1000.f;
        }
        std::sort(times.begin(), times.end());
        us[i] = times[times.size() / 2];
      }
      return true;
    });
    step->in_context([&] {
      for (CUevent e : {start, end}) {
        if (e != nullptr) {
          step->cu.event_destroy(e);
        }
      }
      return true;
    });
    if (!timed) {
      *error = copy_out(step->error);
      return 1;
    }
    return 0;
  });
}

// Waits for everything queued on the step's stream, then frees everything
// the step made.
extern "C" void emlx_cuda_step_free(void* handle) {
  auto* step = static_cast<Step*>(handle);
  if (step != nullptr) {
    try {
      step->release();
    } catch (...) {
    }
    delete step;
  }
}
