//! The CUDA kernels of a one-token step's layer (see the module above), each
//! one node, with the roundings of the MLX ops it replaces: every value an
//! MLX op would store in the compute dtype is rounded to it here too, and
//! sums are taken in float32.

use mlx_rs::{Array, Dtype};

use emlx_axon_kernels::QuantWeight;

use crate::backend::cuda::kernel::{CudaKernel, Template};
use crate::error::{Error, Result};

/// A layer's attention for one query per row from the q/k/v product: q and
/// k RMSNorm (Qwen3), RoPE from a float32 table of positions, the new key
/// and value written into the cache at the row's position, and attention
/// over the row's keys `starts..=position` in float32 (online softmax). One
/// block per (`TILE` query heads of a key head, row, split), so that a key
/// read once serves them all: each key is held by
/// `D / 8` lanes of 8 values (one 16-byte load of a 2-byte type), a warp
/// takes several keys at once and each of its lanes a few keys a trip, all
/// loads of a trip issued before any use. While a warp's first trip is
/// under way the prologue normalizes and rotates the queries and the new
/// key. Every block of a key head computes that head's new key itself and
/// reads it from shared memory, so no block waits for another's cache
/// write; split 0's block of the key head's first tile writes it. The cache buffers are
/// inputs that the kernel writes in place: nothing else reads them within
/// the step's layer, and the next layer's caches are other buffers.
const QKV_ATTEND_HEAD: &str = include_str!("cu/qkv_attend_head.cu");

/// The keys `first..=last` into each stream's online softmax: its running
/// max `m`, sum `l` and weighted values `acc` per query head, each key's
/// lanes summing their parts of its scores.
const ATTEND_KEYS: &str = include_str!("cu/attend_keys.cu");

/// The streams' softmaxes combined into the block's rows of `out`
/// (`[rows, heads, D]`), or into its split's partial sums, which the last
/// split of a row and head group to finish combines.
const ATTEND_COMBINE: &str = include_str!("cu/attend_combine.cu");

/// A prompt's q/k norms (Qwen3), RoPE and cache write for all its tokens,
/// one block of `D` threads per (query or key head, token, row) of the
/// q/k/v product `[B, L, (NQ + 2 * NKV) * D]`: query heads go to `q` `[B,
/// NQ, L, D]` as attention reads them, each key head (rotated) and its value
/// head into the cache buffers in place at `offset + l`. The same arithmetic, rounding for
/// rounding, as the step kernel's prologue above; it replaces about
/// fifteen MLX nodes a layer (slices, norms, transposes, rotations, the
/// cache's update and its reshapes).
const QK_ROPE_WRITE: &str = include_str!("cu/qk_rope_write.cu");

/// A block's RMSNorm factor `n` over `D` values, from each thread's sum of
/// squares `ss` (threads `t`, a `partial` slot per warp).
const BLOCK_NORM: &str = include_str!("cu/block_norm.cu");

/// The residual add and the RMSNorm after it: `h + r`, then (with
/// [`BLOCK_NORM`] and [`ADD_NORM_OUT`]) its norm; a block per row of `[B,
/// L, D]` inputs.
const ADD_NORM: &str = include_str!("cu/add_norm.cu");

/// The rest of [`ADD_NORM`]: the normalized sum.
const ADD_NORM_OUT: &str = include_str!("cu/add_norm_out.cu");

/// A step's embeddings and the first layer's RMSNorm of them, one block a
/// row: the row's token's row of a quantized embedding table (MLX's affine
/// layout, as the products read it) dequantized as MLX's `dequantize`
/// computes it (`scale * q + bias` rounded once to the compute dtype: on an
/// NVIDIA H200 every value of MLX's bfloat16, float16 and float32 results
/// matched this and about half differed from rounding the product first),
/// then normalized with weight `nw`. Token ids below zero count from the
/// end, as MLX's `take`; ids past the table are clamped to it. Followed by
/// [`BLOCK_NORM`] and [`EMBED_NORM_OUT`].
const EMBED_NORM: &str = include_str!("cu/embed_norm.cu");

/// The rest of [`EMBED_NORM`]: the normalized embeddings.
const EMBED_NORM_OUT: &str = include_str!("cu/embed_norm_out.cu");

/// `silu(g) * u` of values in the compute dtype, rounded where MLX's
/// `sigmoid`, `multiply` and `multiply` round.
const SWIGLU_OF: &str = include_str!("cu/swiglu_of.cu");

/// `silu(gate) * up` from the stacked gate/up product `[rows, 2 * I]`
/// (contiguous, any leading shape).
const SWIGLU: &str = include_str!("cu/swiglu.cu");

/// Each row's greedy token: the index of its largest value, the first of
/// equal ones (as MLX's argmax), over `x` `[rows, V]`, one block a row.
/// 16-byte loads where the row allows them: MLX's own kernel took 21 µs
/// for a 151,936-wide row on an NVIDIA H200, its loads one value each.
const ARGMAX: &str = include_str!("cu/argmax.cu");

/// What the argmax and sampling kernels take: every token, or those a
/// bitmask allows (a grammar's, [`crate::text::constraint`]).
const MASK_NONE: &str = include_str!("cu/mask_none.cu");
const MASK_BITS: &str = include_str!("cu/mask_bits.cu");

/// Int32 zeros `out` `[N]`: the attention kernel's counts, made in a step
/// by a kernel of ours so that a replayed step makes them too.
const ZEROS: &str = include_str!("cu/zeros.cu");

/// Blocks a one-token attention's row and head may be split into, at most
/// (a power of two), and the fewest keys a split takes.
const ATTEND_SPLITS: i32 = 32;
const ATTEND_MIN_KEYS: i32 = 128;

/// Whether [`Kernels::qkv_attend`] takes heads of `hd` values in `cache`
/// `[rows, kv_heads, capacity, hd]`: heads of 32, 64 or 128 values (the
/// first-use check's; lanes of 8 values a key, whole warps of them) and
/// every key's values contiguous, 16-byte aligned in a buffer of its own
/// (the kernel reads the base pointer as MLX allocates it).
pub(crate) fn attends(hd: i32, cache: &Array) -> bool {
    let strides = cache.strides();
    matches!(hd, 32 | 64 | 128)
        && strides.len() == 4
        && strides[3] == 1
        && strides[..3].iter().all(|s| s % 8 == 0)
}

