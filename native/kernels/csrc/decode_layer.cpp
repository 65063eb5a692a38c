// A layer of a one-token decode step as two MLX nodes on a CPU stream, on
// either side of the cache write (MLX's own slice update or scatter).
//
// Built from the layer's separate nodes (norm, projections, per-head norm
// and RoPE, reshapes, attention, residual adds), a 28-layer step is about
// 940 MLX nodes, and on a 2-core CPU MLX's scheduling of them (a task per
// node, handed from the evaluating thread to the stream's) costs a few
// milliseconds a token beside 13 ms of products. The two nodes run the same
// kernels in the same order; only attention is code of its own (scores,
// softmax and weighted values per key head, in float32).
//
// The cache write stays MLX's: it updates the buffer in place only when
// nothing else holds it, and a node of several outputs holds its inputs
// once per output until it has run, which would make every step copy the
// cache. For the same reason the nodes' tasks hold raw pointers, not arrays
// (MLX keeps the inputs' buffers alive until a task has run).
#include "decode_layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "elementwise.h"
#include "experts.h"
#include "glue.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "qmm_int8.h"

namespace emlx {

namespace {

void product(const QuantWeight& p, const float* x, float* y, int M, int N, int K, Isa isa) {
  qmm_selected(QmmArgs{x, p.w, p.scales, p.biases, y, M, N, K, p.bits, p.group, p.bf16_params}, isa,
               0);
}

// Attention below this many multiply-adds stays on the calling thread.
constexpr long kMinParallelAttention = 1L << 16;

}  // namespace

void decode_qkv(const DecodeQkvArgs& a, Isa isa) {
  const int H = a.nq + a.nkv;
  const int W = (H + a.nkv) * a.hd;
  std::vector<float> x((size_t)a.B * a.D), qkv((size_t)a.B * W);
  rms_norm(RmsNormArgs{a.h, a.w_in, x.data(), a.B, a.D, 1, a.eps_in}, isa, 0);
  product(a.qkv, x.data(), qkv.data(), a.B, W, a.D, isa);
  std::vector<float> qk((size_t)H * a.hd);
  for (int b = 0; b < a.B; ++b) {
    float* row = qkv.data() + (size_t)b * W;
    if (a.qkv_bias)
      for (int i = 0; i < W; ++i) row[i] += a.qkv_bias[i];
    const int t = a.T == 1 ? 0 : b;
    norm_rope(NormRopeArgs{row, a.w_qk, a.cos + (size_t)t * a.hd, a.sin + (size_t)t * a.hd,
                           qk.data(), 1, 1, H, a.hd, 1, a.eps_qk, a.traditional},
              1);
    const size_t qn = (size_t)a.nq * a.hd, kn = (size_t)a.nkv * a.hd;
    std::memcpy(a.q + b * qn, qk.data(), qn * sizeof(float));
    std::memcpy(a.k + b * kn, qk.data() + qn, kn * sizeof(float));
    std::memcpy(a.v + b * kn, row + qn + kn, kn * sizeof(float));
  }
}

// The rows of `r` from position `first` on (a head's or a row's start in a
// cache of rows of hd values). Defined here, not in the header the vector
// translation units include: an inline function compiled under their
// target could be the copy the linker keeps.
static KvRows rows_from(const KvRows& r, size_t first, int hd) {
  const size_t element = first * (size_t)hd;
  KvRows out = r;
  out.data = static_cast<const uint8_t*>(r.data) + element * r.bits / 8;
  if (r.bits < 16) {
    out.scales = r.scales + element / r.group;
    out.biases = r.biases + element / r.group;
  }
  return out;
}

namespace {

// Expert e's slice of a stacked weight [E, N, K].
QuantWeight expert(const QuantWeight& w, int e, int N, int K) {
  const size_t words = (size_t)K * w.bits / 32, params = (size_t)K / w.group;
  const size_t item = w.bf16_params ? 2 : 4;
  QuantWeight out = w;
  out.w = w.w + (size_t)e * N * words;
  out.scales = static_cast<const uint8_t*>(w.scales) + (size_t)e * N * params * item;
  out.biases = static_cast<const uint8_t*>(w.biases) + (size_t)e * N * params * item;
  return out;
}

// Rows x [B, D] through their routed experts (see DecodeExperts) into y
// [B, D]. The rows that picked an expert go through it together, so its
// weights are read once a step; a thread that takes a whole expert (see
// for_each_expert) runs its gate, up and down with no join between them.
void routed_experts(const DecodeExperts& m, const float* x, float* y, int B, int D, int F,
                    Isa isa) {
  const int E = m.E, k = m.k;
  std::vector<float> probs((size_t)B * E);
  product(m.router, x, probs.data(), B, E, D, isa);
  // Each row's softmax in float32, its k largest probabilities (ties to the
  // lower index) and their weights.
  std::vector<uint32_t> picked((size_t)B * k);
  std::vector<int> order(E);
  std::vector<float> weights((size_t)B * k);
  for (int b = 0; b < B; ++b) {
    float* p = probs.data() + (size_t)b * E;
    const float top = *std::max_element(p, p + E);
    float sum = 0.0f;
    for (int i = 0; i < E; ++i) sum += p[i] = std::exp(p[i] - top);
    for (int i = 0; i < E; ++i) p[i] /= sum;
    for (int i = 0; i < E; ++i) order[i] = i;
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [p](int i, int j) { return p[i] > p[j] || (p[i] == p[j] && i < j); });
    float total = 0.0f;
    for (int c = 0; c < k; ++c) total += p[order[c]];
    for (int c = 0; c < k; ++c) {
      picked[(size_t)b * k + c] = order[c];
      weights[(size_t)b * k + c] = m.norm_topk ? p[order[c]] / total : p[order[c]];
    }
  }
  // The (row, choice) pairs of each expert, in row order.
  const ExpertRows pairs = rows_by_expert(picked.data(), (long)B * k, E);
  // Each pair's expert output [B * k, D].
  std::vector<float> outs((size_t)B * k * D);
  auto run_expert = [&](int e, int threads) {
    const int n = pairs.start[e + 1] - pairs.start[e];
    const int* rows = pairs.order.data() + pairs.start[e];
    std::vector<float> xs((size_t)n * D), g((size_t)n * F), u((size_t)n * F);
    std::vector<float> gu((size_t)n * 2 * F), act((size_t)n * F), ys((size_t)n * D);
    for (int i = 0; i < n; ++i)
      std::memcpy(xs.data() + (size_t)i * D, x + (size_t)(rows[i] / k) * D, sizeof(float) * D);
    auto run = [&](const QuantWeight& w, const float* in, float* out, int N, int K) {
      const QuantWeight p = expert(w, e, N, K);
      qmm_selected(QmmArgs{in, p.w, p.scales, p.biases, out, n, N, K, p.bits, p.group,
                           p.bf16_params},
                   isa, threads);
    };
    run(m.gate, xs.data(), g.data(), F, D);
    run(m.up, xs.data(), u.data(), F, D);
    for (int i = 0; i < n; ++i) {
      std::memcpy(gu.data() + (size_t)i * 2 * F, g.data() + (size_t)i * F, sizeof(float) * F);
      std::memcpy(gu.data() + (size_t)i * 2 * F + F, u.data() + (size_t)i * F, sizeof(float) * F);
    }
    swiglu(SwigluArgs{gu.data(), act.data(), n, F}, isa, threads == 1 ? 1 : 0);
    run(m.down, act.data(), ys.data(), D, F);
    for (int i = 0; i < n; ++i)
      std::memcpy(outs.data() + (size_t)rows[i] * D, ys.data() + (size_t)i * D, sizeof(float) * D);
  };
  for_each_expert(pairs.used, run_expert);
  for (int b = 0; b < B; ++b) {
    float* out = y + (size_t)b * D;
    std::fill(out, out + D, 0.0f);
    for (int c = 0; c < k; ++c) {
      const float w = weights[(size_t)b * k + c];
      const float* o = outs.data() + ((size_t)b * k + c) * D;
      for (int i = 0; i < D; ++i) out[i] += o[i] * w;
    }
  }
}

}  // namespace

