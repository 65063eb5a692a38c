//! A one-token step's layers on a CUDA GPU from few MLX nodes: MLX's
//! quantized products and kernels of our own ([`kernels`]): q/k norm +
//! RoPE + cache write + attention over each row's keys in one, residual
//! add + RMSNorm, SwiGLU; eight nodes a layer instead of about twenty.
//! By default the products are ours too, each reading the add + norm before
//! it, the gate/up product giving SwiGLU of its halves: five nodes a layer,
//! the output head reads the final norm, and greedy tokens come from our
//! argmax (`EMLX_AXON_GPU_GEMV=0` keeps MLX's products). A quantized
//! embedding table is read by a kernel that also gives the first layer's
//! norm: one node where MLX's `take`, `dequantize` and `rms_norm` made
//! about eight.
//!
//! MLX's CUDA backend spends about 6 µs of host time on every node it
//! evaluates (an NVIDIA H200, chains of small ops), views and reshapes
//! included: with MLX's ops a small model's decode step is bound by that.
//! The kernels cut the count without changing what is computed: they round
//! where MLX's ops would (see [`kernels`]). Keys and values are written into
//! the cache buffers in place, so the cache's own update goes too. With
//! five nodes a layer, timed kernel by kernel on an H200 (Qwen3-0.6B shape,
//! 4-bit, bfloat16), a batch-1 step's kernels take about 0.85 ms, each
//! bound by its chain of trips to memory rather than by bandwidth (the
//! products 4-6 µs for 1-3 MB of weights, attention 8.6 µs, the output head
//! 57 µs), and the host takes as long to build and queue the step's ~145
//! nodes (0.27 ms to build, 0.6 ms for MLX to queue them as one graph): the
//! device waits on the host.
//!
//! A Qwen3-MoE layer's routed experts take kernels of their own after the
//! residual add + norm: the router's product, each token's top-k experts
//! and their weights (`Kernels::route`), the chosen experts' gate/up and
//! down products, each (token, choice) pair a tile that reads its expert's
//! rows of the stacked weights (`Kernels::experts`), and the weighted sum
//! (`Kernels::combine`): nine nodes a layer, all ours, so that such a
//! step is replayed too. They are checked on their own at first use, where
//! a model has experts; prompts keep MLX's ops for the experts.
//!
//! On by default on CUDA (`EMLX_AXON_GPU_LAYER=0` keeps MLX's ops). The
//! kernels are compiled once per machine and kept on disk
//! ([`crate::backend::cuda::kernel`]); each is checked against MLX's ops on first
//! use per dtype, and where they cannot be built or differ, layers are
//! built from MLX's ops. Measured on an NVIDIA H200 (bfloat16, Qwen3-0.6B
//! shape, 4-bit, 5 fresh processes each, before steps were replayed;
//! bench/RESULTS-gpu.md, commit 2bb87fc): batch-1 decode 833 tok/s (MLX's products in the fused layers: 602), batch 4
//! 2,714 (1,624), batch 8 3,986 (1,833). Metal keeps MLX's ops (MLX's
//! Metal build has no CUDA kernels; ports of these sources to
//! `metal_kernel` are not written).

use mlx_rs::fast::rms_norm;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};
use std::cell::RefCell;
use std::sync::Mutex;

use once_cell::sync::{Lazy, OnceCell};

use super::kernels::{self, pair, GemvInput, GemvOutput, Kernels, QkvAttend, QkvHeads};
use crate::backend::cuda::kernel::{max_diff, within};
use crate::checkpoint::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv::cache::{KvStore, StepRows};
use crate::nn::block::Block;
use crate::nn::layers::RmsNorm;
use crate::nn::moe::ExpertWeights;
use crate::nn::rope::PositionTable;
use emlx_axon_kernels::QuantWeight;

pub(crate) use super::kernels::{SampleKernel, SAMPLE_PARAMS, SAMPLE_TOP_K};

/// On by default where MLX has a CUDA GPU; `EMLX_AXON_GPU_LAYER=0` keeps
/// MLX's ops.
static WANTED: Lazy<bool> = Lazy::new(|| {
    crate::switches::gpu_layer()
        && !cfg!(feature = "metal")
        && crate::runtime::device::gpu_available()
});

/// Whether the quantized products are ours too: yes unless
/// `EMLX_AXON_GPU_GEMV=0`. They save four nodes a layer; on an NVIDIA H200
/// they were faster than MLX's at 1 and 8 rows and about as fast at 4.
static GEMV: Lazy<bool> = Lazy::new(crate::switches::gpu_gemv);

static KERNELS: OnceCell<Option<Kernels>> = OnceCell::new();

/// Each compute dtype's check result: a check builds every kernel variant it
/// runs (once per machine, then from the disk cache), so only dtypes in use
/// are checked.
static CHECKED: Lazy<Mutex<Vec<(Dtype, bool)>>> = Lazy::new(|| Mutex::new(Vec::new()));

/// The embedding kernel's, likewise: checked on its own, so that where it
/// fails the layers' kernels still run (on MLX's embeddings).
static EMBED_CHECKED: Lazy<Mutex<Vec<(Dtype, bool)>>> = Lazy::new(|| Mutex::new(Vec::new()));

/// The expert kernels' check results, by dtype: checked on their own, where
/// a model has routed experts.
static EXPERTS_CHECKED: Lazy<Mutex<Vec<(Dtype, bool)>>> = Lazy::new(|| Mutex::new(Vec::new()));

/// The sampling kernel's check results, by logits dtype: checked on its
/// own, so that where it fails greedy steps still take the kernels.
static SAMPLE_CHECKED: Lazy<Mutex<Vec<(Dtype, bool)>>> = Lazy::new(|| Mutex::new(Vec::new()));

/// The masked argmax's and masked sampling kernel's (constrained rows'),
/// each on its own: where one fails, constrained rows add their masks to
/// the logits and every other step keeps the kernels.
static MASKED_ARGMAX_CHECKED: Lazy<Mutex<Vec<(Dtype, bool)>>> =
    Lazy::new(|| Mutex::new(Vec::new()));
static MASKED_SAMPLE_CHECKED: Lazy<Mutex<Vec<(Dtype, bool)>>> =
    Lazy::new(|| Mutex::new(Vec::new()));