/// Query heads a block of [`Kernels::qkv_attend`] takes: the most of a key
/// head's `gqa` that divide it, up to 4 (their queries and sums stay in
/// registers).
fn query_tile(gqa: i32) -> i32 {
    (1..=4.min(gqa)).rev().find(|t| gqa % t == 0).unwrap_or(1)
}

/// Int32 counts [`Kernels::qkv_attend`] takes, at least: MLX keeps arrays
/// of a few bytes in memory the host and device share, and these take
/// atomic adds.
const COUNTS_MIN: i32 = 64;

/// Each row's sampled token, as mlx-lm's sampler draws it with top-k of at
/// most 64, over `x` `[rows, V]`, one block a row in linear time: the
/// row's largest value and log-sum-exp, the values at or above a bound on
/// the k-th largest gathered into shared memory (a radix selection where
/// ties make too many) and sorted, then top-p, min-p and top-k on those
/// candidates, the softmax of what is left at the temperature, and the draw
/// by `u`, a hash of the row's seed and position: no state, so a replayed
/// step draws anew from the positions it advances.
const SAMPLE: &str = include_str!("cu/sample.cu");

/// The product of one quantized weight (MLX's affine layout: `BITS`-bit
/// values packed little-end first into `uint32` words, a scale and a bias per
/// `GS` values of a row) with a tile of `BT` input rows, after one of the
/// prologues below has put the tile's inputs into shared memory. Each warp
/// takes `R` outputs, each from `PER_OUT` weight rows (two for SwiGLU: the
/// gate row and the up row `OUTS` further on), fetched before the
/// prologue (`GEMV_TILE_FETCH`) so that their trips to memory overlap its
/// (with `LOOP`, further outputs a grid apart, see [`loops`]); rows
/// wider than a lane's four chunks are taken two chunks a lane at a time,
/// the next two in flight while these are used, so that registers stay
/// bounded at any width. A lane takes chunks of four words (16 bytes, in
/// one group). A value q is not converted to a float (a quarter-rate
/// instruction, per value and output): a shift and a mask make the
/// float `1 + q / 2^BITS`, and a chunk's part of an output is
/// `scale * 2^BITS * (sum(f * x) - sum(x)) + bias * sum(x)`, the chunk's
/// input sums made once per tile. A lane reads its chunk's inputs with
/// 16-byte loads, and the padding after each chunk's inputs (see
/// `GEMV_START`), which holds the chunk's sum, puts the lanes of a load on
/// different banks.
const GEMV_BODY: &str = include_str!("cu/gemv_body.cu");

/// What every prologue starts with (after naming its first input's rows
/// `ROWS`): the block's place and its input tile, in the compute dtype
/// (what MLX's ops would store), each lane chunk's `CH` inputs followed by
/// 16 bytes of padding. Sizes that need not be constants are read from the
/// shapes, so that fewer variants are compiled.
const GEMV_START: &str = include_str!("cu/gemv_start.cu");

/// [`GEMV_BODY`]'s first weight rows, fetched into registers before the
/// prologue so that their trips to memory overlap its.
const GEMV_TILE_FETCH: &str = include_str!("cu/gemv_tile_fetch.cu");

/// The product of a 4-bit weight with one input row in a 2-byte dtype,
/// split along the row: each thread of a block takes one 16-byte chunk (32
/// values) of every weight row the block takes, so that the thread's 32
/// inputs stay in registers for all of them instead of being read from
/// shared memory per row. The inputs become 16-bit integers of a
/// power-of-two step per chunk (exact for every input within 2^7 of the
/// chunk's largest; the rest are below the sums' float32 rounding), and
/// each word's values meet them through `dp4a` (four products and their
/// sum an instruction) as two bytes, with integer sums: a few instructions
/// a word where converting the values to floats takes three a value, which
/// made the tile body compute-bound at batch 1. Blocks loop over the
/// outputs in one wave, four weight rows a trip, the next trip's rows in
/// flight.
const GEMV_SPLIT: &str = include_str!("cu/gemv_split.cu");

/// [`GEMV_SPLIT`]'s first trip, fetched before the prologue.
const GEMV_SPLIT_FETCH: &str = include_str!("cu/gemv_split_fetch.cu");

/// Where [`GEMV_TILE_FETCH`] finds an output's weight rows (`ROW_OF`,
/// `W_ROWS`, `S_ROWS`, `B_ROWS` of the output and its part): the weight's
/// row, and for SwiGLU the up row `OUTS` further on.
const GEMV_WEIGHTS: &str = include_str!("cu/gemv_weights.cu");

/// The same for a routed expert's product: each tile is one (row, choice)
/// pair of `experts` `[rows, choices]` and reads the rows of its expert in
/// a stack `[experts, OUTS, K]` (gate's, and up's from [`GEMV_EXPERTS_UP`]
/// for SwiGLU).
const GEMV_EXPERTS: &str = include_str!("cu/gemv_experts.cu");
const GEMV_EXPERTS_UP: &str = include_str!("cu/gemv_experts_up.cu");

/// A router's choices for one token a block, as mlx-lm's `qwen3_moe`
/// makes them: the softmax of the logits `[rows, E]` in float32 rounded
/// to the compute dtype, the `TOPK` largest (`ids`) and their probabilities
/// (`scores`), with `NORM` divided by their sum rounded as MLX's `sum`
/// rounds it. The choices are those of `argpartition` on a GPU, the last
/// `TOPK` of MLX's stable ascending sort: in ascending order, ties to the
/// higher expert.
const MOE_ROUTE: &str = include_str!("cu/moe_route.cu");

/// The routed experts' outputs `ys` `[rows * TOPK, 1, D]` weighted by
/// their `scores` and summed, each product rounded to the compute dtype
/// as MLX's `multiply` rounds it and the sum taken in float32.
const MOE_COMBINE: &str = include_str!("cu/moe_combine.cu");

/// Plain input `x` `[ROWS / X_EVERY, 1, K]`, contiguous: a routed expert's
/// product reads its token's row for each of its choices. The prologues' loops have
/// constant trip counts and are unrolled, so that all their reads are in
/// flight at once.
const GEMV_PLAIN: &str = include_str!("cu/gemv_plain.cu");

/// The residual add `h + r` (the first block of each tile also writes it out
/// as `sum`) and its RMSNorm with weight `nw`: 16 bytes at a time where the
/// rows are contiguous and aligned, as a step's are, else a value at a time.
const GEMV_ADD_NORM: &str = include_str!("cu/gemv_add_norm.cu");

/// Shared memory for a tile's inputs, at most: room for the kernels' other
/// arrays within the 48 KiB a block may have without asking.
const TILE_BYTES: i32 = 40 * 1024;