void decode_rest(const DecodeRestArgs& a, Isa isa) {
  const int G = a.nq / a.nkv;
  std::vector<float> attn((size_t)a.B * a.nq * a.hd);
  // One task per (row, key head): its query heads over the row's keys.
  const AttendFn attend = attend_fn(isa, a.hd, a.keys.bits, a.keys.group);
  auto task = [&](int u) {
    const int b = u / a.nkv, g = u % a.nkv;
    const int n = a.positions[b] - a.starts[b] + 1;
    thread_local std::vector<float> q, scores;
    q.resize((size_t)G * a.hd);
    scores.resize((size_t)G * n);
    const float* qs = a.q + ((size_t)b * a.nq + (size_t)g * G) * a.hd;
    for (int i = 0; i < G * a.hd; ++i) q[i] = qs[i] * a.scale;
    const size_t first = ((size_t)b * a.nkv + g) * a.cap + a.starts[b];
    float* o = attn.data() + ((size_t)b * a.nq + (size_t)g * G) * a.hd;
    attend(q.data(), rows_from(a.keys, first, a.hd), rows_from(a.values, first, a.hd),
           scores.data(), o, G, n, a.hd);
  };
  // Each unit's first key in a count of all units' keys, in unit order.
  const int units = a.B * a.nkv;
  std::vector<long> first_key(units + 1, 0);
  for (int u = 0; u < units; ++u) {
    const int b = u / a.nkv;
    first_key[u + 1] = first_key[u] + (a.positions[b] - a.starts[b] + 1);
  }
  const long keys = first_key[units];
  Pool& pool = Pool::shared();
  if (keys * a.nq / a.nkv * a.hd < kMinParallelAttention || pool.size() == 1) {
    for (int u = 0; u < units; ++u) task(u);
  } else {
    // Each thread takes a run of adjacent units holding about its share of
    // the keys, and so streams through neighbouring heads' rows of the
    // cache, which it reads faster than units handed out one at a time
    // (those interleave the threads' heads).
    const int P = pool.size();
    pool.run(P, [&](int t) {
      const long from = keys * t / P, to = keys * (t + 1) / P;
      for (int u = 0; u < units; ++u)
        if (first_key[u] >= from && first_key[u] < to) task(u);
    });
  }

  std::vector<float> h1((size_t)a.B * a.D), x((size_t)a.B * a.D);
  product(a.o, attn.data(), h1.data(), a.B, a.D, a.nq * a.hd, isa);
  for (size_t i = 0; i < h1.size(); ++i) h1[i] = a.h[i] + h1[i];
  rms_norm(RmsNormArgs{h1.data(), a.w_post, x.data(), a.B, a.D, 1, a.eps_post}, isa, 0);
  if (a.experts.k > 0) {
    routed_experts(a.experts, x.data(), a.out, a.B, a.D, a.F, isa);
  } else {
    std::vector<float> gu((size_t)a.B * 2 * a.F), act((size_t)a.B * a.F);
    product(a.gate_up, x.data(), gu.data(), a.B, 2 * a.F, a.D, isa);
    swiglu(SwigluArgs{gu.data(), act.data(), a.B, a.F}, isa, 0);
    product(a.down, act.data(), a.out, a.B, a.D, a.F, isa);
  }
  for (size_t i = 0; i < h1.size(); ++i) a.out[i] = h1[i] + a.out[i];
}

