//! Prefill and decode for one prompt or a batch of prompts decoded together.
//!
//! Rows are left-padded to a common length and masked, so every row attends
//! only to its own tokens; RoPE depends on relative positions, so padding does
//! not change a row's result. Decoding is chunked (`Generation::next`) so a
//! caller can stream, cancel or time out between chunks. With a device
//! sampler each step's graph is queued before the previous token is read
//! back (`async_eval`), as mlx-lm does, so the host never stalls the device.
//!
//! - `options`: what a generation is asked for, its checks and its cache size;
//! - `generation`: the prefill and decode loop;
//! - `constrained`: grammar-constrained rows (masks, forced tokens);
//! - `rows`: one row's tokens, text, stop strings and finish reason.

mod constrained;
mod generation;
mod options;
pub(crate) mod rows;

use std::sync::Arc;

use crate::error::Result;
use crate::model::Model;
use crate::text::tokenizer::Tokenizer;

pub use generation::Generation;
pub use options::{check_kv_dtype, GenerateOptions, RowOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Eos,
    /// A stop string matched, or a constrained output is complete.
    Stop,
    /// `max_new_tokens` reached.
    Length,
    MaxLen,
    /// Ended by the caller (see [`Generation::cancel_row`]).
    Cancelled,
}

impl FinishReason {
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::MaxLen => "max_len",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// What one `next` call produced for a row.
#[derive(Debug, Clone, Default)]
pub struct RowDelta {
    pub ids: Vec<u32>,
    pub text: String,
    pub finish: Option<FinishReason>,
}

#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub prompt_tokens: Vec<usize>,
    pub generated_tokens: Vec<usize>,
    /// Of each row's generated tokens, those its grammar forced and that
    /// were taken without sampling (fast-forward).
    pub forced_tokens: Vec<usize>,
    /// Forward passes through the model, prefill chunks included.
    pub forward_passes: usize,
    /// From the call to the prefill's start: checks, the KV cache, streams.
    pub setup_ms: f64,
    /// Building the prefill's graph on the host: its chunks' evaluations
    /// between them included, and sampling the first token (which with a
    /// host sampler or a constraint waits for the logits).
    pub prefill_graph_ms: f64,
    pub prefill_ms: f64,
    pub time_to_first_token_ms: f64,
    pub decode_ms: f64,
    /// Tokens of the longest row after its first step's, per second.
    pub decode_tokens_per_s: f64,
    /// Host time spent on constrained rows' masks and forced tokens, in total.
    pub constraint_ms: f64,
    /// Which paths ran the forward passes (and replayed steps), and why
    /// faster ones declined.
    pub paths: crate::backend::Paths,
    /// The dtype the KV cache was made in (before any `kv_bits`
    /// quantization): `kv_dtype`, or its default.
    pub kv_dtype: Option<mlx_rs::Dtype>,
}

/// Result of a whole single-prompt generation.
#[derive(Debug, Clone)]
pub struct Output {
    pub ids: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    pub stats: Stats,
}

/// Generates for one prompt until it finishes.
pub fn generate(
    model: Arc<Model>,
    tokenizer: Option<Arc<Tokenizer>>,
    prompt: &[u32],
    options: GenerateOptions,
) -> Result<Output> {
    let mut generation = Generation::start(model, tokenizer, None, &[prompt.to_vec()], options)?;
    let mut text = String::new();
    let mut finish = None;
    while !generation.is_done() {
        let delta = generation.next(16)?.remove(0);
        text.push_str(&delta.text);
        finish = delta.finish.or(finish);
    }
    Ok(Output {
        ids: generation.generated().remove(0),
        text,
        finish: finish.unwrap_or(FinishReason::Length),
        stats: generation.stats(),
    })
}