/// A tile of one row, at most: the 48 KiB less the other arrays' largest.
const ROW_BYTES: i32 = 46 * 1024;

/// Bytes of one input row in a product's tile (`KP` of `GEMV_START`): each
/// chunk of `128 / bits` inputs in the tile's dtype, then 16 bytes.
fn tile_row_bytes(k_dim: i32, bits: i32, dtype: Dtype) -> i32 {
    let size = if dtype == Dtype::Float32 { 4 } else { 2 };
    k_dim * size + k_dim / (128 / bits) * 16
}

/// Rows of a product's input tile and the tile's dtype (`XT`): float32,
/// which spares the product a conversion per input value and row, where
/// all rows fit one tile; else the compute dtype, as many rows as fit (up
/// to 8), spread evenly over the fewest tiles.
fn tile(rows: i32, k_dim: i32, bits: i32, dtype: Dtype) -> (i32, Dtype) {
    let rows = rows.max(1);
    if rows <= 8 && rows * tile_row_bytes(k_dim, bits, Dtype::Float32) <= TILE_BYTES {
        return (rows, Dtype::Float32);
    }
    let most = (TILE_BYTES / tile_row_bytes(k_dim, bits, dtype)).clamp(1, 8);
    let tiles = (rows + most - 1) / most;
    ((rows + tiles - 1) / tiles, dtype)
}

/// Bit widths the product kernels unpack (values never straddle a word) and
/// that their check covers, groups of whole 16-byte chunks, rows that are
/// whole chunks, and a row of inputs that fits a tile in `dtype`.
pub(crate) fn gemv_takes(bits: i32, group_size: i32, in_dim: i32, dtype: Dtype) -> bool {
    matches!(bits, 4 | 8)
        && group_size % (128 / bits) == 0
        && in_dim % group_size == 0
        && (in_dim * bits) % 128 == 0
        && tile_row_bytes(in_dim, bits, dtype) <= ROW_BYTES
}

/// Threads of every kernel's blocks but the argmax's: 8 warps.
const BLOCK: i32 = 256;

/// The argmax's threads: one block reads a whole row.
const ARGMAX_BLOCK: i32 = 1024;

/// The sampling kernel's threads: a row a block, and 32 warps, whose two
/// largest per-thread values bound the 64th largest from below.
const SAMPLE_BLOCK: i32 = 1024;

/// Values the sampling kernel sorts in shared memory at most.
const SAMPLE_CAP: i32 = 2048;

/// The largest top-k the sampling kernel takes.
pub(crate) const SAMPLE_TOP_K: usize = 64;

/// Elements of the sampling kernel's parameters (float32): top-p, min-p,
/// `ln(min_p)` (as the host computes it), the tokens min-p keeps, the
/// temperature, top-k; then zeros, so that the buffer is in device memory
/// (MLX keeps arrays of a few bytes in memory the host and device share).
pub(crate) const SAMPLE_PARAMS: usize = 16;

pub(crate) struct Kernels {
    qkv_attend: CudaKernel,
    add_norm: CudaKernel,
    swiglu: CudaKernel,
    qk_rope_write: CudaKernel,
    /// By body ([`Body`]), input (plain, add + norm) and output (product,
    /// SwiGLU of its halves): `products[body][input][output]`.
    products: [[[CudaKernel; 2]; 2]; 2],
    /// Routed experts' products by output (product, SwiGLU of gate and up).
    experts: [CudaKernel; 2],
    route: CudaKernel,
    combine: CudaKernel,
    /// Unmasked, then masked (by [`MASK_BITS`]).
    argmax: [CudaKernel; 2],
    sample: [CudaKernel; 2],
    embed_norm: CudaKernel,
    zeros: CudaKernel,
}

/// The sampling kernel, for a caller that checks it before use (the
/// reference lives with the sampler; see `layer::sample_kernel`).
pub(crate) struct SampleKernel(pub(super) &'static Kernels);

impl SampleKernel {
    /// Each row's sampled token (`[rows]` uint32) from `logits` `[rows, V]`:
    /// `positions` `[rows]` int32 and `seeds` (uint64, one a row at least)
    /// give each row's uniform draw, `params` ([`SAMPLE_PARAMS`] float32:
    /// top-p, min-p, `ln(min_p)`, min-p's kept tokens, temperature, top-k
    /// in `1..=`[`SAMPLE_TOP_K`]) the filters.
    /// With `mask` (`[rows, ceil(V / 32)]` uint32, see [`MASK_BITS`]), a
    /// row draws among the tokens its mask allows.
    pub(crate) fn draw(
        &self,
        logits: &Array,
        positions: &Array,
        seeds: &Array,
        params: &Array,
        mask: Option<&Array>,
    ) -> Result<Array> {
        let rows = logits.dim(0);
        let (kernel, inputs) = match mask {
            None => (&self.0.sample[0], vec![logits, positions, seeds, params]),
            Some(m) => (&self.0.sample[1], vec![logits, positions, seeds, params, m]),
        };
        let mut out = kernel.apply(
            &inputs,
            &[(&[rows], Dtype::Uint32)],
            (rows * SAMPLE_BLOCK, 1, 1),
            (SAMPLE_BLOCK, 1, 1),
            &[
                ("T", Template::Dtype(logits.dtype())),
                ("BLOCK", Template::Int(SAMPLE_BLOCK)),
                ("CAP", Template::Int(SAMPLE_CAP)),
            ],
        )?;
        Ok(out.remove(0))
    }
}

/// How a product's input tile is made.
pub(crate) enum GemvInput<'a> {
    Plain(&'a Array),
    /// `h + r` normalized with `weight` and `eps`; the sum is a second output.
    AddNorm {
        h: &'a Array,
        r: &'a Array,
        weight: &'a Array,
        eps: f32,
    },
}

/// What a product gives.
#[derive(Clone, Copy)]
pub(crate) enum GemvOutput {
    Product,
    /// `silu(gate) * up` of the product's halves (a stacked gate/up weight),
    /// half as wide.
    Swiglu,
}

impl GemvOutput {
    /// Weight rows an output reads.
    fn per_out(self) -> i32 {
        match self {
            GemvOutput::Product => 1,
            GemvOutput::Swiglu => 2,
        }
    }
}

/// A layer's q/k/v product and what the q/k kernels rotate it with and
/// write its keys and values into.
pub(crate) struct QkvHeads<'a> {
    /// The q/k/v product `[rows, L, (heads + 2 * kv_heads) * head_dim]`,
    /// contiguous (a step's L is 1).
    pub qkv: &'a Array,
    /// Qwen3's q and k norm weights (`[head_dim]` each) and eps.
    pub qk_norm: Option<(&'a Array, &'a Array, f32)>,
    /// `[positions, head_dim]` float32, a [`crate::nn::rope::PositionTable`]'s
    /// rows, read at each token's position.
    pub cos: &'a Array,
    pub signed_sin: &'a Array,
    pub traditional: bool,
    /// The cache's buffers `[rows, kv_heads, capacity, head_dim]`, written
    /// in place.
    pub keys: &'a Array,
    pub values: &'a Array,
    pub heads: i32,
    pub kv_heads: i32,
}