namespace {

// Allocates the outputs and queues run(in, out): in[i] the row-major
// contents of inputs[i], out[i] the floats of outputs[i]. See the file's
// comment for why the task holds pointers.
template <typename Run>
void dispatch_raw(const mx::Stream& stream, const std::vector<mx::array>& inputs,
                  std::vector<mx::array>& outputs, Run run) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  std::vector<const void*> in(inputs.size(), nullptr);
  std::vector<std::pair<size_t, mx::array>> strided;
  for (size_t i = 0; i < inputs.size(); ++i) {
    encoder.set_input_array(inputs[i]);
    if (inputs[i].flags().row_contiguous)
      in[i] = inputs[i].data<uint8_t>();
    else
      strided.emplace_back(i, inputs[i]);
  }
  std::vector<float*> out;
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    encoder.set_output_array(o);
    out.push_back(o.data<float>());
  }
  encoder.dispatch([in, strided = std::move(strided), out, run]() mutable {
    std::vector<std::vector<uint8_t>> held;
    held.reserve(strided.size());
    for (const auto& [i, a] : strided) {
      held.push_back(packed(a));
      in[i] = held.back().data();
    }
    run(in, out);
  });
}

const float* f32(const void* p) { return static_cast<const float*>(p); }

QuantWeight quant(const std::vector<const void*>& in, int w, bool bf16, int bits, int group) {
  return QuantWeight{static_cast<const uint32_t*>(in[w]), in[w + 1], in[w + 2], bf16, bits, group};
}

