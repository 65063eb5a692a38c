//! Qwen-family text generation on MLX.
//!
//! A plain Rust library: load a checkpoint ([`Model::load`]), a tokenizer
//! ([`Tokenizer::load`]) and generate ([`Generation`], [`generate`]). The
//! Elixir NIF is a thin wrapper over this crate.

mod attention;
pub mod cache;
pub mod config;
pub mod constraint;
mod cuda_kernel;
pub mod decode_attention;
mod decode_layer;
pub mod decode_step;
pub mod device;
pub mod error;
pub mod generate;
pub mod gpu_layer;
pub mod layers;
pub mod memory;
pub mod model;
mod rope;
pub mod sampler;
pub mod scheduler;
mod step_replay;
mod switch;
pub mod tokenizer;
pub mod weights;

pub use config::{Arch, ModelConfig, QuantSpec};
pub use constraint::ConstraintSpec;
pub use error::{Error, Result};
pub use generate::{
    generate, FinishReason, GenerateOptions, Generation, Output, RowDelta, RowOptions, Stats,
};
pub use mlx_rs::Dtype;
pub use model::{LoadOptions, Model};
pub use sampler::{SamplerConfig, SamplerKind};
pub use scheduler::{Event, RequestId, RequestStats, Scheduler, SchedulerConfig};
pub use tokenizer::{Detokenizer, Tokenizer};
