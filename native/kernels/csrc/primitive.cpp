// MLX integration: MLX primitives whose CPU evaluation runs our kernels, so
// a decode step stays one lazily built graph that MLX evaluates once, and a C
// API for the Rust side (see glue.h for the handles).
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "elementwise.h"
#include "experts.h"
#include "glue.h"
#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "qmm.h"
#include "qmm_int8.h"

namespace emlx {
namespace {

// What our primitives share: built for CPU streams only, an output shaped
// as the first input unless a primitive says otherwise, and a CPU
// evaluation that allocates the output and queues the kernel as a task of
// the stream.
class KernelPrimitive : public mx::UnaryPrimitive {
 public:
  KernelPrimitive(mx::Stream stream, const char* what)
      : mx::UnaryPrimitive(stream), what_(what) {}

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    // GPU streams use MLX's own ops.
    throw std::runtime_error(std::string(what_) + ": no GPU evaluation");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 protected:
  // Allocates `out` and queues `run(in, y)`, `in[i]` the row-major contents
  // of `inputs[i]` and `y` the output's floats. The inputs' buffers exist
  // now, but their contents are written by work queued before this task on
  // the stream's thread: they are read only inside the task. A strided
  // input (a lazily computed transpose, a slice) is packed there rather
  // than by an extra graph node.
  template <typename Run>
  void dispatch(const std::vector<mx::array>& inputs, mx::array& out, Run run) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([inputs, run, y = out.data<float>()]() mutable {
      std::vector<std::vector<uint8_t>> held;
      held.reserve(inputs.size());
      std::vector<const void*> in;
      in.reserve(inputs.size());
      for (const auto& a : inputs) {
        if (a.flags().row_contiguous) {
          in.push_back(a.data<uint8_t>());
        } else {
          held.push_back(packed(a));
          in.push_back(held.back().data());
        }
      }
      run(in, y);
    });
  }

 private:
  const char* what_;
};

using Inputs = std::vector<const void*>;

const float* floats(const void* p) { return static_cast<const float*>(p); }

// x [..., K] f32 @ dequantize(w [N, K * bits / 32], scales, biases)^T -> [..., N] f32.
class AffineQuantizedLinear : public KernelPrimitive {
 public:
  AffineQuantizedLinear(mx::Stream stream, int group, int bits)
      : KernelPrimitive(stream, "affine-quantized linear"), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    QmmArgs args;
    args.bf16_params = inputs[2].dtype() == mx::bfloat16;
    args.K = inputs[0].shape(-1);
    args.M = (int)(inputs[0].size() / args.K);
    args.N = inputs[1].shape(0);
    args.bits = bits_;
    args.group = group_;
    dispatch(inputs, out, [args](const Inputs& in, float* y) mutable {
      args.x = floats(in[0]);
      args.w = static_cast<const uint32_t*>(in[1]);
      args.scales = in[2];
      args.biases = in[3];
      args.y = y;
      qmm_selected(args, selected_isa(), 0);
    });
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

// Routed experts: x [T, R, K] f32, w [E, N, K * bits / 32], scales and
// biases [E, N, K / group], ids [T, C] (int32 or uint32) -> [T, C, N] f32,
// row (t, c) being x[t, R == 1 ? 0 : c] through expert ids[t, c]'s weight.
// The rows of each expert go through it as one product, so a weight is
// read once for all the tokens that chose it.
class GatheredQuantizedLinear : public KernelPrimitive {
 public:
  GatheredQuantizedLinear(mx::Stream stream, int group, int bits)
      : KernelPrimitive(stream, "gathered affine-quantized linear"), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const int T = inputs[4].shape(0), C = inputs[4].shape(1);
    const int R = inputs[0].shape(1), K = inputs[0].shape(2);
    const int E = inputs[1].shape(0), N = inputs[1].shape(1);
    const bool bf16 = inputs[2].dtype() == mx::bfloat16;
    const int bits = bits_, group = group_;
    dispatch(inputs, out, [=](const Inputs& in, float* y) {
      const float* x = floats(in[0]);
      const uint32_t* ids = static_cast<const uint32_t*>(in[4]);
      // The router cannot pick ids of E or more; a bad id gives zeros, not
      // a read out of the weights.
      for (long r = 0; r < (long)T * C; ++r)
        if (ids[r] >= (uint32_t)E) std::memset(y + r * N, 0, sizeof(float) * N);
      const ExpertRows g = rows_by_expert(ids, (long)T * C, E);
      const long wrow = (long)K * bits / 32, prow = K / group;
      const size_t psize = bf16 ? 2 : 4;
      // Expert e's rows through its weight, on `threads` threads.
      auto product = [&](int e, int threads) {
        const int n = g.start[e + 1] - g.start[e];
        const int* rows = g.order.data() + g.start[e];
        auto row_of = [&](int r) { return x + ((long)(r / C) * R + (R == 1 ? 0 : r % C)) * K; };
        QmmArgs a;
        a.bf16_params = bf16;
        a.M = n;
        a.N = N;
        a.K = K;
        a.bits = bits;
        a.group = group;
        a.w = static_cast<const uint32_t*>(in[1]) + (long)e * N * wrow;
        a.scales = static_cast<const uint8_t*>(in[2]) + (size_t)e * N * prow * psize;
        a.biases = static_cast<const uint8_t*>(in[3]) + (size_t)e * N * prow * psize;
        std::vector<float> xs, ys;
        if (n == 1) {
          a.x = row_of(rows[0]);
          a.y = y + (long)rows[0] * N;
        } else {
          xs.resize((size_t)n * K);
          ys.resize((size_t)n * N);
          for (int i = 0; i < n; ++i) std::memcpy(xs.data() + (size_t)i * K, row_of(rows[i]), sizeof(float) * K);
          a.x = xs.data();
          a.y = ys.data();
        }
        qmm_selected(a, selected_isa(), threads);
        if (n > 1)
          for (int i = 0; i < n; ++i)
            std::memcpy(y + (long)rows[i] * N, ys.data() + (size_t)i * N, sizeof(float) * N);
      };
      for_each_expert(g.used, product);
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[4].shape(0), inputs[4].shape(1), inputs[1].shape(1)}};
  }

