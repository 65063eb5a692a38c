//! Qwen-family text generation on MLX.
//!
//! A plain Rust library: load a checkpoint ([`Model::load`]), a tokenizer
//! ([`Tokenizer::load`]) and generate ([`Generation`], [`generate`]). The
//! Elixir NIF is a thin wrapper over this crate.
//!
//! Modules, each depending only on those listed before it:
//!
//! | module | holds |
//! |---|---|
//! | [`error`], [`switches`] | the error type; every environment switch, read once |
//! | [`runtime`] | MLX streams and leases, memory, the device questions |
//! | [`checkpoint`] | `config.json`, safetensors, the quantization spec |
//! | [`text`] | the tokenizer, the chat template, structured-output constraints |
//! | [`kv`] | the KV cache contract, batch caches, the scheduler's slot cache, the prefix cache |
//! | [`nn`] | backend-neutral layers: linear, norms, RoPE with its offsets and scalings, attention, routed experts |
//! | [`backend`] | each backend's fused one-token and prompt layers, their checks, and which path runs |
//! | [`model`] | the Qwen2/Qwen3/Qwen3-MoE model: weights and the forward pass |
//! | [`sample`] | token choice from logits |
//! | [`exec`] | requests to tokens: checks, `Generation`, the scheduler |

pub mod backend;
pub mod checkpoint;
pub mod error;
pub mod exec;
pub mod kv;
pub mod model;
pub mod nn;
pub mod runtime;
pub mod sample;
pub mod switches;
pub mod text;

pub use backend::Paths;
pub use checkpoint::config::{Arch, ModelConfig, QuantSpec};
pub use error::{Error, Result};
pub use exec::generate::{
    generate, FinishReason, GenerateOptions, Generation, Output, RowDelta, RowOptions, Stats,
};
pub use exec::scheduler::{Event, RequestId, RequestStats, Scheduler, SchedulerConfig};
pub use mlx_rs::Dtype;
pub use model::{LoadOptions, Model};
pub use sample::{SamplerConfig, SamplerKind};
pub use text::constraint::ConstraintSpec;
pub use text::tokenizer::{Detokenizer, Tokenizer};
