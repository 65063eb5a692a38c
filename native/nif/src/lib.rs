//! Rustler glue between `EMLXAxon.Native` and the engine crate.
//!
//! Every NIF returns `{:ok, value}` or `{:error, {kind, message}}`; panics
//! are caught here and returned as `{:error, {:panic, message}}` so that
//! nothing unwinds into the VM. Every NIF that touches MLX or can block
//! runs on a dirty scheduler; those that evaluate MLX graphs do so on a
//! thread with a large stack (`device::on_large_stack`).

mod constraint;
mod error;
mod generation;
mod memory;
mod model;
mod scheduler;
mod slot;
mod stream;
mod tokenizer;

/// Prepares MLX before any NIF can make an MLX call: its error handler, so
/// that a failing call returns an error instead of exiting the VM, and its
/// CUDA command-graph size (`device::prepare_mlx`).
fn load(_env: rustler::Env, _info: rustler::Term) -> bool {
    emlx_axon_engine::runtime::device::prepare_mlx();
    true
}

rustler::init!("Elixir.EMLXAxon.Native", load = load);