  const char* name() const override { return "GatheredQuantizedLinear"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const GatheredQuantizedLinear&>(other);
    return group_ == o.group_ && bits_ == o.bits_;
  }

 private:
  int group_;
  int bits_;
};

// A prompt chunk's causal attention (see PromptAttentionArgs): q [B, nkv,
// G * L, hd] float32, scaled, and the cache's keys and values [B, nkv, S,
// hd] (float32 or float16) -> [B, nkv, G * L, hd]. The keys and values are
// read where they lie, a slice of the cache's buffers: only a view whose
// rows are not contiguous is copied first.
class PromptAttention : public KernelPrimitive {
 public:
  PromptAttention(mx::Stream stream, int L) : KernelPrimitive(stream, "prompt attention"), L_(L) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const int L = L_;
    encoder.dispatch([inputs, L, y = out.data<float>()]() {
      const auto& Q = inputs[0];
      const auto& K = inputs[1];
      std::vector<uint8_t> q_held, k_held, v_held;
      if (!Q.flags().row_contiguous) q_held = packed(Q);
      PromptAttentionArgs a;
      a.q = q_held.empty() ? Q.data<float>() : reinterpret_cast<const float*>(q_held.data());
      a.B = K.shape(0);
      a.nkv = K.shape(1);
      a.S = K.shape(2);
      a.hd = K.shape(3);
      a.G = Q.shape(2) / L;
      a.L = L;
      a.bits = K.dtype() == mx::float16 ? 16 : 32;
      // Rows of hd contiguous values at the same strides in both, or copies.
      auto rows_in_place = [&](const mx::array& x) {
        const auto& st = x.strides();
        return st[3] == 1 && (st[2] == a.hd || x.shape(2) == 1) &&
               st == inputs[1].strides() && st == inputs[2].strides();
      };
      if (rows_in_place(K) && rows_in_place(inputs[2])) {
        a.keys = K.data<uint8_t>();
        a.values = inputs[2].data<uint8_t>();
        a.batch_stride = K.strides()[0];
        a.head_stride = K.strides()[1];
      } else {
        k_held = packed(K);
        v_held = packed(inputs[2]);
        a.keys = k_held.data();
        a.values = v_held.data();
        a.head_stride = (long)a.S * a.hd;
        a.batch_stride = a.head_stride * a.nkv;
      }
      a.out = y;
      prompt_attention(a, selected_isa());
    });
  }