thread_local! {
    /// The positions array of the last one-token step this thread's layers
    /// built (see [`forward`]), for the sampling kernel: its draws hash each
    /// row's position, and a replay finds the step's changing positions by
    /// this very buffer (marked as the step's positions), which it replaces with
    /// its own and advances each step. Kept here rather than passed through
    /// the model, whose forward returns logits alone; forgotten at the start
    /// of every forward pass ([`forget_step_positions`]), so a prompt's
    /// logits never meet an earlier step's positions.
    static STEP_POSITIONS: RefCell<Option<Array>> = const { RefCell::new(None) };
}

/// Forgets the last step's positions: called as a forward pass starts.
pub(crate) fn forget_step_positions() {
    STEP_POSITIONS.with(|p| p.borrow_mut().take());
}

/// The positions (`[rows]` int32) of the one-token step just built on this
/// thread through these layers, taken (`None` after a prompt, or where the
/// layers did not take the step).
pub(crate) fn take_step_positions() -> Option<Array> {
    STEP_POSITIONS.with(|p| p.borrow_mut().take())
}

/// The sampling kernel for `logits` (`[rows, V]`), once `check` passed with
/// it in their dtype (run on first use per dtype, on a stream of its own),
/// `check(k, false)` unmasked and, where `masked`, `check(k, true)` masked;
/// `Err` says why not (MLX's ops then).
pub(crate) fn sample_kernel(
    logits: &Array,
    masked: bool,
    check: impl Fn(&SampleKernel, bool) -> Result<()>,
) -> std::result::Result<SampleKernel, &'static str> {
    let dtype = logits.dtype();
    if !*WANTED {
        return Err("sample kernel: no CUDA kernels in this build, device or environment");
    }
    if !kernels::takes_dtype(dtype) || logits.ndim() != 2 || logits.size() == 0 {
        return Err("sample kernel: logits of another dtype or shape");
    }
    if crate::runtime::device::on_cpu_stream() {
        return Err("sample kernel: not on a GPU stream");
    }
    let Some(k) = kernels(dtype) else {
        return Err("sample kernel: the CUDA kernels failed their check (see the notices)");
    };
    if !passes(&SAMPLE_CHECKED, dtype, || check(&SampleKernel(k), false)) {
        return Err("sample kernel: it failed its check on this device (see the notices)");
    }
    if masked
        && !passes(&MASKED_SAMPLE_CHECKED, dtype, || {
            check(&SampleKernel(k), true)
        })
    {
        return Err("sample kernel: its masked form failed its check here (see the notices)");
    }
    Ok(SampleKernel(k))
}

/// Whether the sampling kernel passed its check in every dtype checked so
/// far (`None`: none checked yet).
pub fn sample_checked() -> Option<bool> {
    all_passed(&SAMPLE_CHECKED)
}

/// Whether one-token steps on a GPU stream may take this path (asked for,
/// and a CUDA GPU; built and checked on first use).
pub(crate) fn wanted() -> bool {
    *WANTED
}

/// Whether the kernels passed their check in every dtype checked so far
/// (`None`: none checked yet).
pub fn checked() -> Option<bool> {
    all_passed(&CHECKED)
}

/// Whether every check kept in `results` passed (`None`: none ran yet).
pub(super) fn all_passed(results: &Mutex<Vec<(Dtype, bool)>>) -> Option<bool> {
    let results = results.lock().unwrap_or_else(|p| p.into_inner());
    (!results.is_empty()).then(|| results.iter().all(|(_, ok)| *ok))
}

fn fail<T>(e: Error) -> Option<T> {
    crate::backend::notice(format!("CUDA kernels unavailable, using MLX's ops ({e})"));
    None
}

/// The kernels, once they passed their check in `dtype`.
pub(super) fn kernels(dtype: Dtype) -> Option<&'static Kernels> {
    if !*WANTED {
        return None;
    }
    let k = KERNELS
        .get_or_init(|| Kernels::new().map_or_else(fail, Some))
        .as_ref()?;
    passes(&CHECKED, dtype, || check(k, dtype)).then_some(k)
}

/// Whether `check` passed in `dtype`, run on first ask per dtype (its result
/// kept in `results`).
pub(super) fn passes(
    results: &Mutex<Vec<(Dtype, bool)>>,
    dtype: Dtype,
    check: impl FnOnce() -> Result<()>,
) -> bool {
    let mut results = results.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, ok)) = results.iter().find(|(d, _)| *d == dtype) {
        return *ok;
    }
    // On a stream of its own: a kernel MLX fails to launch leaves its
    // stream's command graph failing later work.
    let ok = crate::runtime::device::MlxStream::new(crate::runtime::device::DeviceKind::Gpu)
        .and_then(|s| s.run(check))
        .map_or_else(fail, Some)
        .is_some();
    results.push((dtype, ok));
    ok
}

/// `x @ W.T` (`x` `[rows, 1, K]`) by the product kernel a step's layers use,
/// or with `swiglu`, SwiGLU of the halves of `W`'s outputs (gate rows, then
/// up rows) as the gate/up product gives it; `None` where the kernels are
/// not available in `x`'s dtype or do not take this weight. For timing the
/// kernel beside MLX's product (the bench's profile).
pub fn product(x: &Array, wt: &QuantWeight, swiglu: bool) -> Result<Option<Array>> {
    let Some(k) = kernels(x.dtype()) else {
        return Ok(None);
    };
    if !kernels::gemv_takes(wt.bits, wt.group_size, x.dim(-1), x.dtype()) {
        return Ok(None);
    }
    let output = if swiglu {
        GemvOutput::Swiglu
    } else {
        GemvOutput::Product
    };
    Ok(k.gemv(&GemvInput::Plain(x), output, wt)?.into_iter().next())
}

/// Each row's greedy token (uint32) from `logits` (`[..., vocab]`) with our
/// kernel, on a GPU stream where the kernels passed their check; `None`
/// elsewhere (MLX's argmax then). With `mask` (`[rows, ceil(vocab / 32)]`
/// uint32: bit `i % 32` of word `i / 32` allows token `i`), among the
/// tokens each row's mask allows.
pub(crate) fn argmax(logits: &Array, mask: Option<&Array>) -> Result<Option<Array>> {
    let usable = *WANTED
        && kernels::takes_dtype(logits.dtype())
        && logits.ndim() > 0
        && logits.size() > 0
        && !crate::runtime::device::on_cpu_stream();
    let dtype = logits.dtype();
    match usable.then(|| kernels(dtype)).flatten() {
        Some(k) if mask.is_some() => {
            if !passes(&MASKED_ARGMAX_CHECKED, dtype, || {
                check_masked_argmax(k, dtype)
            }) {
                crate::backend::declined(
                    "masked argmax: it failed its check on this device (see the notices)",
                );
                return Ok(None);
            }
            Ok(Some(k.argmax(logits, mask)?))
        }
        Some(k) => Ok(Some(k.argmax(logits, None)?)),
        None => Ok(None),
    }
}

