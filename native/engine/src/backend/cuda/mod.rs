//! The CUDA backend: kernels of our own compiled at run time and launched
//! inside MLX's graph ([`kernel`]), the one-token layers built from them
//! ([`layer`], sources in `kernels` and `cu/`), the prompt kernels
//! ([`prefill`]), and one-token steps replayed as one CUDA graph
//! ([`replay`]). Each is checked against MLX's ops on first use; where a
//! check fails, MLX's ops run and a notice says why.

pub mod kernel;
mod kernels;
pub mod layer;
pub mod prefill;
pub mod replay;
