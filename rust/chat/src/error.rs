//! Errors of chat-template loading and rendering.

use std::path::PathBuf;

/// Everything that can go wrong loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// A template or config file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is malformed or its `chat_template` has an unexpected shape.
    #[error("invalid {path}: {message}")]
    Config {
        /// The file that failed.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The template does not compile (Jinja syntax error).
    #[error("chat template {name:?} does not compile: {message}")]
    Syntax {
        /// The template's name (`default` for the unnamed one).
        name: String,
        /// The parser's message, with the line.
        message: String,
    },
    /// No template with the requested name (and no `default` to fall back on).
    #[error("no chat template named {requested:?} (available: {available:?})")]
    TemplateNotFound {
        /// The name that was asked for.
        requested: String,
        /// The names the model provides.
        available: Vec<String>,
    },
    /// The template called `raise_exception(message)`: the input is not acceptable to it
    /// (for example roles that do not alternate). The message is meant for the client.
    #[error("{0}")]
    TemplateRaised(String),
    /// Rendering failed for another reason (type error, unknown method, ...).
    #[error("chat template rendering failed: {0}")]
    Render(String),
    /// The messages are not a list of JSON objects, or a message lacks what an option needs.
    #[error("invalid messages: {0}")]
    InvalidMessages(String),
    /// The render options contradict each other or shadow a reserved template variable.
    #[error("invalid chat template options: {0}")]
    InvalidOptions(String),
}

/// Result alias of the chat crate.
pub type Result<T, E = ChatError> = std::result::Result<T, E>;