impl<'a> QkvHeads<'a> {
    /// The kernel's inputs: the product, the norm weights (the cosines
    /// stand in without norms) and the tables, then `rest`, then the cache.
    fn inputs(&self, rest: &[&'a Array]) -> Vec<&'a Array> {
        let (q_norm, k_norm) = match self.qk_norm {
            Some((q, k, _)) => (q, k),
            None => (self.cos, self.cos),
        };
        let lead = [self.qkv, q_norm, k_norm, self.cos, self.signed_sin];
        [&lead[..], rest, &[self.keys, self.values]].concat()
    }

    /// Both kernels' constants.
    fn templates(&self) -> Vec<(&'static str, Template)> {
        vec![
            ("T", Template::Dtype(self.qkv.dtype())),
            ("D", Template::Int(self.cos.dim(-1))),
            ("NQ", Template::Int(self.heads)),
            ("NKV", Template::Int(self.kv_heads)),
            ("NORM", Template::Bool(self.qk_norm.is_some())),
            ("TRAD", Template::Bool(self.traditional)),
            (
                "EPS_BITS",
                eps_bits(self.qk_norm.map_or(0.0, |(_, _, eps)| eps)),
            ),
        ]
    }
}

/// What [`Kernels::qkv_attend`] reads besides the heads (one token a row).
pub(crate) struct QkvAttend<'a> {
    pub heads: QkvHeads<'a>,
    /// `[rows]` int32: where each row's key goes, its last attended key.
    pub positions: &'a Array,
    /// `[rows]` int32: each row's first attended key.
    pub starts: &'a Array,
    /// Zeros from [`Kernels::attend_counts`], for every layer of a step in
    /// turn (each launch leaves them zero).
    pub counts: &'a Array,
}

fn eps_bits(eps: f32) -> Template {
    Template::Int(eps.to_bits() as i32)
}

impl Kernels {
    pub(crate) fn new() -> Result<Self> {
        Ok(Kernels {
            qkv_attend: CudaKernel::new(
                "emlx_axon_qkv_attend",
                &[
                    "qkv",
                    "q_norm",
                    "k_norm",
                    "rope_cos",
                    "rope_sin",
                    "positions",
                    "starts",
                    "keys",
                    "values",
                    "counts",
                ],
                &["out", "part"],
                &[QKV_ATTEND_HEAD, ATTEND_KEYS, ATTEND_COMBINE].concat(),
            )?
            // Two blocks a multiprocessor: with four query heads a block
            // the compiler would take a few registers more than that leaves.
            .bounded(BLOCK, 2),
            add_norm: CudaKernel::new(
                "emlx_axon_add_norm",
                &["h", "r", "w"],
                &["sum", "normed"],
                &[ADD_NORM, BLOCK_NORM, ADD_NORM_OUT].concat(),
            )?,
            swiglu: CudaKernel::new(
                "emlx_axon_swiglu",
                &["gu"],
                &["act"],
                &[SWIGLU_OF, SWIGLU].concat(),
            )?,
            qk_rope_write: CudaKernel::new(
                "emlx_axon_qk_rope_write",
                &[
                    "qkv", "q_norm", "k_norm", "rope_cos", "rope_sin", "offset", "keys", "values",
                ],
                &["q"],
                QK_ROPE_WRITE,
            )?,
            products: [products(Body::Tile)?, products(Body::Split)?],
            experts: [
                product_kernel(Body::Tile, Tile::Experts, 1)?,
                product_kernel(Body::Tile, Tile::Experts, 2)?,
            ],
            route: CudaKernel::new(
                "emlx_axon_moe_route",
                &["logits"],
                &["ids", "scores"],
                MOE_ROUTE,
            )?,
            combine: CudaKernel::new(
                "emlx_axon_moe_combine",
                &["ys", "scores"],
                &["out"],
                MOE_COMBINE,
            )?,
            argmax: [
                CudaKernel::new(
                    "emlx_axon_argmax",
                    &["x"],
                    &["out"],
                    &[MASK_NONE, ARGMAX].concat(),
                )?,
                CudaKernel::new(
                    "emlx_axon_argmax_masked",
                    &["x", "mask"],
                    &["out"],
                    &[MASK_BITS, ARGMAX].concat(),
                )?,
            ],
            sample: [
                CudaKernel::new(
                    "emlx_axon_sample",
                    &["x", "positions", "seeds", "params"],
                    &["out"],
                    &[MASK_NONE, SAMPLE].concat(),
                )?,
                CudaKernel::new(
                    "emlx_axon_sample_masked",
                    &["x", "positions", "seeds", "params", "mask"],
                    &["out"],
                    &[MASK_BITS, SAMPLE].concat(),
                )?,
            ],
            zeros: CudaKernel::new("emlx_axon_zeros", &[], &["out"], ZEROS)?,
            embed_norm: CudaKernel::new(
                "emlx_axon_embed_norm",
                &["ids", "wq", "scales", "biases", "nw"],
                &["h", "normed"],
                &[EMBED_NORM, BLOCK_NORM, EMBED_NORM_OUT].concat(),
            )?,
        })
    }

    /// `(h, rms_norm(h) * w)` for `h` the rows of the quantized table
    /// `table` at `ids` (`[rows, 1]`, any integer type), `[rows, 1, hidden]`
    /// in `dtype`, as MLX's `take`, `dequantize` and `rms_norm` compute them.
    pub(crate) fn embed_norm(
        &self,
        ids: &Array,
        table: &QuantWeight,
        w: &Array,
        eps: f32,
        dtype: Dtype,
    ) -> Result<(Array, Array)> {
        let (rows, d) = (ids.dim(0), w.dim(-1));
        let shape = [rows, 1, d];
        let out = self.embed_norm.apply(
            &[ids, table.w, table.scales, table.biases, w],
            &[(&shape, dtype), (&shape, dtype)],
            (BLOCK, rows, 1),
            (BLOCK, 1, 1),
            &[
                ("T", Template::Dtype(dtype)),
                ("D", Template::Int(d)),
                ("BITS", Template::Int(table.bits)),
                ("GS", Template::Int(table.group_size)),
                ("BLOCK", Template::Int(BLOCK)),
                ("EPS_BITS", eps_bits(eps)),
            ],
        )?;
        Ok(pair(out))
    }