// Inputs of DecodeQkv; the optional ones (qkv bias, q/k norm) follow, when present.
enum QkvInput { kH, kNormIn, kQkvW, kQkvS, kQkvB, kCos, kSin, kQkvRequired };

struct QkvShape {
  int nq, nkv, hd, bits, group;
  float eps_in, eps_qk;
  bool traditional, bias, qk_norm;
};

class DecodeQkv : public mx::Primitive {
 public:
  DecodeQkv(mx::Stream stream, QkvShape shape) : mx::Primitive(stream), s_(shape) {}

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("decode qkv: no GPU evaluation");
  }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    DecodeQkvArgs a{};
    a.B = inputs[kH].shape(0);
    a.D = inputs[kH].shape(-1);
    a.nq = s_.nq;
    a.nkv = s_.nkv;
    a.hd = s_.hd;
    a.eps_in = s_.eps_in;
    a.eps_qk = s_.eps_qk;
    a.T = inputs[kCos].shape(0);
    a.traditional = s_.traditional;
    const bool bf16 = inputs[kQkvS].dtype() == mx::bfloat16;
    const QkvShape s = s_;
    dispatch_raw(stream(), inputs, outputs, [a, s, bf16](const auto& in, const auto& out) mutable {
      a.h = f32(in[kH]);
      a.w_in = f32(in[kNormIn]);
      a.qkv = quant(in, kQkvW, bf16, s.bits, s.group);
      a.cos = f32(in[kCos]);
      a.sin = f32(in[kSin]);
      int next = kQkvRequired;
      a.qkv_bias = s.bias ? f32(in[next++]) : nullptr;
      a.w_qk = s.qk_norm ? f32(in[next++]) : nullptr;
      a.q = out[0];
      a.k = out[1];
      a.v = out[2];
      decode_qkv(a, selected_isa());
    });
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int B = inputs[kH].shape(0);
    return {{B, s_.nq, s_.hd}, {B, s_.nkv, 1, s_.hd}, {B, s_.nkv, 1, s_.hd}};
  }

  const char* name() const override { return "DecodeQkv"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeQkv&>(other).s_;
    return s_.nq == o.nq && s_.nkv == o.nkv && s_.hd == o.hd && s_.bits == o.bits &&
           s_.group == o.group && s_.eps_in == o.eps_in && s_.eps_qk == o.eps_qk &&
           s_.traditional == o.traditional && s_.bias == o.bias && s_.qk_norm == o.qk_norm;
  }

 private:
  QkvShape s_;
};

// Inputs of DecodeLayerRest: these, then the MLP's weights (weight, scales
// and biases each: gate_up and down, or for routed experts the router,
// gate, up and down), then a quantized cache's keys' scales and biases and
// values' (keys and values are then its packed values).
enum RestInput { kRH, kRQ, kKeys, kValues, kOW, kOS, kOB, kNormPost, kMlp };

struct RestShape {
  int nkv;
  int bits[5], group[5];  // o, then the MLP's weights in input order
  float eps_post, scale;
  int kv_bits, kv_group;  // the cache's rows (see KvRows)
  int top_k;  // experts a row; 0: a dense MLP
  bool norm_topk;
};

// The MLP's weights and the first input after them.
int mlp_weights(int top_k) { return top_k > 0 ? 4 : 2; }
int kv_params_at(int top_k) { return kMlp + 3 * mlp_weights(top_k); }