/// What a step's layers end with.
pub(crate) enum Output {
    /// The final norm's output, for the output head to read.
    Normed(Array),
    /// The output head's logits `[rows, 1, vocab]`.
    Logits(Array),
}

/// The parts of a model a step runs here.
pub(crate) struct Stack<'a> {
    /// The embedding table, when quantized.
    pub embed: Option<QuantWeight<'a>>,
    pub blocks: &'a [Block],
    pub final_norm: &'a RmsNorm,
    /// The output head's weight, when quantized and without bias.
    pub head: Option<QuantWeight<'a>>,
}

/// What a step starts from.
pub(crate) struct Tokens<'a> {
    /// `[rows, 1]` token ids.
    pub ids: &'a Array,
    /// The compute dtype.
    pub dtype: Dtype,
    /// The ids' embeddings `[rows, 1, hidden]` from MLX's ops, where the
    /// embedding kernel does not take the table.
    pub embed: &'a dyn Fn() -> Result<Array>,
}

/// Every layer of a one-token step over `tokens`, then the final norm, and
/// with our products the output head too. `None`, before anything is
/// written to the cache, where the kernels do not take this model or step.
pub(crate) fn forward<C: KvStore>(
    c: &ModelConfig,
    stack: Stack,
    tokens: &Tokens,
    cache: &C,
    rows: &StepRows,
    rope: &PositionTable,
) -> Result<Option<Output>> {
    let (blocks, final_norm) = (stack.blocks, stack.final_norm);
    let n = tokens.ids.dim(0);
    let (hd, dtype) = (c.head_dim, tokens.dtype);
    // Our kernels run on GPU streams only (MLX refuses them elsewhere).
    let takes = !crate::runtime::device::on_cpu_stream()
        && kernels::takes_dtype(dtype)
        && {
            let (keys, values) = cache.buffers(0);
            kernels::attends(hd, keys) && kernels::attends(hd, values)
        }
        && c.num_heads % c.num_kv_heads == 0
        && rows.positions.len() == n as usize
        && rows.starts.len() == n as usize
        && !blocks.is_empty()
        && cache.buffers(0).0.dtype() == dtype
        && blocks.iter().all(|b| {
            // Routed experts run MLX's ops where the expert kernels do not
            // take them.
            b.mlp.dense().is_none_or(|m| {
                m.gate_up.is_stacked() && matches!(m.gate_up.sizes(), [g, u] if g == u)
            })
        });
    if !takes {
        return Ok(None);
    }
    let Some(k) = kernels(dtype) else {
        return Ok(None);
    };
    // Buffers a pass wrote in place that nothing has evaluated yet (a prompt
    // through the prompt kernels whose output was not read): within one
    // graph MLX's CUDA backend orders kernels by the buffers it sees them
    // write, and an in-place write is not one, so this step's attention
    // could read the cache before that write. Evaluated first, it is done.
    let pending: Vec<&Array> = (0..blocks.len())
        .flat_map(|i| {
            let (keys, values) = cache.buffers(i);
            [keys, values]
        })
        .filter(|a| !crate::runtime::memory::is_available(a))
        .collect();
    if !pending.is_empty() {
        mlx_rs::transforms::eval(pending)?;
    }
    let positions = Array::from_slice(&rows.positions, &[n]);
    let starts = Array::from_slice(&rows.starts, &[n]);
    STEP_POSITIONS.with(|p| *p.borrow_mut() = Some(positions.clone()));
    let mut last = rows.positions.iter().copied().max().unwrap_or(0);
    if crate::backend::cuda::kernel::recording() {
        use crate::backend::cuda::kernel::{mark, Role};
        mark(Role::Positions, &positions);
        mark(Role::Starts, &starts);
        // A replayed step reads RoPE rows up to the cache's last position.
        last = last.max(cache.buffers(0).0.dim(2) - 1);
    }
    let (cos, signed_sin) = rope.rows(c, last)?;
    let first = &blocks[0].input_norm;
    let table = stack.embed.filter(|t| {
        kernels::embeds(t, c.hidden_size)
            && tokens.ids.ndim() == 2
            && passes(&EMBED_CHECKED, dtype, || check_embed(k, dtype))
    });
    let (h, mut x) = match &table {
        Some(table) => k.embed_norm(tokens.ids, table, first.weight(), first.eps(), dtype)?,
        None => {
            let h = (tokens.embed)()?;
            let x = rms_norm(&h, Some(first.weight()), first.eps())?;
            (h, x)
        }
    };
    let counts = k.attend_counts(n, c.num_heads)?;
    let attend = |qkv: &Array, block: &Block, i: usize| -> Result<Array> {
        let (keys, values) = cache.buffers(i);
        k.qkv_attend(&QkvAttend {
            heads: QkvHeads {
                qkv,
                qk_norm: block.attn.qk_norms(),
                cos: &cos,
                signed_sin: &signed_sin,
                traditional: c.rope_traditional,
                keys,
                values,
                heads: c.num_heads,
                kv_heads: c.num_kv_heads,
            },
            positions: &positions,
            starts: &starts,
            counts: &counts,
        })
    };
    // The expert kernels are checked where a model has experts.
    let sparse = blocks.iter().any(|b| b.mlp.sparse().is_some());
    let experts = || !sparse || experts_checked(k, dtype);
    let weights = GEMV.then(|| products(blocks, dtype, experts)).flatten();
    if sparse && weights.is_none() {
        crate::backend::declined(EXPERTS_DECLINED);
    }
    if let Some(weights) = weights {
        let stack = Stack {
            head: stack.head.filter(|w| unpacks(w, dtype)),
            ..stack
        };
        return Ok(Some(with_our_products(
            k, &stack, &weights, &h, &x, &attend,
        )?));
    }
    let mut h = h;
    for (i, block) in blocks.iter().enumerate() {
        let attn = &block.attn;
        let qkv = attn.qkv.forward(&x, &[])?;
        let a = attend(&qkv, block, i)?;
        let o = attn.o.forward(&a, &[])?;
        let post = &block.post_norm;
        let (h1, x1) = k.add_norm(&h, &o, post.weight(), post.eps())?;
        let d = match block.mlp.dense() {
            Some(mlp) => {
                let act = k.swiglu(&mlp.gate_up.forward(&x1, &[])?)?;
                mlp.down.forward(&act, &[])?
            }
            None => block.mlp.forward(&x1, &[])?,
        };
        let next = blocks.get(i + 1).map_or(final_norm, |b| &b.input_norm);
        (h, x) = k.add_norm(&h1, &d, next.weight(), next.eps())?;
    }
    Ok(Some(Output::Normed(x)))
}