    /// Zeroed counts for [`Kernels::qkv_attend`] over `rows` rows of
    /// `heads` heads.
    pub(crate) fn attend_counts(&self, rows: i32, heads: i32) -> Result<Array> {
        let n = (rows * heads).max(COUNTS_MIN);
        let mut out = self.zeros.apply(
            &[],
            &[(&[n], Dtype::Int32)],
            (n, 1, 1),
            (BLOCK.min(n), 1, 1),
            &[("N", Template::Int(n))],
        )?;
        Ok(out.remove(0))
    }

    /// Attention's output `[rows, 1, heads * head_dim]`; the new keys and
    /// values go into the cache. A row's keys are split over enough blocks
    /// for one row's blocks to fill the GPU about twice (flash-decoding), so
    /// that the time of a long row's attention falls with the
    /// multiprocessors it runs on. The count does not depend on the batch:
    /// a row's attention sums the same in a batch as alone.
    pub(crate) fn qkv_attend(&self, p: &QkvAttend) -> Result<Array> {
        let h = &p.heads;
        let (rows, hd) = (h.qkv.dim(0), h.cos.dim(-1));
        if p.counts.size() < (rows * h.heads) as usize {
            return Err(Error::invalid("the attention kernel's counts are too few"));
        }
        if !attends(hd, h.keys) || !attends(hd, h.values) {
            return Err(Error::invalid(format!(
                "the attention kernel takes heads of 32, 64 or 128 values in \
                 caches of whole 16-byte rows, not {hd}"
            )));
        }
        let tile = query_tile(h.heads / h.kv_heads);
        let blocks = h.heads / tile;
        let sms = crate::backend::cuda::kernel::multiprocessors().unwrap_or(1);
        // No more than a full cache would use: a short generation's grid
        // has no blocks that would only find no keys of theirs and exit.
        // A power of two: few variants to compile as batches change size.
        let capacity = h.keys.dim(2);
        let most = capacity / ATTEND_MIN_KEYS;
        let fill = (2 * sms / blocks).clamp(1, ATTEND_SPLITS).min(most.max(1));
        let splits = 1 << (31 - fill.leading_zeros());
        let mut templates = h.templates();
        templates.extend([
            ("BLOCK", Template::Int(BLOCK)),
            ("TILE", Template::Int(tile)),
            ("SPLITS", Template::Int(splits)),
            ("MIN_KEYS", Template::Int(ATTEND_MIN_KEYS)),
        ]);
        let mut inputs = h.inputs(&[p.positions, p.starts]);
        inputs.push(p.counts);
        let mut out = self.qkv_attend.apply(
            &inputs,
            &[
                (&[rows, 1, h.heads * hd], h.qkv.dtype()),
                (&[rows, h.heads, splits, hd + 2], Dtype::Float32),
            ],
            (blocks * BLOCK, rows, splits),
            (BLOCK, 1, 1),
            &templates,
        )?;
        Ok(out.remove(0))
    }

    /// A prompt's queries `[B, heads, L, head_dim]`, normalized and
    /// rotated; its keys and values go into the cache at `offset` (`[1]`
    /// int32, the first token's position) on.
    pub(crate) fn qk_rope_write(&self, h: &QkvHeads, offset: &Array) -> Result<Array> {
        let (b, l, hd) = (h.qkv.dim(0), h.qkv.dim(1), h.cos.dim(-1));
        let mut out = self.qk_rope_write.apply(
            &h.inputs(&[offset]),
            &[(&[b, h.heads, l, hd], h.qkv.dtype())],
            ((h.heads + h.kv_heads) * hd, l, b),
            (hd, 1, 1),
            &h.templates(),
        )?;
        Ok(out.remove(0))
    }

    /// `(h + r, rms_norm(h + r) * w)` for `[B, L, hidden]` arrays (a step's
    /// `[rows, 1, hidden]`).
    pub(crate) fn add_norm(
        &self,
        h: &Array,
        r: &Array,
        w: &Array,
        eps: f32,
    ) -> Result<(Array, Array)> {
        let shape = h.shape();
        let (rows, d) = (h.dim(0) * h.dim(1), h.dim(-1));
        let dtype = h.dtype();
        let out = self.add_norm.apply(
            &[h, r, w],
            &[(shape, dtype), (shape, dtype)],
            (BLOCK, rows, 1),
            (BLOCK, 1, 1),
            &[
                ("T", Template::Dtype(dtype)),
                ("D", Template::Int(d)),
                ("BLOCK", Template::Int(BLOCK)),
                ("EPS_BITS", eps_bits(eps)),
            ],
        )?;
        Ok(pair(out))
    }

    /// The last axis's argmax (uint32), as MLX's `argmax`; with `mask`
    /// (`[rows, ceil(V / 32)]` uint32, see [`MASK_BITS`]) among the tokens
    /// each row's mask allows (0 where it allows none).
    pub(crate) fn argmax(&self, logits: &Array, mask: Option<&Array>) -> Result<Array> {
        let shape = logits.shape();
        let v = logits.dim(-1);
        let rows = shape[..shape.len() - 1].iter().product::<i32>();
        // Reshapes only where needed: each is a node of its own.
        let flat;
        let x = match shape.len() {
            2 => logits,
            _ => {
                flat = logits.reshape(&[rows, v])?;
                &flat
            }
        };
        let (kernel, inputs) = match mask {
            None => (&self.argmax[0], vec![x]),
            Some(m) => (&self.argmax[1], vec![x, m]),
        };
        let mut out = kernel.apply(
            &inputs,
            &[(&[rows], Dtype::Uint32)],
            (rows * ARGMAX_BLOCK, 1, 1),
            (ARGMAX_BLOCK, 1, 1),
            &[
                ("T", Template::Dtype(logits.dtype())),
                ("BLOCK", Template::Int(ARGMAX_BLOCK)),
            ],
        )?;
        let ids = out.remove(0);
        Ok(match shape.len() {
            2 => ids,
            _ => ids.reshape(&shape[..shape.len() - 1])?,
        })
    }