class DecodeLayerRest : public mx::UnaryPrimitive {
 public:
  DecodeLayerRest(mx::Stream stream, RestShape shape, std::vector<int> positions,
                  std::vector<int> starts)
      : mx::UnaryPrimitive(stream), s_(shape), positions_(std::move(positions)),
        starts_(std::move(starts)) {}

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("decode layer: no GPU evaluation");
  }

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    DecodeRestArgs a{};
    const bool moe = s_.top_k > 0;
    a.B = inputs[kRH].shape(0);
    a.D = inputs[kRH].shape(-1);
    // The MLP's width: the stacked gate/up's half, or an expert's gate's.
    a.F = moe ? inputs[kMlp + 3].shape(1) : inputs[kMlp].shape(0) / 2;
    a.nq = inputs[kRQ].shape(1);
    a.hd = inputs[kRQ].shape(2);
    a.nkv = s_.nkv;
    a.cap = inputs[kKeys].shape(2);
    a.scale = s_.scale;
    a.eps_post = s_.eps_post;
    a.keys = KvRows{nullptr, nullptr, nullptr, s_.kv_bits, s_.kv_group};
    a.values = a.keys;
    if (moe) {
      a.experts.E = inputs[kMlp].shape(0);
      a.experts.k = s_.top_k;
      a.experts.norm_topk = s_.norm_topk;
    }
    // Whether each weight's scales are bfloat16: o's, then the MLP's.
    std::vector<bool> bf16{inputs[kOS].dtype() == mx::bfloat16};
    for (int i = 0; i < mlp_weights(s_.top_k); ++i)
      bf16.push_back(inputs[kMlp + 3 * i + 1].dtype() == mx::bfloat16);
    std::vector<mx::array> outputs{out};  // the same array, as a vector
    const RestShape s = s_;
    dispatch_raw(stream(), inputs, outputs,
                 [a, s, bf16, positions = positions_, starts = starts_](const auto& in,
                                                                       const auto& outs) mutable {
                   auto weight = [&](int at, int i) {
                     return quant(in, at, bf16[i], s.bits[i], s.group[i]);
                   };
                   a.positions = positions.data();
                   a.starts = starts.data();
                   a.h = f32(in[kRH]);
                   a.q = f32(in[kRQ]);
                   a.keys.data = in[kKeys];
                   a.values.data = in[kValues];
                   if (s.kv_bits < 16) {
                     const int at = kv_params_at(s.top_k);
                     a.keys.scales = f32(in[at]);
                     a.keys.biases = f32(in[at + 1]);
                     a.values.scales = f32(in[at + 2]);
                     a.values.biases = f32(in[at + 3]);
                   }
                   a.o = weight(kOW, 0);
                   a.w_post = f32(in[kNormPost]);
                   if (s.top_k > 0) {
                     a.experts.router = weight(kMlp, 1);
                     a.experts.gate = weight(kMlp + 3, 2);
                     a.experts.up = weight(kMlp + 6, 3);
                     a.experts.down = weight(kMlp + 9, 4);
                   } else {
                     a.gate_up = weight(kMlp, 1);
                     a.down = weight(kMlp + 3, 2);
                   }
                   a.out = outs[0];
                   decode_rest(a, selected_isa());
                 });
  }

  const char* name() const override { return "DecodeLayerRest"; }

  bool is_equivalent(const mx::Primitive&) const override {
    // Positions are the node's own: no two steps' layers are the same node.
    return false;
  }

 private:
  RestShape s_;
  std::vector<int> positions_;
  std::vector<int> starts_;
};

// Whether w, s, b are a quantized weight [E..., N, K] (`stacked` leading
// experts' axes: 0 or 1) in MLX's layout that the products take.
bool quant_ok(const mx::array& w, const mx::array& s, const mx::array& b, int N, int K, int bits,
              int group, int E = 0) {
  if (bits != 4 && bits != 8) return false;
  if (group != 32 && group != 64 && group != 128) return false;
  if (w.dtype() != mx::uint32 || (s.dtype() != mx::float32 && s.dtype() != mx::bfloat16) ||
      b.dtype() != s.dtype())
    return false;
  const int lead = E > 0 ? 1 : 0;
  if (w.ndim() != 2 + lead || s.ndim() != 2 + lead || b.shape() != s.shape() || K % group != 0)
    return false;
  if (lead && (w.shape(0) != E || s.shape(0) != E)) return false;
  return w.shape(lead) == N && w.shape(lead + 1) == (long)K * bits / 32 && s.shape(lead) == N &&
         s.shape(lead + 1) == K / group;
}

bool f32_shaped(const mx::array& a, const mx::Shape& shape) {
  return a.dtype() == mx::float32 && a.shape() == shape;
}

std::vector<mx::array> arrays(const emlx_mlx_array* handles, int n) {
  std::vector<mx::array> in;
  for (int i = 0; i < n; ++i) in.push_back(array_of(handles[i]));
  return in;
}

bool handles_set(const emlx_mlx_array* handles, int n) {
  for (int i = 0; i < n; ++i)
    if (!handles[i].ctx) return false;
  return true;
}

}  // namespace
}  // namespace emlx