const EXPERTS_DECLINED: &str = "cuda_layers: routed experts (MoE) run MLX's ops in the step; \
     the expert kernels take quantized routers and experts of the product kernels' layouts, \
     once their check passed (see the notices)";

/// A layer's quantized weights as our product kernels take them.
struct Products<'a> {
    qkv: QuantWeight<'a>,
    qkv_bias: Option<&'a Array>,
    o: QuantWeight<'a>,
    mlp: MlpProducts<'a>,
}

enum MlpProducts<'a> {
    Dense {
        gate_up: QuantWeight<'a>,
        down: QuantWeight<'a>,
    },
    Experts(ExpertWeights<'a>),
}

/// The most experts a token takes that the router kernel takes.
const MOST_CHOICES: i32 = 32;

/// Whether the expert kernels take these experts for inputs in `dtype`:
/// stacks of one layout the product kernels unpack, and at most
/// [`MOST_CHOICES`] experts a token.
fn takes_experts(e: &ExpertWeights, dtype: Dtype) -> bool {
    let stacked = [&e.gate, &e.up, &e.down]
        .into_iter()
        .all(|w| w.w.ndim() == 3 && unpacks(w, dtype));
    let experts = e.gate.w.dim(0);
    stacked
        && unpacks(&e.router, dtype)
        && e.router.w.dim(0) == experts
        && (1..=MOST_CHOICES.min(experts)).contains(&e.top_k)
}

/// Whether our product kernels take every layer of `blocks` in `dtype`
/// and some layer's routed experts through the expert kernels (their
/// check aside): the shapes' side of [`products`], which runs no kernel.
#[cfg(test)]
pub(crate) fn takes_experts_of(blocks: &[Block], dtype: Dtype) -> bool {
    products(blocks, dtype, || true)
        .is_some_and(|w| w.iter().any(|p| matches!(p.mlp, MlpProducts::Experts(_))))
}

/// Whether the product kernels unpack this weight's layout (rows, or a stack of
/// them), for inputs in `dtype`.
fn unpacks(w: &QuantWeight, dtype: Dtype) -> bool {
    kernels::gemv_takes(w.bits, w.group_size, w.w.dim(-1) * 32 / w.bits, dtype)
}

/// Every layer's products, when all are quantized in a layout the kernels
/// unpack (and only q/k/v have a bias), and routed experts where
/// `experts()` (their kernels' check) passes.
fn products(
    blocks: &[Block],
    dtype: Dtype,
    experts: impl Fn() -> bool,
) -> Option<Vec<Products<'_>>> {
    blocks
        .iter()
        .map(|b| {
            let (qkv, qkv_bias) = b.attn.qkv.stacked_quantized()?;
            let (o, None) = b.attn.o.quantized()? else {
                return None;
            };
            let mlp = match (b.mlp.dense(), b.mlp.sparse()) {
                (Some(mlp), _) => {
                    let (gate_up, None) = mlp.gate_up.stacked_quantized()? else {
                        return None;
                    };
                    let (down, None) = mlp.down.quantized()? else {
                        return None;
                    };
                    if !(unpacks(&gate_up, dtype) && unpacks(&down, dtype)) {
                        return None;
                    }
                    MlpProducts::Dense { gate_up, down }
                }
                (None, Some(moe)) => {
                    let e = moe.quantized()?;
                    (takes_experts(&e, dtype) && experts()).then_some(MlpProducts::Experts(e))?
                }
                (None, None) => return None,
            };
            (unpacks(&qkv, dtype) && unpacks(&o, dtype)).then_some(Products {
                qkv,
                qkv_bias,
                o,
                mlp,
            })
        })
        .collect()
}