  const char* name() const override { return "PromptAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return L_ == static_cast<const PromptAttention&>(other).L_;
  }

 private:
  int L_;
};

// silu(gate) * up from the gate and up projections side by side, [..., 2F]
// -> [..., F]: one node in place of MLX's split, sigmoid and two products,
// threaded and with a vectorized exp.
class Swiglu : public KernelPrimitive {
 public:
  explicit Swiglu(mx::Stream stream) : KernelPrimitive(stream, "swiglu") {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    SwigluArgs args;
    args.F = out.shape(-1);
    args.rows = (long)(out.size() / args.F);
    dispatch(inputs, out, [args](const Inputs& in, float* y) mutable {
      args.x = floats(in[0]);
      args.y = y;
      swiglu(args, selected_isa(), 0);
    });
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
class RmsNorm : public KernelPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : KernelPrimitive(stream, "rms_norm"), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    RmsNormArgs args;
    args.D = x.shape(-1);
    args.rows = (long)(x.size() / args.D);
    args.R = w.ndim() == 2 ? w.shape(0) : 1;
    args.eps = eps_;
    dispatch(inputs, out, [args](const Inputs& in, float* y) mutable {
      args.x = floats(in[0]);
      args.w = floats(in[1]);
      args.y = y;
      rms_norm(args, selected_isa(), 0);
    });
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
class NormRope : public KernelPrimitive {
 public:
  NormRope(mx::Stream stream, float eps, bool traditional)
      : KernelPrimitive(stream, "norm_rope"), eps_(eps), traditional_(traditional) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    NormRopeArgs args;
    args.B = x.shape(0);
    args.L = x.shape(1);
    args.H = x.shape(2);
    args.hd = x.shape(3);
    args.T = inputs[1].shape(0);
    args.eps = eps_;
    args.traditional = traditional_;
    dispatch(inputs, out, [args](const Inputs& in, float* y) mutable {
      args.x = floats(in[0]);
      args.cos = floats(in[1]);
      args.sin = floats(in[2]);
      args.w = in.size() > 3 ? floats(in[3]) : nullptr;
      args.y = y;
      norm_rope(args, 0);
    });
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

// One uint32 per row of a float32 [rows, width] array, computed by a
// function the caller hands over (the engine's host sampler), as a task of
// the CPU stream: a token chosen on the host becomes a node of the step's
// graph, so the host queues the next step instead of waiting for logits.
// The function's context is shared with each queued task: an evaluated node
// is detached before its task runs.
class RowsToIds : public mx::UnaryPrimitive {
 public:
  RowsToIds(mx::Stream stream, emlx_rows_fn fn) : mx::UnaryPrimitive(stream), fn_(fn) {}

  // From here on the node drops `ctx` with `drop` once no task needs it.
  void own(void* ctx, emlx_drop_fn drop) { ctx_ = std::shared_ptr<void>(ctx, drop); }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("rows to ids: no GPU evaluation");
  }

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    encoder.dispatch([x, fn = fn_, ctx = ctx_, y = out.data<uint32_t>()]() {
      const long rows = x.shape(0);
      const int width = x.shape(1);
      std::vector<uint8_t> held;
      if (!x.flags().row_contiguous) held = packed(x);
      const float* p = held.empty() ? x.data<float>() : reinterpret_cast<const float*>(held.data());
      // A failed row (the function reports it) reads as an id past any vocabulary.
      if (!ctx || fn(ctx.get(), p, rows, width, y) != 0) std::fill(y, y + rows, UINT32_MAX);
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0)}};
  }

  const char* name() const override { return "RowsToIds"; }

  bool is_equivalent(const mx::Primitive&) const override { return false; }

 private:
  emlx_rows_fn fn_;
  std::shared_ptr<void> ctx_;
};