extern "C" {

// Builds the DecodeQkv node (see the class) into outs[0..3): queries
// [B, heads, hd], keys and values [B, kv_heads, 1, hd]. `arrays` holds h
// [B, 1, D], the input norm's weight [D], the stacked q/k/v weight, scales
// and biases, and the RoPE tables [T, 1, hd]; `qkv_bias` and `qk_norm` may
// be null. Returns 1 when built, 0 when not ours (GPU stream, kernels off,
// dtypes, shapes), -1 on an error (message in err).
int emlx_kernels_decode_qkv(emlx_mlx_array* outs, const emlx_mlx_array* arrays,
                            emlx_mlx_array qkv_bias, emlx_mlx_array qk_norm, int heads,
                            int kv_heads, int bits, int group, float eps_in, float eps_qk,
                            int traditional, emlx_mlx_stream stream, char* err, size_t err_len) {
  const bool set = arrays && emlx::handles_set(arrays, emlx::kQkvRequired);
  return emlx::build_nodes(
      "decode qkv", outs, 3, set, stream, err, err_len,
      [&](const mx::Stream& s) -> std::optional<std::vector<mx::array>> {
        std::vector<mx::array> in = emlx::arrays(arrays, emlx::kQkvRequired);
        const auto& H = in[emlx::kH];
        const int nq = heads, nkv = kv_heads;
        if (H.dtype() != mx::float32 || H.ndim() != 3 || H.shape(1) != 1 || H.shape(0) < 1 ||
            nq <= 0 || nkv <= 0 || nq % nkv != 0)
          return {};
        const int B = H.shape(0), D = H.shape(2);
        const auto& C = in[emlx::kCos];
        if (C.ndim() != 3) return {};
        const int T = C.shape(0), hd = C.shape(2);
        if (hd % 2 != 0 || hd > 1024 || (T != 1 && T != B)) return {};
        const int W = (nq + 2 * nkv) * hd;
        if (!emlx::f32_shaped(in[emlx::kNormIn], {D}) || !emlx::f32_shaped(C, {T, 1, hd}) ||
            !emlx::f32_shaped(in[emlx::kSin], {T, 1, hd}) ||
            !emlx::quant_ok(in[emlx::kQkvW], in[emlx::kQkvS], in[emlx::kQkvB], W, D, bits, group))
          return {};
        emlx::QkvShape shape{nq,     nkv,    hd, bits, group, eps_in, eps_qk, traditional != 0,
                             qkv_bias.ctx != nullptr, qk_norm.ctx != nullptr};
        if (shape.bias) {
          in.push_back(emlx::array_of(qkv_bias));
          if (!emlx::f32_shaped(in.back(), {W})) return {};
        }
        if (shape.qk_norm) {
          in.push_back(emlx::array_of(qk_norm));
          if (!emlx::f32_shaped(in.back(), {nq + nkv, hd})) return {};
        }
        auto primitive = std::make_shared<emlx::DecodeQkv>(s, shape);
        return mx::array::make_arrays(primitive->output_shapes(in),
                                      {mx::float32, mx::float32, mx::float32}, primitive, in);
      });
}

// Builds the DecodeLayerRest node (see the class) into *out: the residual
// stream [B, 1, D] after the layer. `arrays` holds h [B, 1, D], the queries
// [B, heads, hd] of emlx_kernels_decode_qkv, the layer's whole key and
// value buffers [>= B, kv_heads, capacity, hd] (already holding the new
// keys), the output projection's weight, scales and biases, the post norm's
// weight [D], then the MLP's: the stacked gate/up projection's and the down
// projection's, or with `top_k` > 0 routed experts' router [E, D], gate and
// up [E, F, D] and down [E, D, F] (each row through its top_k experts,
// their weights renormalized when `norm_topk`). `bits` and `group` are
// those of the products in that order (3, or 5 with experts). With
// `kv_bits` > 0 the buffers are a quantized cache's packed values (uint32)
// and the keys' scales and biases, then the values', follow (float32
// [>= B, kv_heads, capacity, hd / kv_group]). Row b attends keys
// starts[b]..=positions[b]. Returns as emlx_kernels_decode_qkv.
int emlx_kernels_decode_layer_rest(emlx_mlx_array* out, const emlx_mlx_array* arrays,
                                   const int* bits, const int* group, int rows,
                                   const int* positions, const int* starts, float eps_post,
                                   float scale, int kv_bits, int kv_group, int top_k,
                                   int norm_topk, emlx_mlx_stream stream, char* err,
                                   size_t err_len) {
  const int kv_at = emlx::kv_params_at(top_k);
  const int inputs = kv_bits > 0 ? kv_at + 4 : kv_at;
  const bool set = arrays && bits && group && positions && starts && rows > 0 && top_k >= 0 &&
                   emlx::handles_set(arrays, inputs);
  return emlx::build_node(
      "decode layer", out, set, stream, err, err_len,
      [&](const mx::Stream& s) -> std::optional<mx::array> {
        std::vector<mx::array> in = emlx::arrays(arrays, inputs);
        const auto& H = in[emlx::kRH];
        const auto& Q = in[emlx::kRQ];
        const auto& K = in[emlx::kKeys];
        if (H.dtype() != mx::float32 || H.ndim() != 3 || H.shape(0) != rows || H.shape(1) != 1 ||
            Q.ndim() != 3 || K.ndim() != 4)
          return {};
        const int D = H.shape(2), nq = Q.shape(1), hd = Q.shape(2);
        const int nkv = K.shape(1), cap = K.shape(2);
        // Keys and values in float32 or float16, or quantized (uint32
        // words, float32 scales and biases per group).
        const auto& V = in[emlx::kValues];
        int rows_bits = K.dtype() == mx::float32 ? 32 : K.dtype() == mx::float16 ? 16 : 0;
        int width = hd;
        if (kv_bits > 0) {
          rows_bits = K.dtype() == mx::uint32 && emlx::attend_takes(hd, kv_bits, kv_group) ? kv_bits : 0;
          width = rows_bits ? hd * kv_bits / 32 : 0;
          for (int i = kv_at; rows_bits && i < inputs; ++i) {
            const auto& p = in[i];
            if (p.dtype() != mx::float32 || p.ndim() != 4 || p.shape(0) != K.shape(0) ||
                p.shape(1) != nkv || p.shape(2) != cap || p.shape(3) != hd / kv_group ||
                !p.flags().row_contiguous)
              rows_bits = 0;
          }
        }
        if (!emlx::f32_shaped(Q, {rows, nq, hd}) || !rows_bits || V.dtype() != K.dtype() ||
            V.shape() != K.shape() || K.shape(0) < rows || K.shape(3) != width || nkv <= 0 ||
            nq % nkv != 0)
          return {};
        for (int b = 0; b < rows; ++b)
          if (starts[b] < 0 || starts[b] > positions[b] || positions[b] >= cap) return {};
        if (!emlx::f32_shaped(in[emlx::kNormPost], {D}) ||
            !emlx::quant_ok(in[emlx::kOW], in[emlx::kOS], in[emlx::kOB], D, nq * hd, bits[0],
                            group[0]))
          return {};
        // The MLP's weight i (0-based, after o) as [E..., N, K].
        auto weight_ok = [&](int i, int N, int K, int E) {
          const int at = emlx::kMlp + 3 * i;
          return emlx::quant_ok(in[at], in[at + 1], in[at + 2], N, K, bits[i + 1], group[i + 1], E);
        };
        const auto& M = in[emlx::kMlp];
        if (top_k > 0) {
          const auto& G = in[emlx::kMlp + 3];
          if (M.ndim() != 2 || G.ndim() != 3) return {};
          const int E = M.shape(0), F = G.shape(1);
          if (top_k > E || !weight_ok(0, E, D, 0) || !weight_ok(1, F, D, E) ||
              !weight_ok(2, F, D, E) || !weight_ok(3, D, F, E))
            return {};
        } else {
          if (M.ndim() != 2 || M.shape(0) % 2 != 0) return {};
          const int F = M.shape(0) / 2;
          if (!weight_ok(0, 2 * F, D, 0) || !weight_ok(1, D, F, 0)) return {};
        }
        emlx::RestShape shape{};
        shape.nkv = nkv;
        for (int i = 0; i <= emlx::mlp_weights(top_k); ++i) {
          shape.bits[i] = bits[i];
          shape.group[i] = group[i];
        }
        shape.eps_post = eps_post;
        shape.scale = scale;
        shape.kv_bits = rows_bits;
        shape.kv_group = kv_bits > 0 ? kv_group : 0;
        shape.top_k = top_k;
        shape.norm_topk = norm_topk != 0;
        auto primitive = std::make_shared<emlx::DecodeLayerRest>(
            s, shape, std::vector<int>(positions, positions + rows),
            std::vector<int>(starts, starts + rows));
        return mx::array(H.shape(), mx::float32, primitive, std::move(in));
      });
}
}