/// The layers with our product kernels: five nodes a layer, the residual
/// add and RMSNorm done by the product that reads them, SwiGLU by the
/// gate/up product, the final norm by the output head where it is given. `x`
/// is the first layer's normalized input.
fn with_our_products(
    k: &Kernels,
    stack: &Stack,
    weights: &[Products],
    h: &Array,
    x: &Array,
    attend: &dyn Fn(&Array, &Block, usize) -> Result<Array>,
) -> Result<Output> {
    let with_bias = |y: Array, bias: Option<&Array>| -> Result<Array> {
        Ok(match bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    };
    let one = |mut v: Vec<Array>| v.remove(0);
    let product = GemvOutput::Product;
    let mut qkv = with_bias(
        one(k.gemv(&GemvInput::Plain(x), product, &weights[0].qkv)?),
        weights[0].qkv_bias,
    )?;
    let mut h = h.clone();
    let blocks = stack.blocks;
    for (i, (block, w)) in blocks.iter().zip(weights).enumerate() {
        let a = attend(&qkv, block, i)?;
        let o = one(k.gemv(&GemvInput::Plain(&a), product, &w.o)?);
        let post = &block.post_norm;
        let norm_o = GemvInput::AddNorm {
            h: &h,
            r: &o,
            weight: post.weight(),
            eps: post.eps(),
        };
        let (h1, d) = match &w.mlp {
            MlpProducts::Dense { gate_up, down } => {
                let (h1, act) = pair(k.gemv(&norm_o, GemvOutput::Swiglu, gate_up)?);
                (h1, one(k.gemv(&GemvInput::Plain(&act), product, down)?))
            }
            MlpProducts::Experts(e) => {
                let (h1, x1) = k.add_norm(&h, &o, post.weight(), post.eps())?;
                let logits = one(k.gemv(&GemvInput::Plain(&x1), product, &e.router)?);
                let (ids, scores) = k.route(&logits, e.top_k, e.norm_topk_prob)?;
                let act = k.experts(&x1, &ids, &e.gate, Some(&e.up))?;
                let ys = k.experts(&act, &ids, &e.down, None)?;
                (h1, k.combine(&ys, &scores)?)
            }
        };
        match (blocks.get(i + 1), weights.get(i + 1)) {
            (Some(next), Some(nw)) => {
                let norm_d = GemvInput::AddNorm {
                    h: &h1,
                    r: &d,
                    weight: next.input_norm.weight(),
                    eps: next.input_norm.eps(),
                };
                let (h2, y) = pair(k.gemv(&norm_d, product, &nw.qkv)?);
                qkv = with_bias(y, nw.qkv_bias)?;
                h = h2;
            }
            _ => {
                let (weight, eps) = (stack.final_norm.weight(), stack.final_norm.eps());
                return Ok(match &stack.head {
                    Some(head) => {
                        let norm_d = GemvInput::AddNorm {
                            h: &h1,
                            r: &d,
                            weight,
                            eps,
                        };
                        Output::Logits(pair(k.gemv(&norm_d, product, head)?).1)
                    }
                    None => Output::Normed(k.add_norm(&h1, &d, weight, eps)?.1),
                });
            }
        }
    }
    Err(Error::invalid("a model without layers"))
}

pub(super) fn close(what: &str, dtype: Dtype, got: &Array, want: &Array) -> Result<()> {
    let tolerance = if dtype == Dtype::Float32 { 1e-4 } else { 5e-2 };
    within(&format!("{what} kernel ({dtype:?})"), got, want, tolerance)
}

/// Each kernel against MLX's ops on small random cases (odd sizes,
/// several rows, rows at different positions) in `dtype`.
fn check(k: &Kernels, dtype: Dtype) -> Result<()> {
    check_rows(k, dtype, [3, 1], 1, "")?;

    let x = argmax_case(18, dtype)?;
    let (got, want) = (
        k.argmax(&x, None)?,
        mlx_rs::ops::indexing::argmax_axis(&x, -1, false)?,
    );
    let what = format!("argmax kernel ({dtype:?})");
    if got.shape() != want.shape() {
        return Err(Error::Mlx(format!("the {what} gives another shape")));
    }
    // Token ids (far below 2^24) are exact in float32: every one the same.
    within(&what, &got, &want, 0.0)?;

    check_qkv_attend(k, dtype)?;
    if *GEMV {
        check_gemv(k, dtype)?;
    }
    Ok(())
}

/// Row `r`'s allowed tokens in the masked kernels' checks, over `v`: every
/// third id (a spread of allowed words and chunks), one id in the tail
/// past the last whole chunk, a run of ids that crosses mask words, and
/// none (the argmax then gives 0).
pub(crate) fn check_mask(rows: usize, v: usize) -> (Vec<bool>, Vec<u32>) {
    let words = v.div_ceil(32);
    let mut allowed = vec![false; rows * v];
    for (r, row) in allowed.chunks_mut(v).enumerate() {
        match r % 4 {
            0 => row.iter_mut().step_by(3).for_each(|a| *a = true),
            1 => row[v - 1] = true,
            2 => row[40..100].iter_mut().for_each(|a| *a = true),
            _ => {}
        }
    }
    let mut bits = vec![0u32; rows * words];
    for (i, _) in allowed.iter().enumerate().filter(|(_, a)| **a) {
        let (r, id) = (i / v, i % v);
        bits[r * words + id / 32] |= 1 << (id % 32);
    }
    (allowed, bits)
}

/// The argmax checks' logits `[4, 1, V]` from `seed`: many ties (values on
/// a grid of quarters), rows not 16-byte aligned and a width that leaves a
/// tail.
fn argmax_case(seed: u64, dtype: Dtype) -> Result<Array> {
    let quarters = Array::from_f32(4.0);
    Ok(normal(&[4, 1, 32777], seed, Dtype::Float32)?
        .multiply(&quarters)?
        .round(None)?
        .divide(&quarters)?
        .as_dtype(dtype)?)
}

/// The masked argmax against MLX's argmax of the logits with every token
/// the mask leaves out at -inf, on [`argmax_case`]'s logits.
fn check_masked_argmax(k: &Kernels, dtype: Dtype) -> Result<()> {
    let x = &argmax_case(19, dtype)?;
    let (rows, v) = (x.dim(0), x.dim(-1));
    let (allowed, bits) = check_mask(rows as usize, v as usize);
    let mask = Array::from_slice(&bits, &[rows, (v + 31) / 32]);
    let keep = Array::from_slice(&allowed, &[rows, 1, v]);
    let neg_inf = Array::from_f32(f32::NEG_INFINITY).as_dtype(x.dtype())?;
    let kept = mlx_rs::ops::select(&keep, x, &neg_inf)?;
    let want = mlx_rs::ops::indexing::argmax_axis(&kept, -1, false)?;
    // A row the mask allows nothing: 0.
    let none = Array::from_slice(
        &(0..rows).map(|r| r % 4 == 3).collect::<Vec<_>>(),
        &[rows, 1],
    );
    let want = mlx_rs::ops::select(&none, Array::from_int(0), &want)?;
    let got = k.argmax(x, Some(&mask))?;
    within(
        &format!("masked argmax kernel ({:?})", x.dtype()),
        &got,
        &want,
        0.0,
    )
}

/// The residual add + RMSNorm and SwiGLU kernels against MLX's ops over
/// rows `[lead[0], lead[1], D]` (odd widths), drawn from seeds `seed..seed
/// + 4`; `what` names the use in a failure.
pub(super) fn check_rows(
    k: &Kernels,
    dtype: Dtype,
    lead: [i32; 2],
    seed: u64,
    what: &str,
) -> Result<()> {
    let ([b, l], d, eps) = (lead, 1000, 1e-6);
    let (h, r) = (
        normal(&[b, l, d], seed, dtype)?,
        normal(&[b, l, d], seed + 1, dtype)?,
    );
    let w = normal(&[d], seed + 2, dtype)?;
    let (sum, normed) = k.add_norm(&h, &r, &w, eps)?;
    let want_sum = h.add(&r)?;
    close(&format!("{what}add"), dtype, &sum, &want_sum)?;
    let want_normed = rms_norm(&want_sum, Some(&w), eps)?;
    close(&format!("{what}RMSNorm"), dtype, &normed, &want_normed)?;
    let gu = normal(&[b, l, 2 * 300], seed + 3, dtype)?;
    let want = swiglu_of_halves(&gu)?;
    close(&format!("{what}SwiGLU"), dtype, &k.swiglu(&gu)?, &want)
}

/// `silu(gate) * up` of `y`'s halves `[.., .., gate | up]`, as MLX's ops
/// compute it.
fn swiglu_of_halves(y: &Array) -> Result<Array> {
    let half = y.dim(-1) / 2;
    let (g, u) = (y.index((.., .., ..half)), y.index((.., .., half..)));
    swiglu_of(&g, &u)
}

/// `silu(g) * u` as MLX's ops compute it.
fn swiglu_of(g: &Array, u: &Array) -> Result<Array> {
    Ok(g.multiply(mlx_rs::ops::sigmoid(g)?)?.multiply(u)?)
}

/// The embedding kernel against MLX's `take`, `dequantize` and `rms_norm`
/// (as [`crate::nn::layers::Embedding`] and the first layer's norm compute
/// them): 4- and 8-bit tables, ids of two integer types including the
/// table's first and last rows.
fn check_embed(k: &Kernels, dtype: Dtype) -> Result<()> {
    let (vocab, d, eps) = (1000, 256, 1e-6);
    let key = mlx_rs::random::key(21)?;
    let table = mlx_rs::random::normal::<f32>(&[vocab, d], None, None, &key)?;
    let key = mlx_rs::random::key(22)?;
    let nw = mlx_rs::random::normal::<f32>(&[d], None, None, &key)?.as_dtype(dtype)?;
    let at = [0, vocab - 1, 517];
    for (bits, gs) in [(4, 64), (8, 32)] {
        let (w, scales, biases) = mlx_rs::ops::quantize(&table, gs, bits)?;
        let wt = QuantWeight {
            w: &w,
            scales: &scales,
            biases: &biases,
            bits,
            group_size: gs,
        };
        for ids in [
            Array::from_slice(&at.map(|i| i as u32), &[3, 1]),
            Array::from_slice(&at, &[3, 1]),
        ] {
            let want = mlx_rs::ops::dequantize(
                w.take_axis(&ids, 0)?,
                scales.take_axis(&ids, 0)?.as_dtype(dtype)?,
                &biases.take_axis(&ids, 0)?.as_dtype(dtype)?,
                gs,
                bits,
            )?
            .as_dtype(dtype)?;
            let (h, normed) = k.embed_norm(&ids, &wt, &nw, eps, dtype)?;
            let what = format!("{bits}-bit embedding");
            if h.shape() != want.shape() {
                return Err(Error::Mlx(format!("the {what} kernel gives another shape")));
            }
            // Exactly MLX's: the same single rounding of each value.
            within(&format!("{what} kernel ({dtype:?})"), &h, &want, 0.0)?;
            close(
                &format!("{what} RMSNorm"),
                dtype,
                &normed,
                &rms_norm(&want, Some(&nw), eps)?,
            )?;
        }
    }
    Ok(())
}

/// Whether the expert kernels passed their check in `dtype` (run on first
/// ask).
fn experts_checked(k: &Kernels, dtype: Dtype) -> bool {
    passes(&EXPERTS_CHECKED, dtype, || check_experts(k, dtype))
}

/// The router, expert product and combine kernels against MLX's ops as
/// [`crate::nn::moe::SparseMoe`] computes them (precise softmax, the top
/// choices, each expert's product, a weighted sum): 4 tokens, 4 of 10
/// experts each, with and without normalized weights, on logits whose top
/// choices are clear (in bfloat16 too) but for the last token's, five of
/// which tie; products of rows read 16 bytes at a time (256) and a value at
/// a time (320).
fn check_experts(k: &Kernels, dtype: Dtype) -> Result<()> {
    let (rows, experts, choices, d, inner, gs, bits) = (4, 10, 4, 256, 320, 64, 4);
    let values: Vec<f32> = (0..rows * experts)
        .map(|i| match i / experts {
            3 if i % experts < 5 => 1.0,
            3 => -1.0,
            _ => (((i % experts) * 7 + (i / experts) * 3) % experts) as f32 * 0.5 - 2.0,
        })
        .collect();
    let logits = Array::from_slice(&values, &[rows, 1, experts]).as_dtype(dtype)?;
    // Each row's experts as `argpartition` picks them on a GPU: the last
    // `choices` of a stable ascending sort (ties to the higher expert).
    let want_ids: Vec<i32> = (0..rows as usize)
        .flat_map(|r| {
            let row = &values[r * experts as usize..(r + 1) * experts as usize];
            let mut order: Vec<i32> = (0..experts).collect();
            order.sort_by(|a, b| row[*a as usize].total_cmp(&row[*b as usize]));
            order.split_off((experts - choices) as usize)
        })
        .collect();
    let want_ids = Array::from_slice(&want_ids, &[rows, choices]);
    let probs = mlx_rs::ops::softmax_axis(&logits.reshape(&[rows, experts])?, -1, true)?;
    let mut ids_scores = None;
    for norm in [false, true] {
        let (ids, scores) = k.route(&logits, choices, norm)?;
        within("router kernel's choices", &ids, &want_ids, 0.0)?;
        let mut want = mlx_rs::ops::indexing::take_along_axis(&probs, &want_ids, -1)?;
        if norm {
            want = want.divide(want.sum_axis(-1, true)?)?;
        }
        close("router weights", dtype, &scores, &want)?;
        ids_scores = Some((ids, scores));
    }
    let (ids, scores) = ids_scores.expect("routed");
    // Each pair's row: pair p is row p / choices's.
    let floor_rows = Array::from_slice(
        &(0..rows * choices)
            .map(|p| p / choices)
            .collect::<Vec<i32>>(),
        &[rows * choices],
    );
    let stack = |out: i32, inp: i32, seed: u64| -> Result<(Array, Array, Array)> {
        let w = normal(&[experts, out, inp], seed, Dtype::Float32)?;
        let (w, scales, biases) = mlx_rs::ops::quantize(&w, gs, bits)?;
        Ok((w, scales.as_dtype(dtype)?, biases.as_dtype(dtype)?))
    };
    fn quant((w, scales, biases): &(Array, Array, Array), bits: i32, gs: i32) -> QuantWeight<'_> {
        QuantWeight {
            w,
            scales,
            biases,
            bits,
            group_size: gs,
        }
    }
    let (gate, up, down) = (
        stack(inner, d, 31)?,
        stack(inner, d, 32)?,
        stack(d, inner, 33)?,
    );
    // Each (row, choice) pair's row of `x` (`[rows or rows * choices, 1,
    // in]`) through its expert's dequantized weight (as MLX's quantized
    // products sum the same weight values), `[rows * choices, 1, out]`.
    let flat = ids.reshape(&[rows * choices])?;
    let gathered = |x: &Array, (w, scales, biases): &(Array, Array, Array)| -> Result<Array> {
        let dense = mlx_rs::ops::dequantize(w, scales, biases, gs, bits)?.take_axis(&flat, 0)?;
        let x = match x.dim(0) {
            n if n == rows => x.take_axis(&floor_rows, 0)?,
            _ => x.clone(),
        };
        Ok(x.matmul(&mlx_rs::ops::swap_axes(&dense, -1, -2)?)?)
    };
    let bound = if dtype == Dtype::Float32 { 1e-4 } else { 2e-2 };
    let x = normal(&[rows, 1, d], 34, dtype)?;
    let (g, u) = (gathered(&x, &gate)?, gathered(&x, &up)?);
    let act = swiglu_of(&g, &u)?;
    let got = k.experts(
        &x,
        &ids,
        &quant(&gate, bits, gs),
        Some(&quant(&up, bits, gs)),
    )?;
    close_relative("experts' SwiGLU product", &got, &act, bound)?;
    let ys = gathered(&act, &down)?;
    let got = k.experts(&act, &ids, &quant(&down, bits, gs), None)?;
    close_relative("experts' product", &got, &ys, bound)?;
    let weighted = ys
        .reshape(&[rows, choices, d])?
        .multiply(mlx_rs::ops::expand_dims_axes(&scores, &[-1])?)?;
    let want = weighted.sum_axis(-2, false)?.as_dtype(dtype)?;
    // Relative: the sums are in the thousands, where a bfloat16 step is 32.
    close_relative(
        "experts' weighted sum",
        &k.combine(&ys, &scores)?.reshape(&[rows, d])?,
        &want,
        bound,
    )
}