    /// `silu(gate) * up` of a stacked gate/up product `[..., 2 * I]`.
    pub(crate) fn swiglu(&self, gu: &Array) -> Result<Array> {
        let i = gu.dim(-1) / 2;
        let rows = (gu.size() / gu.dim(-1).max(1) as usize) as i32;
        let mut shape = gu.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = i;
        }
        let mut out = self.swiglu.apply(
            &[gu],
            &[(&shape, gu.dtype())],
            (i, rows, 1),
            (BLOCK, 1, 1),
            &[("T", Template::Dtype(gu.dtype())), ("I", Template::Int(i))],
        )?;
        Ok(out.remove(0))
    }

    /// `input @ W.T` for a quantized `W` (`[N, K]` logical), `[rows, 1, N]`
    /// (`N / 2` for [`GemvOutput::Swiglu`]); with the residual sum first for
    /// [`GemvInput::AddNorm`].
    pub(crate) fn gemv(
        &self,
        input: &GemvInput,
        output: GemvOutput,
        wt: &QuantWeight,
    ) -> Result<Vec<Array>> {
        let first = match input {
            GemvInput::Plain(x) => *x,
            GemvInput::AddNorm { h, .. } => *h,
        };
        let (rows, k_dim, dtype) = (first.dim(0), first.dim(-1), first.dtype());
        let per_out = output.per_out();
        let outs = wt.w.dim(0) / per_out;
        let (bt, xt) = tile(rows, k_dim, wt.bits, dtype);
        let body = Body::of(bt, wt.bits, dtype, wt.w.dim(0), k_dim);
        let mut templates = product_templates(dtype, k_dim, wt, bt, xt);
        let params = [wt.w, wt.scales, wt.biases];
        let out = [rows, 1, outs];
        let sum_shape = [rows, 1, k_dim];
        let (inputs, outputs, add_norm): (Vec<&Array>, Vec<(&[i32], Dtype)>, _) = match input {
            GemvInput::Plain(x) => (vec![*x], vec![(&out, dtype)], false),
            GemvInput::AddNorm { h, r, weight, eps } => {
                templates.push(("EPS_BITS", eps_bits(*eps)));
                let outputs = vec![(&sum_shape[..], dtype), (&out[..], dtype)];
                (vec![*h, *r, *weight], outputs, true)
            }
        };
        let kernel = &self.products[body as usize][add_norm as usize][per_out as usize - 1];
        let inputs = [&inputs[..], &params].concat();
        let launch = Launch {
            body,
            bits: wt.bits,
            weight_rows: wt.w.dim(0),
            k_dim,
            outs,
            per_out,
            tiles: (rows + bt - 1) / bt,
        };
        launch.run(kernel, &inputs, &outputs, templates)
    }

    /// Routed experts' products: each row of `x` (`[rows, 1, K]`, or
    /// `[rows * choices, 1, K]`, a row per choice) through the expert
    /// `ids` (`[rows, choices]` int32) names for it, of the stacked
    /// `gate` (`[experts, N, K]` logical), or with `up` SwiGLU of the two;
    /// `[rows * choices, 1, N]`.
    pub(crate) fn experts(
        &self,
        x: &Array,
        ids: &Array,
        gate: &QuantWeight,
        up: Option<&QuantWeight>,
    ) -> Result<Array> {
        let (k_dim, dtype) = (x.dim(-1), x.dtype());
        let pairs = ids.dim(0) * ids.dim(1);
        let outs = gate.w.dim(1);
        let per_out = if up.is_some() { 2 } else { 1 };
        let (_, xt) = tile(1, k_dim, gate.bits, dtype);
        let templates = product_templates(dtype, k_dim, gate, 1, xt);
        let mut inputs = vec![x, ids, gate.w, gate.scales, gate.biases];
        if let Some(up) = up {
            inputs.extend([up.w, up.scales, up.biases]);
        }
        let launch = Launch {
            body: Body::Tile,
            bits: gate.bits,
            weight_rows: outs * per_out,
            k_dim,
            outs,
            per_out,
            tiles: pairs,
        };
        let kernel = &self.experts[per_out as usize - 1];
        let mut out = launch.run(kernel, &inputs, &[(&[pairs, 1, outs], dtype)], templates)?;
        Ok(out.remove(0))
    }

    /// Each row's `top_k` experts (`[rows, top_k]` int32, smallest first) and
    /// their weights (`[rows, top_k]` in the logits' dtype, divided by
    /// their sum with `norm`) from the router's logits `[rows, 1, E]`.
    pub(crate) fn route(&self, logits: &Array, top_k: i32, norm: bool) -> Result<(Array, Array)> {
        let (e, dtype) = (logits.dim(-1), logits.dtype());
        let rows = (logits.size() / e.max(1) as usize) as i32;
        let shape = [rows, top_k];
        let out = self.route.apply(
            &[logits],
            &[(&shape, Dtype::Int32), (&shape, dtype)],
            (ROUTE_BLOCK, rows, 1),
            (ROUTE_BLOCK, 1, 1),
            &[
                ("T", Template::Dtype(dtype)),
                ("E", Template::Int(e)),
                ("TOPK", Template::Int(top_k)),
                ("NORM", Template::Bool(norm)),
                ("BLOCK", Template::Int(ROUTE_BLOCK)),
            ],
        )?;
        Ok(pair(out))
    }

    /// The experts' outputs `ys` (`[rows * top_k, 1, D]`) weighted by
    /// `scores` (`[rows, top_k]`) and summed: `[rows, 1, D]`.
    pub(crate) fn combine(&self, ys: &Array, scores: &Array) -> Result<Array> {
        let (rows, top_k, d) = (scores.dim(0), scores.dim(1), ys.dim(-1));
        let mut out = self.combine.apply(
            &[ys, scores],
            &[(&[rows, 1, d], ys.dtype())],
            ((d + BLOCK - 1) / BLOCK * BLOCK, rows, 1),
            (BLOCK, 1, 1),
            &[
                ("T", Template::Dtype(ys.dtype())),
                ("D", Template::Int(d)),
                ("TOPK", Template::Int(top_k)),
            ],
        )?;
        Ok(out.remove(0))
    }
}

/// The router kernel's threads: one block a token, a value a thread for
/// routers of up to 128 experts.
const ROUTE_BLOCK: i32 = 128;