// A raw-buffer kernel with a chosen variant: 0 when it ran, -1 when the
// variant does not run on this CPU.
template <typename Run>
int run_raw(int isa, Run run) {
  if (isa < kScalar || isa > kAvx512 || !isa_supported((Isa)isa)) return -1;
  run((Isa)isa);
  return 0;
}

}  // namespace

std::vector<uint8_t> packed(const mx::array& a) {
  const size_t item = a.itemsize();
  std::vector<uint8_t> out(a.size() * item);
  if (a.size() == 0) return out;
  const uint8_t* src = a.data<uint8_t>();
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const int nd = (int)a.ndim();
  if (nd == 0) {
    std::memcpy(out.data(), src, item);
    return out;
  }
  // Row by row along the last axis: one copy per row when it is contiguous
  // (a slice of heads, say), element by element otherwise.
  const int64_t row = shape[nd - 1];
  const int64_t step = strides[nd - 1];
  std::vector<int> index(nd, 0);
  for (size_t i = 0; i < a.size(); i += row) {
    int64_t offset = 0;
    for (int d = 0; d < nd - 1; ++d) offset += index[d] * strides[d];
    uint8_t* dst = out.data() + i * item;
    if (step == 1) {
      std::memcpy(dst, src + offset * item, row * item);
    } else {
      for (int64_t j = 0; j < row; ++j)
        std::memcpy(dst + j * item, src + (offset + j * step) * item, item);
    }
    for (int d = nd - 2; d >= 0; --d) {
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

// Whether our products take x (float32, last axis K) through the
// affine-quantized weight (Wq, S, B) of `rank` axes: uint32 words
// [..., N, K * bits / 32] and float32 or bfloat16 scales and biases
// [..., N, K / group], the leading axes (stacked experts) alike.
static bool takes_product(const mx::array& X, const mx::array& Wq, const mx::array& S,
                          const mx::array& B, int group, int bits, int rank) {
  if (bits != 4 && bits != 8) return false;
  if (group != 32 && group != 64 && group != 128) return false;
  if (X.dtype() != mx::float32 || Wq.dtype() != mx::uint32 ||
      (S.dtype() != mx::float32 && S.dtype() != mx::bfloat16) || B.dtype() != S.dtype())
    return false;
  if (rank < 1 || X.ndim() < 1 || Wq.ndim() != static_cast<size_t>(rank) ||
      S.ndim() != static_cast<size_t>(rank) || B.shape() != S.shape())
    return false;
  const long K = X.shape(-1), N = Wq.shape(-2);
  if (K <= 0 || N <= 0 || X.size() == 0 || K % group != 0) return false;
  if (Wq.shape(-1) != K * bits / 32 || S.shape(-2) != N || S.shape(-1) != K / group) return false;
  for (int i = 0; i < rank - 2; ++i)
    if (S.shape(i) != Wq.shape(i)) return false;
  return K <= (1L << 30) && N <= (1L << 30);
}

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
  const bool set = x.ctx && w.ctx && scales.ctx && biases.ctx;
  return emlx::build_node(
      "affine-quantized linear", out, set, stream, err, err_len,
      [&](const mx::Stream& s) -> std::optional<mx::array> {
        const auto& X = emlx::array_of(x);
        const auto& Wq = emlx::array_of(w);
        const auto& S = emlx::array_of(scales);
        const auto& B = emlx::array_of(biases);
        if (!emlx::takes_product(X, Wq, S, B, group, bits, 2)) return {};
        const long K = X.shape(-1);
        const long N = Wq.shape(0);
        if (X.size() / K > (1L << 30)) return {};
        mx::Shape shape = X.shape();
        shape.back() = (int)N;
        auto primitive = std::make_shared<emlx::AffineQuantizedLinear>(s, group, bits);
        return mx::array(std::move(shape), mx::float32, primitive, {X, Wq, S, B});
      });
}

// Builds GatheredQuantizedLinear (see the class) into *out. Returns 1 when
// built, 0 when the case is not ours (GPU stream, dtypes, bit width, group
// size or shapes outside what the kernels take: the caller then uses MLX's
// gather_qmm), -1 on an error (message in err).
int emlx_kernels_gathered_quantized_linear(emlx_mlx_array* out, emlx_mlx_array x, emlx_mlx_array w,
                                           emlx_mlx_array scales, emlx_mlx_array biases,
                                           emlx_mlx_array ids, int group, int bits,
                                           emlx_mlx_stream stream, char* err, size_t err_len) {
  const bool set = x.ctx && w.ctx && scales.ctx && biases.ctx && ids.ctx;
  return emlx::build_node(
      "gathered affine-quantized linear", out, set, stream, err, err_len,
      [&](const mx::Stream& s) -> std::optional<mx::array> {
        const auto& X = emlx::array_of(x);
        const auto& Wq = emlx::array_of(w);
        const auto& S = emlx::array_of(scales);
        const auto& B = emlx::array_of(biases);
        const auto& I = emlx::array_of(ids);
        if (!emlx::takes_product(X, Wq, S, B, group, bits, 3)) return {};
        if (X.ndim() != 3 || I.ndim() != 2 || (I.dtype() != mx::uint32 && I.dtype() != mx::int32))
          return {};
        const long T = I.shape(0), C = I.shape(1), R = X.shape(1);
        const long E = Wq.shape(0), N = Wq.shape(1);
        if (T <= 0 || C <= 0 || E <= 0 || X.shape(0) != T || (R != 1 && R != C)) return {};
        if (T * C > (1L << 30) || E * N > (1L << 30)) return {};
        // Negative int32 ids read as large unsigned ones: zeros, as above.
        const auto I32 = I.dtype() == mx::uint32 ? I : mx::view(I, mx::uint32, s);
        auto primitive = std::make_shared<emlx::GatheredQuantizedLinear>(s, group, bits);
        return mx::array({(int)T, (int)C, (int)N}, mx::float32, primitive, {X, Wq, S, B, I32});
      });
}

// Builds RowsToIds (see the class) over x [rows, width] into *out. Returns 1
// when built, the node then owning `ctx` (dropped with `drop`); 0 when not
// ours (GPU stream, kernels off, not float32 2-D), `ctx` still the caller's;
// -1 on an error, `ctx` then possibly the node's: the caller must not drop it.
int emlx_kernels_rows_to_ids(emlx_mlx_array* out, emlx_mlx_array x, emlx_rows_fn fn, void* ctx,
                             emlx_drop_fn drop, emlx_mlx_stream stream, char* err,
                             size_t err_len) {
  return emlx::build_node(
      "rows to ids", out, x.ctx && fn && ctx && drop, stream, err, err_len,
      [&](const mx::Stream& s) -> std::optional<mx::array> {
        const auto& X = emlx::array_of(x);
        if (X.dtype() != mx::float32 || X.ndim() != 2 || X.size() == 0) return {};
        auto primitive = std::make_shared<emlx::RowsToIds>(s, fn);
        mx::array y({X.shape(0)}, mx::uint32, primitive, {X});
        primitive->own(ctx, drop);
        return y;
      });
}

// Builds a prompt chunk's causal attention with our primitive into *out:
// q [B, nkv, G * L, hd] float32 (scaled; query head g's L positions in
// turn, the last L of the S positions), keys and values [B, nkv, S, hd]
// float32 or float16. Returns 1 when built, 0 when not ours (GPU stream,
// kernels off, dtypes, shapes), -1 on an error.
int emlx_kernels_prompt_attention(emlx_mlx_array* out, emlx_mlx_array q, emlx_mlx_array keys,
                                  emlx_mlx_array values, int L, emlx_mlx_stream stream, char* err,
                                  size_t err_len) {
  return emlx::build_node(
      "prompt attention", out, q.ctx && keys.ctx && values.ctx, stream, err, err_len,
      [&](const mx::Stream& s) -> std::optional<mx::array> {
        const auto& Q = emlx::array_of(q);
        const auto& K = emlx::array_of(keys);
        const auto& V = emlx::array_of(values);
        if (Q.dtype() != mx::float32 || Q.ndim() != 4 || K.ndim() != 4 || V.shape() != K.shape() ||
            V.dtype() != K.dtype() || (K.dtype() != mx::float32 && K.dtype() != mx::float16))
          return {};
        if (L <= 0 || Q.shape(0) != K.shape(0) || Q.shape(1) != K.shape(1) ||
            Q.shape(3) != K.shape(3) || Q.shape(2) % L != 0 || K.shape(2) < L ||
            (long)K.shape(2) * Q.shape(2) / L > (1L << 30) || Q.size() == 0)
          return {};
        return mx::array(Q.shape(), mx::float32, std::make_shared<emlx::PromptAttention>(s, L),
                         {Q, K, V});
      });
}

// Builds silu(x[..., :F]) * x[..., F:] for x [..., 2F] with our primitive
// into *out; returns as emlx_kernels_prompt_attention does.
int emlx_kernels_swiglu(emlx_mlx_array* out, emlx_mlx_array x, emlx_mlx_stream stream, char* err,
                        size_t err_len) {
  return emlx::build_node(
      "swiglu", out, x.ctx, stream, err, err_len,
      [&](const mx::Stream& s) -> std::optional<mx::array> {
        const auto& X = emlx::array_of(x);
        if (X.dtype() != mx::float32 || X.ndim() < 1 || X.size() == 0) return {};
        if (X.shape(-1) % 2 != 0 || X.shape(-1) > (1L << 30)) return {};
        mx::Shape shape = X.shape();
        shape.back() /= 2;
        return mx::array(std::move(shape), mx::float32, std::make_shared<emlx::Swiglu>(s), {X});
      });
}

// Builds RMSNorm of x over its last axis with weight w ([D], or [R, D] with
// R = x's second-to-last axis) into *out; returns as the builders above.
int emlx_kernels_rms_norm(emlx_mlx_array* out, emlx_mlx_array x, emlx_mlx_array w, float eps,
                          emlx_mlx_stream stream, char* err, size_t err_len) {
  return emlx::build_node(
      "rms_norm", out, x.ctx && w.ctx, stream, err, err_len,
      [&](const mx::Stream& s) -> std::optional<mx::array> {
        const auto& X = emlx::array_of(x);
        const auto& Wt = emlx::array_of(w);
        if (X.dtype() != mx::float32 || Wt.dtype() != mx::float32 || X.ndim() < 1 ||
            X.size() == 0)
          return {};
        const int D = X.shape(-1);
        if (Wt.shape(-1) != D || D > (1 << 30)) return {};
        if (Wt.ndim() == 2) {
          if (X.ndim() < 2 || X.shape(-2) != Wt.shape(0)) return {};
        } else if (Wt.ndim() != 1) {
          return {};
        }
        return mx::array(X.shape(), mx::float32, std::make_shared<emlx::RmsNorm>(s, eps), {X, Wt});
      });
}

// Builds NormRope (see the class) into *out; `w.ctx` null for no norm.
// Returns as the builders above.
int emlx_kernels_norm_rope(emlx_mlx_array* out, emlx_mlx_array x, emlx_mlx_array w, float eps,
                           emlx_mlx_array cos, emlx_mlx_array sin, int traditional,
                           emlx_mlx_stream stream, char* err, size_t err_len) {
  return emlx::build_node(
      "norm_rope", out, x.ctx && cos.ctx && sin.ctx, stream, err, err_len,
      [&](const mx::Stream& s) -> std::optional<mx::array> {
        const auto& X = emlx::array_of(x);
        const auto& C = emlx::array_of(cos);
        const auto& S = emlx::array_of(sin);
        if (X.dtype() != mx::float32 || C.dtype() != mx::float32 || S.dtype() != mx::float32)
          return {};
        if (X.ndim() != 4 || X.size() == 0) return {};
        const int B = X.shape(0), L = X.shape(1), H = X.shape(2), hd = X.shape(3);
        if (hd % 2 != 0 || hd > 1024) return {};
        if (C.ndim() != 3 || C.shape() != S.shape() || C.shape(1) != L || C.shape(2) != hd ||
            (C.shape(0) != 1 && C.shape(0) != B))
          return {};
        std::vector<mx::array> inputs{X, C, S};
        if (w.ctx) {
          const auto& Wt = emlx::array_of(w);
          if (Wt.dtype() != mx::float32 || Wt.ndim() != 2 || Wt.shape(0) != H ||
              Wt.shape(1) != hd)
            return {};
          inputs.push_back(Wt);
        }
        return mx::array(X.shape(), mx::float32,
                         std::make_shared<emlx::NormRope>(s, eps, traditional != 0),
                         std::move(inputs));
      });
}

int emlx_kernels_rms_norm_raw(const float* x, const float* w, float* y, long rows, int D, int R,
                              float eps, int isa, int threads) {
  return emlx::run_raw(isa, [&](emlx::Isa v) {
    emlx::rms_norm(emlx::RmsNormArgs{x, w, y, rows, D, R, eps}, v, threads);
  });
}

int emlx_kernels_swiglu_raw(const float* x, float* y, long rows, int F, int isa, int threads) {
  return emlx::run_raw(isa, [&](emlx::Isa v) {
    emlx::swiglu(emlx::SwigluArgs{x, y, rows, F}, v, threads);
  });
}

// A prompt chunk's attention on plain buffers (q [B, nkv, G * L, hd], keys
// and values [B, nkv, S, hd], float32 or float16 by `bits`) with a chosen
// variant.
int emlx_kernels_prompt_attention_raw(const float* q, const void* keys, const void* values,
                                      int bits, float* out, int B, int nkv, int G, int L, int S,
                                      int hd, int isa) {
  return emlx::run_raw(isa, [&](emlx::Isa v) {
    emlx::PromptAttentionArgs a;
    a.q = q;
    a.keys = keys;
    a.values = values;
    a.head_stride = (long)S * hd;
    a.batch_stride = a.head_stride * nkv;
    a.bits = bits;
    a.B = B;
    a.nkv = nkv;
    a.G = G;
    a.L = L;
    a.S = S;
    a.hd = hd;
    a.out = out;
    emlx::prompt_attention(a, v);
  });
}

// The product on plain buffers with a chosen variant (0 scalar, 1 AVX2,
// 2 AVX-512) and at most `threads` threads (0: the whole pool). Returns 0, or
// -1 when the variant does not run on this CPU.
int emlx_kernels_qmm(const float* x, const uint32_t* w, const float* scales,
                     const float* biases, float* y, int M, int N, int K, int bits, int group,
                     int isa, int threads) {
  return emlx::run_raw(isa, [&](emlx::Isa v) {
    emlx::qmm(emlx::QmmArgs{x, w, scales, biases, y, M, N, K, bits, group}, v, threads);
  });
}

// The same with int8 activations (see qmm_int8.cpp); scales and biases in
// bfloat16 when `bf16_params`.
int emlx_kernels_qmm_int8(const float* x, const uint32_t* w, const void* scales,
                          const void* biases, int bf16_params, float* y, int M, int N, int K,
                          int bits, int group, int isa, int threads) {
  return emlx::run_raw(isa, [&](emlx::Isa v) {
    emlx::QmmArgs args{x, w, scales, biases, y, M, N, K, bits, group, bf16_params != 0};
    emlx::qmm_int8(args, v, threads);
  });
}

// One key head's attention (see AttendFn) on plain buffers with a chosen
// variant: keys and values float32 (bits 32), IEEE half bits (16), or
// quantized (8 or 4: packed words with float32 scales and biases per
// `group`, see KvRows).
int emlx_kernels_attend_raw(const float* q, const void* k, const void* v, const float* k_scales,
                            const float* k_biases, const float* v_scales, const float* v_biases,
                            int bits, int group, float* out, int G, int n, int hd, int isa) {
  return emlx::run_raw(isa, [&](emlx::Isa variant) {
    std::vector<float> scores((size_t)G * n);
    const emlx::KvRows keys{k, k_scales, k_biases, bits, group};
    const emlx::KvRows values{v, v_scales, v_biases, bits, group};
    emlx::attend_fn(variant, hd, bits, group)(q, keys, values, scores.data(), out, G, n, hd);
  });
}

int emlx_kernels_activations() { return emlx::selected_activations(); }

int emlx_kernels_int8_takes(int rows, int cols, int bits) {
  emlx::QmmArgs args{};
  args.M = rows;
  args.K = cols;
  args.bits = bits;
  return emlx::int8_takes(args);
}

int emlx_kernels_attend_takes(int hd, int bits, int group) {
  return emlx::attend_takes(hd, bits, group);
}

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
