//! Rustler glue between `EMLXAxon.Native` and the engine crate.
//!
//! Every NIF returns `{:ok, value}` or `{:error, {kind, message}}`; panics
//! are caught here and returned as `{:error, {:panic, message}}` so that
//! nothing unwinds into the VM. Long work runs on dirty schedulers.

mod error;
mod generation;
mod memory;
mod model;
mod stream;
mod tokenizer;

rustler::init!("Elixir.EMLXAxon.Native");