/// Every product kernel's constants but the launch's.
fn product_templates(
    dtype: Dtype,
    k_dim: i32,
    wt: &QuantWeight,
    bt: i32,
    xt: Dtype,
) -> Vec<(&'static str, Template)> {
    vec![
        ("T", Template::Dtype(dtype)),
        ("K", Template::Int(k_dim)),
        ("BITS", Template::Int(wt.bits)),
        ("GS", Template::Int(wt.group_size)),
        ("BT", Template::Int(bt)),
        ("XT", Template::Dtype(xt)),
    ]
}

/// A product's launch: its body, the weight's bits and rows (both halves
/// for SwiGLU) of `k_dim` values, the outputs, and the input tiles.
struct Launch {
    body: Body,
    bits: i32,
    weight_rows: i32,
    k_dim: i32,
    outs: i32,
    per_out: i32,
    tiles: i32,
}

impl Launch {
    fn run(
        &self,
        kernel: &CudaKernel,
        inputs: &[&Array],
        outputs: &[(&[i32], Dtype)],
        mut templates: Vec<(&'static str, Template)>,
    ) -> Result<Vec<Array>> {
        // Threads a block, outputs a block takes at a time, and whether the
        // blocks loop over the outputs in one wave.
        let (threads, per_block, looping) = match self.body {
            Body::Split => {
                let chunks = self.k_dim * self.bits / 128;
                ((chunks + 31) / 32 * 32, 4 / self.per_out, true)
            }
            Body::Tile => {
                let looping = loops(self.weight_rows, self.k_dim);
                let r = if looping {
                    1
                } else {
                    outputs_per_warp(self.outs)
                };
                templates.push(("R", Template::Int(r)));
                templates.push(("LOOP", Template::Bool(looping)));
                (BLOCK, BLOCK / 32 * r, looping)
            }
        };
        templates.push(("BLOCK", Template::Int(threads)));
        let mut blocks = (self.outs + per_block - 1) / per_block;
        if looping {
            // One wave: as many blocks as the device holds at once, each
            // taking the same number of trips.
            let per_sm = kernel.resident_blocks(inputs, outputs, &templates, threads)?;
            if let (Some(sms), Some(per_sm)) =
                (crate::backend::cuda::kernel::multiprocessors(), per_sm)
            {
                let wave = (sms * per_sm / self.tiles).max(1);
                let trips = (blocks + wave - 1) / wave;
                blocks = (blocks + trips - 1) / trips;
            }
        }
        let grid = (blocks * threads, self.tiles, 1);
        kernel.apply(inputs, outputs, grid, (threads, 1, 1), &templates)
    }
}

/// Outputs a warp computes where it does not loop: one (a block per 8,
/// every block's prologue on the same inputs) up to a few thousand; more for
/// wider products, where the repeated prologues would cost more than the
/// products (all a warp's weight rows are fetched at once, so they cost
/// registers, not trips).
fn outputs_per_warp(outs: i32) -> i32 {
    match outs {
        4096.. => 2,
        _ => 1,
    }
}

/// Whether a product of `rows` weight rows of `k_dim` values loops: one wave
/// of blocks, each warp taking outputs a grid apart with its next weight
/// rows always in flight, so that each block's prologue (the tile, its
/// chunk sums, the add + norm) is done once rather than per 8 outputs and
/// the reads never wait on a block's start. Products of `LOOP_VALUES`
/// weight values or more loop: every layer product of Qwen3-4B and wider
/// and every output head; the 0.6B's layer products (at most 6.3M values,
/// rows of 1,024) are faster as one output a warp.
fn loops(rows: i32, k_dim: i32) -> bool {
    i64::from(rows) * i64::from(k_dim) >= LOOP_VALUES
}

const LOOP_VALUES: i64 = 1 << 23;

/// A product's body: [`GEMV_BODY`] (tiles of input rows) or
/// [`GEMV_SPLIT`] (one row, 4-bit weights, 2-byte inputs, a product that
/// loops: there it is the faster, being compute-light where the tile body
/// is compute-bound; on smaller products the tile body is).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Body {
    Tile,
    Split,
}

impl Body {
    /// The body for a tile of `bt` rows, `bits`-bit weights, `dtype` inputs
    /// and a weight of `rows` rows of `k_dim` values.
    pub(crate) fn of(bt: i32, bits: i32, dtype: Dtype, rows: i32, k_dim: i32) -> Body {
        if bt == 1 && bits == 4 && dtype != Dtype::Float32 && loops(rows, k_dim) {
            Body::Split
        } else {
            Body::Tile
        }
    }
}

/// A body's product kernels, `[input][output]` as [`Kernels`] holds them.
fn products(body: Body) -> Result<[[CudaKernel; 2]; 2]> {
    Ok([
        [
            product_kernel(body, Tile::Plain, 1)?,
            product_kernel(body, Tile::Plain, 2)?,
        ],
        [
            product_kernel(body, Tile::AddNorm, 1)?,
            product_kernel(body, Tile::AddNorm, 2)?,
        ],
    ])
}

/// What a product's input tile is made from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tile {
    /// Its rows of `x`.
    Plain,
    /// The residual add and RMSNorm of its rows of `h` and `r`.
    AddNorm,
    /// Its (row, choice) pair's row of `x`, through the pair's expert.
    Experts,
}