/// `max |got - want| / max |want|`, within `bound`.
fn close_relative(what: &str, got: &Array, want: &Array, bound: f32) -> Result<()> {
    let scale = want.as_dtype(Dtype::Float32)?.abs()?.max(None)?;
    scale.eval()?;
    let worst = max_diff(got, want)? / scale.as_slice::<f32>()[0].max(f32::MIN_POSITIVE);
    if worst.is_nan() || worst > bound {
        return Err(Error::Mlx(format!(
            "the {what} kernel differs from MLX's ops by {worst} (relative)"
        )));
    }
    Ok(())
}

/// The product kernels against MLX's `quantized_matmul` of the same inputs
/// (4- and 8-bit weights), and their SwiGLU outputs against MLX's ops on
/// its product.
fn check_gemv(k: &Kernels, dtype: Dtype) -> Result<()> {
    let eps = 1e-6;
    let bound = if dtype == Dtype::Float32 { 1e-4 } else { 2e-2 };
    // One row (the default path's grid), six (one tile) and nine (two
    // tiles, the second part full); widths with two outputs a warp and
    // an output head's (four a warp), the last block part full; inputs
    // read 16 bytes at a time (rows of 256) and a value at a time (320);
    // rows of 4,608 (4- and 8-bit) taken in windows, the last one part
    // full; products split along the row (one input row, a wide 4-bit
    // weight) with threads past the row's end and a last trip part full.
    let cases: [(i32, i32, i32, i32, &[i32]); 8] = [
        (72, 256, 4, 64, &[1, 6, 9]),
        (72, 256, 8, 32, &[1, 6, 9]),
        (72, 320, 4, 64, &[1, 6, 9]),
        (72, 4608, 4, 64, &[1, 6]),
        (72, 2304, 8, 32, &[1]),
        (8200, 256, 4, 64, &[1]),
        (32776, 256, 4, 64, &[1, 6]),
        (2058, 4608, 4, 64, &[1]),
    ];
    for (n, kd, bits, gs, rows_list) in cases {
        let (w, scales, biases) =
            mlx_rs::ops::quantize(&normal(&[n, kd], 12, Dtype::Float32)?, gs, bits)?;
        let (scales, biases) = (scales.as_dtype(dtype)?, biases.as_dtype(dtype)?);
        let wt = QuantWeight {
            w: &w,
            scales: &scales,
            biases: &biases,
            bits,
            group_size: gs,
        };
        let mlx = |x: &Array| -> Result<Array> {
            Ok(mlx_rs::ops::quantized_matmul(
                x, &w, &scales, &biases, true, gs, bits,
            )?)
        };
        for &rows in rows_list {
            let x = normal(&[rows, 1, kd], 13, dtype)?;
            let (h, r) = (
                normal(&[rows, 1, kd], 15, dtype)?,
                normal(&[rows, 1, kd], 16, dtype)?,
            );
            let nw = normal(&[kd], 17, dtype)?;
            let sum = h.add(&r)?;
            let normed = rms_norm(&sum, Some(&nw), eps)?;
            for (output, name) in [
                (GemvOutput::Product, "product"),
                (GemvOutput::Swiglu, "SwiGLU product"),
            ] {
                let want = |x: &Array| -> Result<Array> {
                    match output {
                        GemvOutput::Product => mlx(x),
                        GemvOutput::Swiglu => swiglu_of_halves(&mlx(x)?),
                    }
                };
                let what = format!("{bits}-bit {name} ({rows} rows, {dtype:?})");
                let got = k.gemv(&GemvInput::Plain(&x), output, &wt)?;
                close_relative(&what, &got[0], &want(&x)?, bound)?;

                let input = GemvInput::AddNorm {
                    h: &h,
                    r: &r,
                    weight: &nw,
                    eps,
                };
                let got = k.gemv(&input, output, &wt)?;
                close("add", dtype, &got[0], &sum)?;
                close_relative(&format!("RMSNorm {what}"), &got[1], &want(&normed)?, bound)?;
            }
        }
    }
    Ok(())
}

