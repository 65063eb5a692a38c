//! The one place engine errors become Elixir terms.

use std::panic::{catch_unwind, AssertUnwindSafe};

use rustler::{Atom, Encoder, Env, Term};

pub struct NifError {
    kind: &'static str,
    message: String,
}

pub type NifResult<T> = Result<T, NifError>;

impl NifError {
    pub fn new(kind: &'static str, message: impl Into<String>) -> Self {
        NifError {
            kind,
            message: message.into(),
        }
    }
}

impl From<emlx_axon_engine::Error> for NifError {
    fn from(e: emlx_axon_engine::Error) -> Self {
        NifError::new(e.kind(), e.to_string())
    }
}

impl Encoder for NifError {
    fn encode<'a>(&self, env: Env<'a>) -> Term<'a> {
        let kind = Atom::from_str(env, self.kind).expect("error kinds are valid atoms");
        (kind, self.message.as_str()).encode(env)
    }
}

/// Runs `f`, turning a panic into an error value instead of unwinding.
pub fn guard<T>(f: impl FnOnce() -> NifResult<T>) -> NifResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        Err(NifError::new(
            "panic",
            emlx_axon_engine::error::panic_message(&*panic),
        ))
    })
}
