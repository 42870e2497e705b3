//! Shared state of the HTTP handlers.

use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;

use prometheus_client::registry::Registry;
use tokio::sync::{Notify, Semaphore};
use voltllm_chat::ChatTemplate;
use voltllm_engine_client::EngineClient;
use voltllm_text::Tokenizer;

use crate::assistant::OutputParsing;
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
    /// The most input bytes one token can stand for (the longest token's text): a prompt longer
    /// than `max_model_len` times this cannot fit, and is refused before it is tokenized.
    pub max_token_bytes: usize,
    /// Token ids must be below this: the model's `vocab_size` as the engine reports it. Ids past the
    /// tokenizer's last token (a padded embedding matrix) are valid and decode as empty text.
    pub vocab_size: u32,
    /// One permit per engine request that may be running or waiting; none left means 503.
    pub admission: Arc<Semaphore>,
    /// The permits `admission` started with: the most engine requests one request may ask for.
    pub admission_capacity: usize,
    pub metrics: Metrics,
    pub registry: Registry,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    /// Shutdown began: API routes answer 503 and `/health` says draining.
    pub draining: AtomicBool,
    /// API requests admitted whose response has not been sent in full.
    pub in_flight: AtomicUsize,
    /// Notified when `in_flight` drops to zero.
    pub idle: Notify,
    /// How generated text is split into reasoning, tool calls and content.
    pub output_parsing: OutputParsing,
}

impl AppState {
    /// The model name to report back.
    pub fn model_name(&self) -> &str {
        self.served_model_names.first().map_or("", String::as_str)
    }

    /// Refuses a text prompt whose length alone proves it has more than `max_model_len` tokens,
    /// before the tokenizer builds per-token structures many times its size.
    pub fn check_prompt_bytes(&self, param: &str, num_bytes: usize) -> Result<(), ApiError> {
        let limit = (self.max_model_len as usize).saturating_mul(self.max_token_bytes);
        if num_bytes > limit {
            return Err(ApiError::bad(
                param,
                format!(
                    "the prompt is too long: {num_bytes} bytes are more than max_model_len {} \
                     tokens can hold (at most {} bytes per token)",
                    self.max_model_len, self.max_token_bytes
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a token-id prompt that alone fills the context.
    pub fn check_prompt_tokens(&self, param: &str, num_tokens: usize) -> Result<(), ApiError> {
        if num_tokens >= self.max_model_len as usize {
            return Err(ApiError::bad(
                param,
                format!(
                    "the prompt has {num_tokens} tokens; max_model_len is {}",
                    self.max_model_len
                ),
            ));
        }
        Ok(())
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