/// Random inputs for a check of the q/k kernels: a q/k/v product `[rows,
/// L, (heads + 2 * kv_heads) * head_dim]`, norm weights, tables of
/// `capacity` positions and a cache `[cache_rows, kv_heads, capacity,
/// head_dim]`, with a copy of the cache in buffers of its own (the kernels
/// overwrite it).
pub(super) struct HeadsCase {
    pub(super) heads: i32,
    pub(super) kv_heads: i32,
    pub(super) head_dim: i32,
    pub(super) qkv: Array,
    pub(super) q_norm: Array,
    pub(super) k_norm: Array,
    pub(super) cos: Array,
    pub(super) sin: Array,
    pub(super) keys: Array,
    pub(super) values: Array,
    pub(super) keys_before: Array,
    pub(super) values_before: Array,
    pub(super) eps: f32,
}

impl HeadsCase {
    pub(super) const HEADS: i32 = 4;
    pub(super) const KV_HEADS: i32 = 2;
    pub(super) const HEAD_DIM: i32 = 64;

    /// `[heads, kv_heads, head_dim]` heads, drawn from seeds `seed..seed + 7`.
    pub(super) fn new(
        [nq, nkv, hd]: [i32; 3],
        rows: i32,
        l: i32,
        cache_rows: i32,
        cap: i32,
        seed: u64,
        dtype: Dtype,
    ) -> Result<Self> {
        let shape = [cache_rows, nkv, cap, hd];
        let (keys, values) = (
            normal(&shape, seed + 5, dtype)?,
            normal(&shape, seed + 6, dtype)?,
        );
        let zero = Array::from_f32(0.0).as_dtype(dtype)?;
        let (keys_before, values_before) = (keys.add(&zero)?, values.add(&zero)?);
        mlx_rs::transforms::eval([&keys, &values, &keys_before, &values_before])?;
        Ok(HeadsCase {
            heads: nq,
            kv_heads: nkv,
            head_dim: hd,
            qkv: normal(&[rows, l, (nq + 2 * nkv) * hd], seed, dtype)?,
            q_norm: normal(&[hd], seed + 1, dtype)?,
            k_norm: normal(&[hd], seed + 2, dtype)?,
            cos: normal(&[cap, hd], seed + 3, Dtype::Float32)?,
            sin: normal(&[cap, hd], seed + 4, Dtype::Float32)?,
            keys,
            values,
            keys_before,
            values_before,
            eps: 1e-6,
        })
    }

