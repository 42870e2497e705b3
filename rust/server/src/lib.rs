//! voltllm's OpenAI-compatible HTTP front end.
//!
//! ```text
//!   voltllm-server (axum routes, validation, SSE, metrics, auth)
//!     ├── voltllm-chat           chat templates (minijinja)
//!     ├── voltllm-text           tokenizer, incremental detokenizer, stop strings
//!     └── voltllm-engine-client  ZeroMQ transport, per-request streams, aborts, engine health
//!           └── voltllm-protocol wire types + msgpack codecs
//! ```
//!
//! Entry points: [`run_server`] (async, stops on Ctrl-C/SIGTERM), [`run_server_blocking`] (own
//! runtime, stops on a [`ShutdownHandle`]), and [`Server`] for callers that need the bound address
//! before serving. See `docs/server.md`.

pub mod assistant;
pub mod error;
pub mod generate;
pub mod metrics;
pub mod openai;
pub mod openapi;
pub mod reasoning;
pub mod request_fields;
pub mod routes;
pub mod server;
pub mod state;
pub mod structured;
pub mod tools;

pub use error::{ApiError, ServerError};
pub use server::{
    router, run_server, run_server_blocking, shutdown_signal, Server, ServerConfig, ShutdownHandle,
};

/// Logs to stderr at `info`, or as `RUST_LOG` says. A second call (e.g. a second `serve()` from
/// Python in one process) keeps the first subscriber.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).try_init();
}
