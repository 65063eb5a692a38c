//! A checkpoint on disk: its `config.json` and its safetensors weights.

pub mod config;
pub mod weights;
