//! Shared state of the HTTP handlers.

use std::sync::Arc;

use prometheus_client::registry::Registry;
use tokio::sync::Semaphore;
use voltllm_chat::ChatTemplate;
use voltllm_engine_client::EngineClient;
use voltllm_text::Tokenizer;

use crate::error::ApiError;
use crate::metrics::Metrics;

/// Everything a handler needs; one instance behind an `Arc` for the server's lifetime.
pub struct AppState {
    pub client: EngineClient,
    pub tokenizer: Tokenizer,
    /// `None` when the model folder has no chat template (chat requests then get a 400).
    pub template: Option<ChatTemplate>,
    /// Names clients may put in `model`; the first is reported in responses.
    pub served_model_names: Vec<String>,
    /// The model folder, reported as `root` by `/v1/models`.
    pub model_root: String,
    pub max_model_len: u32,
    /// Token ids must be below this (the smaller of the engine's and the tokenizer's vocabulary).
    pub vocab_size: u32,
    /// One permit per engine request that may be running or waiting; none left means 503.
    pub admission: Arc<Semaphore>,
    pub metrics: Metrics,
    pub registry: Registry,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
}

impl AppState {
    /// The model name to report back.
    pub fn model_name(&self) -> &str {
        self.served_model_names.first().map_or("", String::as_str)
    }

    /// Accepts a request's `model` when it names a served model (or is absent).
    pub fn check_model(&self, requested: Option<&str>) -> Result<(), ApiError> {
        match requested {
            Some(m) if !self.served_model_names.iter().any(|n| n == m) => {
                Err(ApiError::ModelNotFound(m.to_string()))
            }
            _ => Ok(()),
        }
    }
}
