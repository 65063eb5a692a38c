// MLX integration: an MLX primitive whose CPU evaluation runs our kernels, so
// a decode step stays one lazily built graph that MLX evaluates once, and a C
// API for the Rust side.
//
// The Rust side hands over MLX-C handles (`mlx_array`, `mlx_stream`): each is
// a struct holding a pointer to a heap-allocated `mlx::core::array` or
// `mlx::core::Stream`, which is the layout declared here.
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "qmm.h"
#include "qmm_int8.h"
#include "elementwise.h"

namespace mx = mlx::core;

extern "C" {
typedef struct {
  void* ctx;
} emlx_mlx_array;
typedef struct {
  void* ctx;
} emlx_mlx_stream;
}

namespace emlx {
namespace {

// x [..., K] f32 @ dequantize(w [N, K * bits / 32], scales, biases)^T -> [..., N] f32.
std::vector<uint8_t> packed(const mx::array& a);

class AffineQuantizedLinear : public mx::UnaryPrimitive {
 public:
  AffineQuantizedLinear(mx::Stream stream, int group, int bits)
      : mx::UnaryPrimitive(stream), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));

    QmmArgs args;
    args.bf16_params = inputs[2].dtype() == mx::bfloat16;
    args.y = out.data<float>();
    args.K = x.shape(-1);
    args.M = (int)(x.size() / args.K);
    args.N = w.shape(0);
    args.bits = bits_;
    args.group = group_;

    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    // The inputs' buffers exist now, but their contents are written by work
    // queued before this task on the stream's thread: read them only inside
    // the task. A strided input (a lazily computed transpose, a slice) is
    // packed there rather than by an extra graph node on every projection.
    encoder.dispatch([args, x, w, scales = inputs[2], biases = inputs[3]]() mutable {
      std::vector<std::vector<uint8_t>> held;
      held.reserve(4);
      auto pointer = [&held](const mx::array& a) -> const void* {
        if (a.flags().row_contiguous) return a.data<uint8_t>();
        held.push_back(packed(a));
        return held.back().data();
      };
      args.x = static_cast<const float*>(pointer(x));
      args.w = static_cast<const uint32_t*>(pointer(w));
      args.scales = pointer(scales);
      args.biases = pointer(biases);
      if (selected_activations() == kActivationsInt8)
        qmm_int8(args, selected_isa(), 0);
      else
        qmm(args, selected_isa(), 0);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    // Only built for CPU streams; GPU streams use MLX's quantized_matmul.
    throw std::runtime_error("affine-quantized linear: no GPU evaluation");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

  const char* name() const override { return "AffineQuantizedLinear"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AffineQuantizedLinear&>(other);
    return group_ == o.group_ && bits_ == o.bits_;
  }

 private:
  int group_;
  int bits_;
};

// Softmax over the last axis of a float32 array, causal over its rows when
// `L` > 0 (see softmax.h). MLX's CPU softmax runs on one thread with a
// scalar exp; a prompt's attention weights are most of its elementwise work.
class CausalSoftmax : public mx::UnaryPrimitive {
 public:
  CausalSoftmax(mx::Stream stream, int L) : mx::UnaryPrimitive(stream), L_(L) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    SoftmaxArgs args;
    args.y = out.data<float>();
    args.S = x.shape(-1);
    args.rows = (long)(x.size() / args.S);
    args.L = L_;
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    encoder.dispatch([args, x]() mutable {
      std::vector<uint8_t> held;
      if (!x.flags().row_contiguous) held = packed(x);
      args.x = held.empty() ? x.data<float>() : reinterpret_cast<const float*>(held.data());
      softmax(args, selected_isa(), 0);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("causal softmax: no GPU evaluation");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  const char* name() const override { return "CausalSoftmax"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return L_ == static_cast<const CausalSoftmax&>(other).L_;
  }

 private:
  int L_;
};

// silu(gate) * up from the gate and up projections side by side, [..., 2F]
// -> [..., F]: one node in place of MLX's split, sigmoid and two products,
// threaded and with a vectorized exp.
class Swiglu : public mx::UnaryPrimitive {
 public:
  explicit Swiglu(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    SwigluArgs args;
    args.y = out.data<float>();
    args.F = out.shape(-1);
    args.rows = (long)(out.size() / args.F);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    encoder.dispatch([args, x]() mutable {
      std::vector<uint8_t> held;
      if (!x.flags().row_contiguous) held = packed(x);
      args.x = held.empty() ? x.data<float>() : reinterpret_cast<const float*>(held.data());
      swiglu(args, selected_isa(), 0);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("swiglu: no GPU evaluation");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() /= 2;
    return {shape};
  }

  const char* name() const override { return "Swiglu"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// RMSNorm over the last axis with a weight [D] or [R, D] (R the
// second-to-last axis of x): one node in place of MLX's CPU expansion.
class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    RmsNormArgs args;
    args.y = out.data<float>();
    args.D = x.shape(-1);
    args.rows = (long)(x.size() / args.D);
    args.R = w.ndim() == 2 ? w.shape(0) : 1;
    args.eps = eps_;
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    encoder.dispatch([args, x, w]() mutable {
      std::vector<uint8_t> hx, hw;
      if (!x.flags().row_contiguous) hx = packed(x);
      if (!w.flags().row_contiguous) hw = packed(w);
      args.x = hx.empty() ? x.data<float>() : reinterpret_cast<const float*>(hx.data());
      args.w = hw.empty() ? w.data<float>() : reinterpret_cast<const float*>(hw.data());
      rms_norm(args, selected_isa(), 0);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("rms_norm: no GPU evaluation");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  const char* name() const override { return "RmsNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

 private:
  float eps_;
};

// Per-head RMSNorm (optional) and rotary embedding from a table: inputs
// x [B, L, H, hd], cos and signed sin [T, L, hd] (T = 1 or B), and the norm
// weight [H, hd] when there is one. One node where MLX builds about ten.
class NormRope : public mx::UnaryPrimitive {
 public:
  NormRope(mx::Stream stream, float eps, bool traditional)
      : mx::UnaryPrimitive(stream), eps_(eps), traditional_(traditional) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const mx::array& x = inputs[0];
    NormRopeArgs args;
    args.y = out.data<float>();
    args.B = x.shape(0);
    args.L = x.shape(1);
    args.H = x.shape(2);
    args.hd = x.shape(3);
    args.T = inputs[1].shape(0);
    args.eps = eps_;
    args.traditional = traditional_;
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([args, inputs]() mutable {
      std::vector<std::vector<uint8_t>> held;
      held.reserve(4);
      auto pointer = [&held](const mx::array& a) -> const float* {
        if (a.flags().row_contiguous) return a.data<float>();
        held.push_back(packed(a));
        return reinterpret_cast<const float*>(held.back().data());
      };
      args.x = pointer(inputs[0]);
      args.cos = pointer(inputs[1]);
      args.sin = pointer(inputs[2]);
      args.w = inputs.size() > 3 ? pointer(inputs[3]) : nullptr;
      norm_rope(args, 0);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("norm_rope: no GPU evaluation");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  const char* name() const override { return "NormRope"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const NormRope&>(other);
    return eps_ == o.eps_ && traditional_ == o.traditional_;
  }

 private:
  float eps_;
  bool traditional_;
};

// A row-major copy of a strided array (elements of 2 or 4 bytes).
std::vector<uint8_t> packed(const mx::array& a) {
  const size_t item = a.itemsize();
  std::vector<uint8_t> out(a.size() * item);
  const uint8_t* src = a.data<uint8_t>();
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const int nd = (int)a.ndim();
  std::vector<int> index(nd, 0);
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t offset = 0;
    for (int d = 0; d < nd; ++d) offset += index[d] * strides[d];
    std::memcpy(out.data() + i * item, src + offset * item, item);
    for (int d = nd - 1; d >= 0; --d) {
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

void set_error(char* err, size_t len, const char* message) {
  if (err && len) {
    std::strncpy(err, message, len - 1);
    err[len - 1] = '\0';
  }
}

}  // namespace
}  // namespace emlx

extern "C" {

// Builds `x @ dequantize(w, scales, biases)^T` with our primitive into *out.
// Returns 1 when built, 0 when this case is not ours (GPU stream, dtype, bit
// width, group size or shapes outside what the kernels take; the caller then
// uses MLX's own quantized_matmul, which also reports bad shapes), -1 on an
// error (message in err).
int emlx_kernels_quantized_linear(emlx_mlx_array* out, emlx_mlx_array x, emlx_mlx_array w,
                                  emlx_mlx_array scales, emlx_mlx_array biases, int group,
                                  int bits, emlx_mlx_stream stream, char* err, size_t err_len) {
  try {
    if (!out || !x.ctx || !w.ctx || !scales.ctx || !biases.ctx || !stream.ctx) {
      emlx::set_error(err, err_len, "affine-quantized linear: empty handle");
      return -1;
    }
    const auto& s = *static_cast<mx::Stream*>(stream.ctx);
    const auto& X = *static_cast<mx::array*>(x.ctx);
    const auto& Wq = *static_cast<mx::array*>(w.ctx);
    const auto& S = *static_cast<mx::array*>(scales.ctx);
    const auto& B = *static_cast<mx::array*>(biases.ctx);
    if (s.device.type != mx::Device::DeviceType::cpu || !emlx::kernels_preferred()) return 0;
    if (bits != 4 && bits != 8) return 0;
    if (group != 32 && group != 64 && group != 128) return 0;
    if (X.dtype() != mx::float32 || Wq.dtype() != mx::uint32 ||
        (S.dtype() != mx::float32 && S.dtype() != mx::bfloat16) || B.dtype() != S.dtype())
      return 0;
    if (X.ndim() < 1 || Wq.ndim() != 2 || S.ndim() != 2 || B.ndim() != 2) return 0;
    const long K = X.shape(-1);
    const long N = Wq.shape(0);
    if (K <= 0 || N <= 0 || X.size() == 0 || K % group != 0) return 0;
    if (Wq.shape(1) != K * bits / 32 || S.shape(0) != N || S.shape(1) != K / group ||
        B.shape() != S.shape())
      return 0;
    if (X.size() / K > (1L << 30) || K > (1L << 30) || N > (1L << 30)) return 0;

    mx::Shape shape = X.shape();
    shape.back() = (int)N;
    auto primitive = std::make_shared<emlx::AffineQuantizedLinear>(s, group, bits);
    mx::array y(std::move(shape), mx::float32, primitive,
                {X, Wq, S, B});
    if (out->ctx) {
      *static_cast<mx::array*>(out->ctx) = std::move(y);
    } else {
      out->ctx = new mx::array(std::move(y));
    }
    return 1;
  } catch (const std::exception& e) {
    emlx::set_error(err, err_len, e.what());
    return -1;
  } catch (...) {
    emlx::set_error(err, err_len, "affine-quantized linear: unknown C++ exception");
    return -1;
  }
}

// Builds the softmax of `x` over its last axis (causal over `L` queries when
// `L` > 0) with our primitive into *out. Returns 1 when built, 0 when not
// ours (GPU stream, kernels off, not float32, shapes), -1 on an error.
int emlx_kernels_causal_softmax(emlx_mlx_array* out, emlx_mlx_array x, int L,
                                emlx_mlx_stream stream, char* err, size_t err_len) {
  try {
    if (!out || !x.ctx || !stream.ctx) {
      emlx::set_error(err, err_len, "causal softmax: empty handle");
      return -1;
    }
    const auto& s = *static_cast<mx::Stream*>(stream.ctx);
    const auto& X = *static_cast<mx::array*>(x.ctx);
    if (s.device.type != mx::Device::DeviceType::cpu || !emlx::kernels_preferred()) return 0;
    if (X.dtype() != mx::float32 || X.ndim() < 1 || X.size() == 0) return 0;
    const long S = X.shape(-1);
    const long rows = (long)(X.size() / S);
    if (L < 0 || L > S || (L > 0 && rows % L != 0) || S > (1L << 30)) return 0;
    mx::array y(X.shape(), mx::float32, std::make_shared<emlx::CausalSoftmax>(s, L), {X});
    if (out->ctx) {
      *static_cast<mx::array*>(out->ctx) = std::move(y);
    } else {
      out->ctx = new mx::array(std::move(y));
    }
    return 1;
  } catch (const std::exception& e) {
    emlx::set_error(err, err_len, e.what());
    return -1;
  } catch (...) {
    emlx::set_error(err, err_len, "causal softmax: unknown C++ exception");
    return -1;
  }
}

// Builds silu(x[..., :F]) * x[..., F:] for x [..., 2F] with our primitive
// into *out; returns as emlx_kernels_causal_softmax does.
int emlx_kernels_swiglu(emlx_mlx_array* out, emlx_mlx_array x, emlx_mlx_stream stream, char* err,
                        size_t err_len) {
  try {
    if (!out || !x.ctx || !stream.ctx) {
      emlx::set_error(err, err_len, "swiglu: empty handle");
      return -1;
    }
    const auto& s = *static_cast<mx::Stream*>(stream.ctx);
    const auto& X = *static_cast<mx::array*>(x.ctx);
    if (s.device.type != mx::Device::DeviceType::cpu || !emlx::kernels_preferred()) return 0;
    if (X.dtype() != mx::float32 || X.ndim() < 1 || X.size() == 0) return 0;
    if (X.shape(-1) % 2 != 0 || X.shape(-1) > (1L << 30)) return 0;
    mx::Shape shape = X.shape();
    shape.back() /= 2;
    mx::array y(std::move(shape), mx::float32, std::make_shared<emlx::Swiglu>(s), {X});
    if (out->ctx) {
      *static_cast<mx::array*>(out->ctx) = std::move(y);
    } else {
      out->ctx = new mx::array(std::move(y));
    }
    return 1;
  } catch (const std::exception& e) {
    emlx::set_error(err, err_len, e.what());
    return -1;
  } catch (...) {
    emlx::set_error(err, err_len, "swiglu: unknown C++ exception");
    return -1;
  }
}

// Builds RMSNorm of x over its last axis with weight w ([D], or [R, D] with
// R = x's second-to-last axis) into *out; returns as the builders above.
int emlx_kernels_rms_norm(emlx_mlx_array* out, emlx_mlx_array x, emlx_mlx_array w, float eps,
                          emlx_mlx_stream stream, char* err, size_t err_len) {
  try {
    if (!out || !x.ctx || !w.ctx || !stream.ctx) {
      emlx::set_error(err, err_len, "rms_norm: empty handle");
      return -1;
    }
    const auto& s = *static_cast<mx::Stream*>(stream.ctx);
    const auto& X = *static_cast<mx::array*>(x.ctx);
    const auto& Wt = *static_cast<mx::array*>(w.ctx);
    if (s.device.type != mx::Device::DeviceType::cpu || !emlx::kernels_preferred()) return 0;
    if (X.dtype() != mx::float32 || Wt.dtype() != mx::float32 || X.ndim() < 1 || X.size() == 0)
      return 0;
    const int D = X.shape(-1);
    if (Wt.shape(-1) != D || D > (1 << 30)) return 0;
    if (Wt.ndim() == 2) {
      if (X.ndim() < 2 || X.shape(-2) != Wt.shape(0)) return 0;
    } else if (Wt.ndim() != 1) {
      return 0;
    }
    mx::array y(X.shape(), mx::float32, std::make_shared<emlx::RmsNorm>(s, eps), {X, Wt});
    if (out->ctx) {
      *static_cast<mx::array*>(out->ctx) = std::move(y);
    } else {
      out->ctx = new mx::array(std::move(y));
    }
    return 1;
  } catch (const std::exception& e) {
    emlx::set_error(err, err_len, e.what());
    return -1;
  } catch (...) {
    emlx::set_error(err, err_len, "rms_norm: unknown C++ exception");
    return -1;
  }
}

// Builds NormRope (see the class) into *out; `w.ctx` null for no norm.
// Returns as the builders above.
int emlx_kernels_norm_rope(emlx_mlx_array* out, emlx_mlx_array x, emlx_mlx_array w, float eps,
                           emlx_mlx_array cos, emlx_mlx_array sin, int traditional,
                           emlx_mlx_stream stream, char* err, size_t err_len) {
  try {
    if (!out || !x.ctx || !cos.ctx || !sin.ctx || !stream.ctx) {
      emlx::set_error(err, err_len, "norm_rope: empty handle");
      return -1;
    }
    const auto& s = *static_cast<mx::Stream*>(stream.ctx);
    const auto& X = *static_cast<mx::array*>(x.ctx);
    const auto& C = *static_cast<mx::array*>(cos.ctx);
    const auto& S = *static_cast<mx::array*>(sin.ctx);
    if (s.device.type != mx::Device::DeviceType::cpu || !emlx::kernels_preferred()) return 0;
    if (X.dtype() != mx::float32 || C.dtype() != mx::float32 || S.dtype() != mx::float32) return 0;
    if (X.ndim() != 4 || X.size() == 0) return 0;
    const int B = X.shape(0), L = X.shape(1), H = X.shape(2), hd = X.shape(3);
    if (hd % 2 != 0 || hd > 1024) return 0;
    if (C.ndim() != 3 || C.shape() != S.shape() || C.shape(1) != L || C.shape(2) != hd ||
        (C.shape(0) != 1 && C.shape(0) != B))
      return 0;
    std::vector<mx::array> inputs{X, C, S};
    if (w.ctx) {
      const auto& Wt = *static_cast<mx::array*>(w.ctx);
      if (Wt.dtype() != mx::float32 || Wt.ndim() != 2 || Wt.shape(0) != H || Wt.shape(1) != hd)
        return 0;
      inputs.push_back(Wt);
    }
    mx::array y(X.shape(), mx::float32,
                std::make_shared<emlx::NormRope>(s, eps, traditional != 0), std::move(inputs));
    if (out->ctx) {
      *static_cast<mx::array*>(out->ctx) = std::move(y);
    } else {
      out->ctx = new mx::array(std::move(y));
    }
    return 1;
  } catch (const std::exception& e) {
    emlx::set_error(err, err_len, e.what());
    return -1;
  } catch (...) {
    emlx::set_error(err, err_len, "norm_rope: unknown C++ exception");
    return -1;
  }
}

int emlx_kernels_rms_norm_raw(const float* x, const float* w, float* y, long rows, int D, int R,
                              float eps, int isa, int threads) {
  if (isa < emlx::kScalar || isa > emlx::kAvx512 || !emlx::isa_supported((emlx::Isa)isa))
    return -1;
  emlx::RmsNormArgs args{x, w, y, rows, D, R, eps};
  emlx::rms_norm(args, (emlx::Isa)isa, threads);
  return 0;
}

int emlx_kernels_swiglu_raw(const float* x, float* y, long rows, int F, int isa, int threads) {
  if (isa < emlx::kScalar || isa > emlx::kAvx512 || !emlx::isa_supported((emlx::Isa)isa))
    return -1;
  emlx::SwigluArgs args{x, y, rows, F};
  emlx::swiglu(args, (emlx::Isa)isa, threads);
  return 0;
}

// The softmax on plain buffers with a chosen variant and thread count.
int emlx_kernels_softmax(const float* x, float* y, long rows, int S, int L, int isa, int threads) {
  if (isa < emlx::kScalar || isa > emlx::kAvx512 || !emlx::isa_supported((emlx::Isa)isa))
    return -1;
  emlx::SoftmaxArgs args{x, y, rows, S, L};
  emlx::softmax(args, (emlx::Isa)isa, threads);
  return 0;
}

// The product on plain buffers with a chosen variant (0 scalar, 1 AVX2,
// 2 AVX-512) and at most `threads` threads (0: the whole pool). Returns 0, or
// -1 when the variant does not run on this CPU.
int emlx_kernels_qmm(const float* x, const uint32_t* w, const float* scales,
                     const float* biases, float* y, int M, int N, int K, int bits, int group,
                     int isa, int threads) {
  if (isa < emlx::kScalar || isa > emlx::kAvx512 || !emlx::isa_supported((emlx::Isa)isa))
    return -1;
  emlx::QmmArgs args{x, w, scales, biases, y, M, N, K, bits, group};
  emlx::qmm(args, (emlx::Isa)isa, threads);
  return 0;
}

// The same with int8 activations (see qmm_int8.cpp); scales and biases in
// bfloat16 when `bf16_params`.
int emlx_kernels_qmm_int8(const float* x, const uint32_t* w, const void* scales,
                          const void* biases, int bf16_params, float* y, int M, int N, int K,
                          int bits, int group, int isa, int threads) {
  if (isa < emlx::kScalar || isa > emlx::kAvx512 || !emlx::isa_supported((emlx::Isa)isa))
    return -1;
  emlx::QmmArgs args{x, w, scales, biases, y, M, N, K, bits, group, bf16_params != 0};
  emlx::qmm_int8(args, (emlx::Isa)isa, threads);
  return 0;
}

int emlx_kernels_activations() { return emlx::selected_activations(); }

int emlx_kernels_int8_vnni() {
#if defined(__x86_64__)
  return emlx::vnni_supported();
#else
  return 0;
#endif
}

int emlx_kernels_selected_isa() { return emlx::selected_isa(); }

int emlx_kernels_isa_supported(int isa) {
  return isa >= emlx::kScalar && isa <= emlx::kAvx512 && emlx::isa_supported((emlx::Isa)isa);
}

int emlx_kernels_threads() { return emlx::Pool::shared().size(); }
}
