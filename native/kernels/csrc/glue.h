// What our MLX primitives share with their C entry points: the MLX-C handle
// layout, and building a node without letting a C++ exception reach Rust.
//
// The Rust side hands over MLX-C handles (`mlx_array`, `mlx_stream`): each is
// a struct holding a pointer to a heap-allocated `mlx::core::array` or
// `mlx::core::Stream`, which is the layout declared here.
#pragma once

#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/stream.h"
#include "qmm.h"

namespace mx = mlx::core;

extern "C" {
typedef struct {
  void* ctx;
} emlx_mlx_array;
typedef struct {
  void* ctx;
} emlx_mlx_stream;
// A host function over rows of floats (see RowsToIds): 0 when every row got
// its id, nonzero otherwise; and the drop of its context.
typedef int (*emlx_rows_fn)(void* ctx, const float* x, long rows, int width, uint32_t* out);
typedef void (*emlx_drop_fn)(void* ctx);
}

namespace emlx {

// A row-major copy of a strided array (elements of 2 or 4 bytes).
std::vector<uint8_t> packed(const mx::array& a);

inline void set_error(char* err, size_t len, const char* message) {
  if (err && len) {
    std::strncpy(err, message, len - 1);
    err[len - 1] = '\0';
  }
}

inline const mx::array& array_of(emlx_mlx_array handle) {
  return *static_cast<mx::array*>(handle.ctx);
}

// The C entry of every primitive: `handles_set` says whether the caller's
// required handles are non-null; `build` gets the (CPU) stream and returns
// the node's `n_out` outputs, or nothing when the case is not ours. Returns
// 1 with the outputs in outs[0..n_out) (into the arrays there, if any), 0
// when not ours (a GPU stream and kernels turned off included), -1 with the
// message in err. No C++ exception crosses into Rust.
template <typename Build>
int build_nodes(const char* what, emlx_mlx_array* outs, int n_out, bool handles_set,
                emlx_mlx_stream stream, char* err, size_t err_len, Build build) {
  try {
    if (!outs || !handles_set || !stream.ctx) {
      set_error(err, err_len, (std::string(what) + ": empty handle").c_str());
      return -1;
    }
    const auto& s = *static_cast<mx::Stream*>(stream.ctx);
    if (s.device.type != mx::Device::DeviceType::cpu || !kernels_preferred()) return 0;
    std::optional<std::vector<mx::array>> ys = build(s);
    if (!ys) return 0;
    if ((int)ys->size() != n_out) {
      set_error(err, err_len, (std::string(what) + ": wrong number of outputs").c_str());
      return -1;
    }
    for (int i = 0; i < n_out; ++i) {
      if (outs[i].ctx) {
        *static_cast<mx::array*>(outs[i].ctx) = std::move((*ys)[i]);
      } else {
        outs[i].ctx = new mx::array(std::move((*ys)[i]));
      }
    }
    return 1;
  } catch (const std::exception& e) {
    set_error(err, err_len, e.what());
    return -1;
  } catch (...) {
    set_error(err, err_len, (std::string(what) + ": unknown C++ exception").c_str());
    return -1;
  }
}

// build_nodes for a node of one output.
template <typename Build>
int build_node(const char* what, emlx_mlx_array* out, bool handles_set, emlx_mlx_stream stream,
               char* err, size_t err_len, Build build) {
  return build_nodes(what, out, 1, handles_set, stream, err, err_len,
                     [&](const mx::Stream& s) -> std::optional<std::vector<mx::array>> {
                       std::optional<mx::array> y = build(s);
                       if (!y) return {};
                       return std::vector<mx::array>{std::move(*y)};
                     });
}

}  // namespace emlx
