//! Model families: Qwen3 and Qwen2 (dense), Qwen3-MoE.

mod qwen;

pub use crate::nn::attention::AttentionMask;
pub use qwen::{default_dtype, LoadOptions, Model};
