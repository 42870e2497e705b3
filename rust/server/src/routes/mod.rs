//! HTTP handlers, one module per endpoint family, plus the SSE framing they share.

pub mod chat;
pub mod completions;
pub mod misc;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, StreamExt};
use serde_json::{json, Value as Json};

use crate::error::ApiError;
use crate::generate::{ChoiceDelta, DeltaStream};
use crate::state::AppState;

/// The body bytes, or the error the client should see (413 past the size limit).
pub fn body_bytes(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge(state.max_body_bytes)
        } else {
            ApiError::BadRequest {
                message: format!("cannot read request body: {rejection}"),
                param: None,
            }
        }
    })
}

/// `usage` object.
pub fn usage(prompt_tokens: usize, completion_tokens: usize) -> Json {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// Turns deltas into an OpenAI SSE response: `prefix` chunks first, one chunk per delta, an
/// optional usage chunk (given the completion-token total), then `data: [DONE]`. An error midway
/// becomes an `{"error": ...}` event followed by `[DONE]`, so clients never hang.
pub fn sse_response<C, U>(
    prefix: Vec<Json>,
    deltas: DeltaStream,
    chunk: C,
    usage_chunk: Option<U>,
) -> Response
where
    C: FnMut(ChoiceDelta) -> Json + Send + 'static,
    U: FnOnce(usize) -> Json + Send + 'static,
{
    struct St<C, U> {
        deltas: Option<DeltaStream>,
        queue: VecDeque<Event>,
        chunk: C,
        usage_chunk: Option<U>,
        completion_tokens: usize,
    }
    fn data(v: &Json) -> Event {
        Event::default().data(v.to_string())
    }
    let st = St {
        deltas: Some(deltas),
        queue: prefix.iter().map(data).collect(),
        chunk,
        usage_chunk,
        completion_tokens: 0,
    };
    let events = stream::unfold(st, |mut st| async move {
        loop {
            if let Some(event) = st.queue.pop_front() {
                return Some((Ok::<_, Infallible>(event), st));
            }
            let deltas = st.deltas.as_mut()?;
            match deltas.next().await {
                Some(Ok(delta)) => {
                    st.completion_tokens += delta.num_tokens;
                    let c = (st.chunk)(delta);
                    st.queue.push_back(data(&c));
                }
                Some(Err(e)) => {
                    st.deltas = None;
                    st.queue.push_back(data(&e.body()));
                    st.queue.push_back(Event::default().data("[DONE]"));
                }
                None => {
                    st.deltas = None;
                    if let Some(u) = st.usage_chunk.take() {
                        st.queue.push_back(data(&u(st.completion_tokens)));
                    }
                    st.queue.push_back(Event::default().data("[DONE]"));
                }
            }
        }
    });
    Sse::new(events).into_response()
}

/// Runs CPU-heavy work (templating, tokenization) on the blocking pool, off the async workers.
pub async fn blocking<T, F>(f: F) -> Result<T, ApiError>
where
    F: FnOnce() -> Result<T, ApiError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(format!("worker task failed: {e}")))?
}

/// A fresh request id with the given prefix.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// Shared state handle type of the routes.
pub type SharedState = axum::extract::State<Arc<AppState>>;