    pub(super) fn heads(&self) -> QkvHeads<'_> {
        QkvHeads {
            qkv: &self.qkv,
            qk_norm: Some((&self.q_norm, &self.k_norm, self.eps)),
            cos: &self.cos,
            signed_sin: &self.sin,
            traditional: false,
            keys: &self.keys,
            values: &self.values,
            heads: self.heads,
            kv_heads: self.kv_heads,
        }
    }
}

/// Seeded standard normal values in `dtype`, for the kernels' checks.
fn normal(shape: &[i32], seed: u64, dtype: Dtype) -> Result<Array> {
    let key = mlx_rs::random::key(seed)?;
    Ok(mlx_rs::random::normal::<f32>(shape, None, None, &key)?.as_dtype(dtype)?)
}

/// Two rows at different positions over a cache with a spare row (as the
/// scheduler's slots have), the second attending from key 3 and long
/// enough for its keys to be split over blocks: the output against MLX's
/// norm, rotation and attention over the same keys, and the cache against
/// the old one with the new keys and values put in. With 2, 4, 6 and 7
/// query heads a key head and heads of 32, 128 and 64 values: blocks of 2
/// and 4 query heads (Qwen3's), of 3 (two blocks a key head) and of 1
/// (seven blocks; Qwen2.5-0.5B's heads).
fn check_qkv_attend(k: &Kernels, dtype: Dtype) -> Result<()> {
    for heads in [[4, 2, 32], [8, 2, 128], [12, 2, 128], [14, 2, 64]] {
        check_qkv_attend_heads(k, dtype, heads)?;
    }
    Ok(())
}

fn check_qkv_attend_heads(k: &Kernels, dtype: Dtype, heads: [i32; 3]) -> Result<()> {
    let case = HeadsCase::new(heads, 2, 1, 3, 400, 5, dtype)?;
    let (rows, nq, nkv, hd) = (2, case.heads, case.kv_heads, case.head_dim);
    let (qkv, cos, sin, eps) = (&case.qkv, &case.cos, &case.sin, case.eps);
    let (qw, kw) = (&case.q_norm, &case.k_norm);
    let (keys, values) = (&case.keys, &case.values);
    let (keys_before, values_before) = (&case.keys_before, &case.values_before);
    let (at, from) = ([5, 390], [0, 3]);
    let (positions, starts) = (
        Array::from_slice(&at, &[rows]),
        Array::from_slice(&from, &[rows]),
    );
    let out = k.qkv_attend(&QkvAttend {
        heads: case.heads(),
        positions: &positions,
        starts: &starts,
        counts: &k.attend_counts(rows, nq)?,
    })?;
    out.eval()?;
    let heads = qkv.reshape(&[rows, nq + 2 * nkv, hd])?;
    let half = hd / 2;
    let rotate = |y: &Array| -> Result<Array> {
        let swapped =
            mlx_rs::ops::concatenate(&[y.index((.., .., half..)), y.index((.., .., ..half))], -1)?;
        let f = |a: &Array| a.as_dtype(Dtype::Float32);
        let at = |t: &Array| -> Result<Array> {
            Ok(t.take_axis(&positions, 0)?.reshape(&[rows, 1, hd])?)
        };
        Ok(f(y)?
            .multiply(at(cos)?)?
            .add(&f(&swapped)?.multiply(at(sin)?)?)?
            .as_dtype(dtype)?)
    };
    let q = rotate(&rms_norm(heads.index((.., ..nq, ..)), Some(qw), eps)?)?;
    let new_k = rotate(&rms_norm(
        heads.index((.., nq..nq + nkv, ..)),
        Some(kw),
        eps,
    )?)?;
    let new_v = heads.index((.., nq + nkv.., ..));
    for (row, (pos, start)) in at.into_iter().zip(from).enumerate() {
        let r = row as i32;
        let (kr, vr) = (
            new_k.index((r..r + 1, .., ..)),
            new_v.index((r..r + 1, .., ..)),
        );
        let (kr, vr) = (kr.reshape(&[1, nkv, 1, hd])?, vr.reshape(&[1, nkv, 1, hd])?);
        let old = |a: &Array| a.index((r..r + 1, .., start..pos, ..));
        let all_k = mlx_rs::ops::concatenate(&[old(keys_before), kr.clone()], 2)?;
        let all_v = mlx_rs::ops::concatenate(&[old(values_before), vr.clone()], 2)?;
        let qr = q.index((r..r + 1, .., ..)).reshape(&[1, nq, 1, hd])?;
        let scale = (hd as f32).powf(-0.5);
        let want =
            mlx_rs::fast::scaled_dot_product_attention(&qr, &all_k, &all_v, scale, None, None)?;
        let got = out.index((r..r + 1, .., ..)).reshape(&[1, nq, 1, hd])?;
        close("attention", dtype, &got, &want)?;
        close(
            "key write",
            dtype,
            &keys.index((r..r + 1, .., pos..pos + 1, ..)),
            &kr,
        )?;
        close(
            "value write",
            dtype,
            &values.index((r..r + 1, .., pos..pos + 1, ..)),
            &vr,
        )?;
    }
    // Nothing else was written.
    let changed = keys
        .ne(keys_before)?
        .sum(None)?
        .add(values.ne(values_before)?.sum(None)?)?
        .as_dtype(Dtype::Float32)?;
    changed.eval()?;
    if changed.as_slice::<f32>()[0] > 2.0 * (rows * nkv * hd) as f32 {
        return Err(Error::Mlx(
            "the attention kernel wrote outside its rows' positions".into(),
        ));
    }
    Ok(())
}
