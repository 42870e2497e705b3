//! `/v1/models`, `/health`, `/version`, `/tokenize`, `/detokenize`, `/metrics`.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json as JsonResponse;
use serde::Deserialize;
use serde_json::{json, Value as Json};
use voltllm_chat::RenderOptions;
use voltllm_engine_client::{EngineHealth, EngineState};

use super::{blocking, body_bytes, SharedState};
use crate::error::ApiError;
use crate::generate::unix_now;
use crate::openai;

/// One served model as `/v1/models` lists it.
fn model_card(state: &crate::state::AppState, name: &str, created: u64) -> Json {
    json!({"id": name, "object": "model", "created": created, "owned_by": "voltllm",
           "root": state.model_root, "parent": null, "max_model_len": state.max_model_len})
}

/// `GET /v1/models`.
pub async fn models(state: SharedState) -> JsonResponse<Json> {
    let created = unix_now() as u64;
    let data: Vec<Json> = state
        .served_model_names
        .iter()
        .map(|name| model_card(&state, name, created))
        .collect();
    JsonResponse(json!({"object": "list", "data": data}))
}

/// `GET /v1/models/{id}`: the model card, or a 404 for a name not served here.
pub async fn model(
    state: SharedState,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<JsonResponse<Json>, ApiError> {
    state.check_model(Some(&id))?;
    Ok(JsonResponse(model_card(&state, &id, unix_now() as u64)))
}

/// Each engine's state as `/health` reports it when one is down.
fn engine_report(states: &[EngineState]) -> Vec<Json> {
    states
        .iter()
        .enumerate()
        .map(|(i, s)| match s {
            EngineState::Serving => json!({"engine": i, "state": "serving"}),
            EngineState::Restarting(why) => {
                json!({"engine": i, "state": "restarting", "reason": why})
            }
            EngineState::Lost(why) => json!({"engine": i, "state": "lost", "reason": why}),
        })
        .collect()
}

/// `GET /health` (and vLLM's `GET|POST /ping`): 200 with an empty body while every engine serves;
/// 200 with `{"status": "degraded", "engines": [...]}` while some engines serve and others restart
/// or are lost (data parallelism: the server still answers); 503 while no engine serves (one
/// restarts, or all died for good) or while the server drains.
pub async fn health(state: SharedState) -> Response {
    if state.draining.load(std::sync::atomic::Ordering::SeqCst) {
        return ApiError::Draining.into_response();
    }
    match state.client.health() {
        EngineHealth::Healthy => StatusCode::OK.into_response(),
        EngineHealth::Degraded(_) => {
            let engines = engine_report(&state.client.engine_states());
            JsonResponse(json!({"status": "degraded", "engines": engines})).into_response()
        }
        EngineHealth::Restarting(reason) => {
            ApiError::Unavailable(format!("engine restarting after: {reason}")).into_response()
        }
        EngineHealth::Dead(reason) => {
            ApiError::Unavailable(format!("engine died ({reason}); the server is exiting"))
                .into_response()
        }
    }
}

/// `GET /version`.
pub async fn version() -> JsonResponse<Json> {
    JsonResponse(json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// `GET /metrics` in the Prometheus text format.
pub async fn metrics(state: SharedState) -> Result<Response, ApiError> {
    let text = crate::metrics::render(&state.registry)
        .map_err(|_| ApiError::Internal("cannot encode metrics".into()))?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

/// `POST /tokenize` body: exactly one of `prompt` and `messages`; any other field is a 400.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    model: Option<String>,
    /// Text to tokenize.
    prompt: Option<String>,
    /// A conversation, rendered with the chat template first.
    messages: Option<Vec<Json>>,
    /// With `prompt`: add the tokenizer's special tokens (default true).
    #[serde(default = "yes")]
    add_special_tokens: bool,
    /// With `messages` (default true).
    add_generation_prompt: Option<bool>,
    /// With `messages`: extra chat template variables.
    chat_template_kwargs: Option<serde_json::Map<String, Json>>,
}

fn yes() -> bool {
    true
}

/// `POST /tokenize`: `{"prompt"}` or `{"messages"}` (rendered with the chat template) to ids.
pub async fn tokenize(
    state: SharedState,
    body: Result<Bytes, BytesRejection>,
) -> Result<JsonResponse<Json>, ApiError> {
    let state = state.0;
    let req: TokenizeRequest = openai::parse_body(&body_bytes(&state, body)?)?;
    state.check_model(req.model.as_deref())?;
    let tokenizer = state.tokenizer.clone();
    let template = state.template.clone();
    let tokens = blocking(move || match (req.prompt, req.messages) {
        (Some(prompt), None) => Ok(tokenizer.encode(&prompt, req.add_special_tokens)?),
        (None, Some(messages)) => {
            let template = template
                .ok_or_else(|| ApiError::bad("messages", "this model has no chat template"))?;
            let messages = openai::normalize_messages(&messages)?;
            let opts = RenderOptions {
                add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
                extra: req.chat_template_kwargs.unwrap_or_default(),
                ..Default::default()
            };
            let text = template.render(&messages, &opts)?;
            Ok(tokenizer.encode(&text, false)?)
        }
        _ => Err(ApiError::bad(
            "prompt",
            "give exactly one of prompt or messages",
        )),
    })
    .await?;
    Ok(JsonResponse(json!({
        "count": tokens.len(),
        "max_model_len": state.max_model_len,
        "tokens": tokens,
    })))
}

/// `POST /detokenize` body; any other field is a 400.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    model: Option<String>,
    /// Token ids of the vocabulary.
    tokens: Vec<i64>,
}

/// `POST /detokenize`: ids to text.
pub async fn detokenize(
    state: SharedState,
    body: Result<Bytes, BytesRejection>,
) -> Result<JsonResponse<Json>, ApiError> {
    let state = state.0;
    let req: DetokenizeRequest = openai::parse_body(&body_bytes(&state, body)?)?;
    state.check_model(req.model.as_deref())?;
    let vocab = state.vocab_size;
    let tokenizer = state.tokenizer.clone();
    let text = blocking(move || {
        let ids: Vec<u32> = req
            .tokens
            .iter()
            .map(|&id| {
                u32::try_from(id)
                    .ok()
                    .filter(|&id| id < vocab)
                    .ok_or_else(|| {
                        ApiError::bad(
                            "tokens",
                            format!("token id {id} is out of range [0, {vocab})"),
                        )
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(tokenizer.decode(&ids, false)?)
    })
    .await?;
    Ok(JsonResponse(json!({ "prompt": text })))
}
