//! The engine's one error type; the NIF maps `Error::kind` to Elixir atoms.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: invalid JSON: {message}", path.display())]
    Json { path: PathBuf, message: String },
    #[error("config.json: {0}")]
    Config(String),
    #[error("{}: {message}", path.display())]
    Safetensors { path: PathBuf, message: String },
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    /// Tensors the model has no place for, as mlx-lm's strict load refuses.
    #[error("the checkpoint has {} tensor(s) the model does not use: {} (load with strict: false to ignore them)", .0.len(), .0.join(", "))]
    UnexpectedTensors(Vec<String>),
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<i64>,
        got: Vec<i64>,
    },
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("MLX: {0}")]
    Mlx(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("{0}")]
    InvalidArgument(String),
    /// The work cannot fit in MLX's memory limit.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// A JSON Schema, regex or grammar the grammar engine refuses.
    #[error("{0}")]
    InvalidConstraint(String),
    /// The grammar engine failed while constraining a row's output.
    #[error("constraint: {0}")]
    Constraint(String),
    /// A panic caught on an engine thread (a bug: nothing should panic).
    #[error("panic: {0}")]
    Panic(String),
    /// The object the call needs was freed or its thread stopped.
    #[error("{0}")]
    Released(String),
    #[error("prompt has {len} tokens but max_len is {max_len}: it must leave room for at least one generated token")]
    PromptTooLong { len: usize, max_len: usize },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A caught panic's message (a `panic!` carries a `String` or a `&str`).
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

impl Error {
    /// A stable, machine-readable name for the error's class.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Io { .. } => "io",
            Error::Json { .. } => "json",
            Error::Config(_) => "config",
            Error::Safetensors { .. } => "safetensors",
            Error::MissingTensor(_) => "missing_tensor",
            Error::UnexpectedTensors(_) => "unexpected_tensor",
            Error::ShapeMismatch { .. } => "shape_mismatch",
            Error::Unsupported(_) => "unsupported",
            Error::Mlx(_) => "mlx",
            Error::Tokenizer(_) => "tokenizer",
            Error::Template(_) => "template",
            Error::InvalidArgument(_) => "invalid_argument",
            Error::PromptTooLong { .. } => "prompt_too_long",
            Error::OutOfMemory(_) => "out_of_memory",
            Error::Constraint(_) => "constraint",
            Error::InvalidConstraint(_) => "invalid_constraint",
            Error::Panic(_) => "panic",
            Error::Released(_) => "released",
        }
    }

    /// An error for a caught panic, with the panic's message.
    pub(crate) fn from_panic(panic: &(dyn std::any::Any + Send)) -> Self {
        Error::Panic(panic_message(panic))
    }

    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Error::InvalidArgument(message.into())
    }
}

impl From<mlx_rs::error::Exception> for Error {
    fn from(e: mlx_rs::error::Exception) -> Self {
        Error::Mlx(e.what().to_string())
    }
}

/// Reads a JSON file, naming the file in both kinds of failure. Bytes, not
/// a string: invalid UTF-8 is then malformed JSON rather than an I/O error.
pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}
