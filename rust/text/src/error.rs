//! Errors of the text layer.

use std::path::PathBuf;

/// The error type of the text layer: loading tokenizers, encoding, decoding and stop strings.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A tokenizer or config file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A model folder has no `tokenizer.json`.
    #[error("no tokenizer.json in {0} (only Hugging Face fast-tokenizer files are supported)")]
    MissingTokenizerFile(PathBuf),
    /// `tokenizer.json` exists but the `tokenizers` library rejected it.
    #[error("cannot load tokenizer {path}: {message}")]
    Load {
        /// The file that failed.
        path: PathBuf,
        /// What the `tokenizers` library reported.
        message: String,
    },
    /// A JSON config file (`tokenizer_config.json`, `generation_config.json`) is malformed.
    #[error("invalid {path}: {message}")]
    Config {
        /// The file that failed.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// Encoding text into token ids failed.
    #[error("tokenization failed: {0}")]
    Encode(String),
    /// Decoding token ids into text failed.
    #[error("detokenization failed: {0}")]
    Decode(String),
    /// An empty stop string was given; it would match everywhere.
    #[error("stop strings must not be empty")]
    EmptyStopString,
}

/// Result alias of the text layer.
pub type Result<T, E = TextError> = std::result::Result<T, E>;
