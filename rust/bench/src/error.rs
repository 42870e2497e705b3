//! One error type for everything that stops a benchmark before or instead of producing results.
//! Each variant renders as one self-contained line, which `run_cli` prints before exiting non-zero.

use std::path::PathBuf;

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("cannot reach server at {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("model '{model}' is not served by {url} (it serves: {available})")]
    UnknownModel {
        model: String,
        url: String,
        available: String,
    },
    #[error("server at {url} lists no models; pass --model")]
    NoModels { url: String },
    #[error("cannot load tokenizer from {path}: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error("malformed dataset {path}: {reason}")]
    Dataset { path: PathBuf, reason: String },
    #[error("all {num_requests} requests failed; first error: {first_error}")]
    AllFailed {
        num_requests: usize,
        first_error: String,
    },
    #[error("cannot write {path}: {reason}")]
    Output { path: PathBuf, reason: String },
    #[error("{0}")]
    Runtime(String),
}

/// Result alias used across the crate.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;