/// The product kernel of a body for an input tile and an output (each of
/// `per_out` weight rows: 1 a product, 2 SwiGLU of gate and up).
fn product_kernel(body: Body, input: Tile, per_out: i32) -> Result<CudaKernel> {
    let plain: &[&str] = &["x", "wq", "scales", "biases"];
    let (stem, inputs, outputs, prologue): (_, &[&str], &[&str], _) = match input {
        Tile::Plain => ("emlx_axon_gemv", plain, &["y"], GEMV_PLAIN),
        Tile::AddNorm => (
            "emlx_axon_gemv_add_norm",
            &["h", "r", "nw", "wq", "scales", "biases"],
            &["sum", "y"],
            GEMV_ADD_NORM,
        ),
        Tile::Experts if per_out == 1 => (
            "emlx_axon_gemv_experts",
            &["x", "experts", "wq", "scales", "biases"],
            &["y"],
            GEMV_PLAIN,
        ),
        Tile::Experts => (
            "emlx_axon_gemv_experts",
            &[
                "x",
                "experts",
                "wq",
                "scales",
                "biases",
                "up_wq",
                "up_scales",
                "up_biases",
            ],
            &["y"],
            GEMV_PLAIN,
        ),
    };
    // The rows (tiles of one row for experts) and outputs, and how many
    // tile rows share an input row.
    let shapes = match input {
        Tile::Experts => "const int ROWS = experts_shape[0] * experts_shape[1];\n\
                          const int OUTS = wq_shape[1];\n\
                          const int X_EVERY = x_shape[0] == ROWS ? 1 : experts_shape[1];\n"
            .to_string(),
        _ => format!(
            "const int ROWS = {}_shape[0];\nconst int OUTS = wq_shape[0] / PER_OUT;\n\
             constexpr int X_EVERY = 1;\n",
            inputs[0]
        ),
    };
    let output = if per_out == 1 { "" } else { "_swiglu" };
    let weights = match (body, input) {
        (Body::Split, _) => String::new(),
        (Body::Tile, Tile::Experts) if per_out == 2 => [GEMV_EXPERTS, GEMV_EXPERTS_UP].concat(),
        (Body::Tile, Tile::Experts) => GEMV_EXPERTS.to_string(),
        (Body::Tile, _) => GEMV_WEIGHTS.to_string(),
    };
    let (suffix, fetch, main) = match body {
        Body::Tile => ("", GEMV_TILE_FETCH, GEMV_BODY),
        Body::Split => ("_split", GEMV_SPLIT_FETCH, GEMV_SPLIT),
    };
    let kernel = CudaKernel::new(
        &format!("{stem}{output}{suffix}"),
        inputs,
        outputs,
        &[
            &format!("constexpr int PER_OUT = {per_out};\n"),
            &shapes,
            SWIGLU_OF,
            GEMV_START,
            &weights,
            fetch,
            prologue,
            main,
        ]
        .concat(),
    )?;
    Ok(match body {
        Body::Tile => kernel,
        // Registers for 24 warps a multiprocessor: a weight row's bytes in
        // flight per thread are few, so the split body needs many threads.
        Body::Split => kernel.bounded_per_multiprocessor(SPLIT_THREADS),
    })
}

/// Threads a multiprocessor that [`GEMV_SPLIT`]'s registers leave room for.
const SPLIT_THREADS: i32 = 768;

/// A two-output kernel's outputs in order (`apply` returns as many as asked).
pub(crate) fn pair(mut outputs: Vec<Array>) -> (Array, Array) {
    let second = outputs.pop().expect("two outputs");
    (outputs.pop().expect("two outputs"), second)
}

/// Whether [`Kernels::embed_norm`] takes this table for a hidden size of
/// `dim`: values that never straddle a word, whole groups and words a row.
pub(crate) fn embeds(table: &QuantWeight, dim: i32) -> bool {
    matches!(table.bits, 2 | 4 | 8)
        && table.group_size > 0
        && dim % table.group_size == 0
        && dim % (32 / table.bits) == 0
        && table.w.ndim() == 2
        && table.w.dim(1) == dim * table.bits / 32
        && table.scales.dim(-1) == dim / table.group_size
}

/// Dtypes the kernels compute in.
pub(crate) fn takes_dtype(d: Dtype) -> bool {
    matches!(d, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_tiles_fit_and_spread_rows_evenly() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            for bits in [4, 8] {
                for k in [256, 1024, 2048, 3072, 8192] {
                    for rows in 1..=20 {
                        let (bt, xt) = tile(rows, k, bits, dtype);
                        let tiles = (rows + bt - 1) / bt;
                        assert!((1..=8).contains(&bt), "{rows} rows of {k}: {bt}");
                        assert!(xt == dtype || xt == Dtype::Float32);
                        assert!(
                            bt * tile_row_bytes(k, bits, xt) <= TILE_BYTES
                                || (bt == 1 && tile_row_bytes(k, bits, xt) <= ROW_BYTES),
                            "{rows} of {k}: {bt}"
                        );
                        // No tile is emptier than another by more than a row.
                        assert!(tiles * bt - rows < tiles, "{rows} of {k}: {bt} x {tiles}");
                    }
                }
            }
        }
        // Qwen3-0.6B's shapes: one row of any product and eight of its
        // hidden size in float32; eight rows of the MLP's width in two tiles.
        assert_eq!(tile(1, 3072, 4, Dtype::Bfloat16), (1, Dtype::Float32));
        assert_eq!(tile(8, 1024, 4, Dtype::Bfloat16), (8, Dtype::Float32));
        assert_eq!(tile(8, 3072, 4, Dtype::Bfloat16), (4, Dtype::Bfloat16));
        // A row too wide for a tile is refused.
        assert!(gemv_takes(4, 64, 17408, Dtype::Bfloat16));
        assert!(!gemv_takes(4, 64, 25600, Dtype::Bfloat16));
    }

    #[test]
    fn wide_products_and_heads_loop() {
        assert!(layers(1024, 16, 8, 3072).iter().all(|&(n, k)| !loops(n, k)));
        for (d, heads, kv, inter) in [
            (2560, 32, 8, 9728),
            (4096, 32, 8, 12288),
            (5120, 64, 8, 25600),
        ] {
            assert!(layers(d, heads, kv, inter)
                .iter()
                .all(|&(n, k)| loops(n, k)));
        }
        assert!(loops(151_936, 1024));
    }

    /// Weight rows and inputs of q/k/v, o, gate/up and down of a Qwen3
    /// shape.
    fn layers(d: i32, heads: i32, kv: i32, inter: i32) -> [(i32, i32); 4] {
        let hd = 128;
        [
            ((heads + 2 * kv) * hd, d),
            (d, heads * hd),
            (2 * inter, d),
            (d, inter),
        ]
    }

    /// One row of a wide 4-bit product in a 2-byte dtype is split along
    /// the row; tiles of rows, 8-bit weights, float32 and the 0.6B's small
    /// layer products take the tile body.
    #[test]
    fn split_body_takes_one_row_of_wide_4_bit_products() {
        let bf16 = Dtype::Bfloat16;
        for (n, k) in layers(4096, 32, 8, 12288) {
            assert_eq!(Body::of(1, 4, bf16, n, k), Body::Split, "{n} x {k}");
            assert_eq!(Body::of(1, 4, Dtype::Float16, n, k), Body::Split);
            assert_eq!(Body::of(1, 8, bf16, n, k), Body::Tile);
            assert_eq!(Body::of(1, 4, Dtype::Float32, n, k), Body::Tile);
            assert_eq!(Body::of(2, 4, bf16, n, k), Body::Tile);
        }
        for (n, k) in layers(1024, 16, 8, 3072) {
            assert_eq!(Body::of(1, 4, bf16, n, k), Body::Tile, "{n} x {k}");
        }
        assert_eq!(Body::of(1, 4, bf16, 151_936, 1024), Body::Split);
    }
}
