//! HTTP handlers, one module per endpoint family, plus the SSE framing they share.

pub mod chat;
pub mod completions;
pub mod misc;
pub mod page;
pub mod responses;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, StreamExt};
use serde_json::{json, Value as Json};

use crate::error::ApiError;
use crate::generate::{ChoiceDelta, DeltaStream};
use crate::metrics::Rejected;
use crate::state::AppState;

/// The body bytes, or the error the client should see (413 past the size limit).
pub fn body_bytes(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            state.metrics.rejected(Rejected::BodyTooLarge);
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

/// One SSE event, `data: <json>\n\n`. serde_json escapes newlines inside strings, so the JSON
/// always fits on one `data:` line.
pub fn sse_frame<T: serde::Serialize + ?Sized>(value: &T) -> Bytes {
    let mut buf = Vec::with_capacity(256);
    buf.extend_from_slice(b"data: ");
    if serde_json::to_writer(&mut buf, value).is_err() {
        // Only non-string map keys can fail, and no chunk type has them.
        buf.truncate(6);
        buf.extend_from_slice(b"{}");
    }
    buf.extend_from_slice(b"\n\n");
    Bytes::from(buf)
}

const DONE: &[u8] = b"data: [DONE]\n\n";

/// Turns deltas into an OpenAI SSE response: `prefix` chunks first, one chunk per delta (`chunk`
/// returns the framed event), an optional usage chunk (given the completion-token total), then
/// `data: [DONE]`. An error midway becomes an `{"error": ...}` event followed by `[DONE]`, so
/// clients never hang. Events are written as raw frames: the per-token path builds no
/// intermediate JSON tree.
pub fn sse_response<C, U>(
    prefix: Vec<Json>,
    deltas: DeltaStream,
    chunk: C,
    usage_chunk: Option<U>,
) -> Response
where
    C: FnMut(ChoiceDelta) -> Bytes + Send + 'static,
    U: FnOnce(usize) -> Json + Send + 'static,
{
    struct St<C, U> {
        deltas: Option<DeltaStream>,
        queue: VecDeque<Bytes>,
        chunk: C,
        usage_chunk: Option<U>,
        completion_tokens: usize,
    }
    let st = St {
        deltas: Some(deltas),
        queue: prefix.iter().map(sse_frame).collect(),
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
                    let frame = (st.chunk)(delta);
                    st.queue.push_back(frame);
                }
                Some(Err(e)) => {
                    st.deltas = None;
                    st.queue.push_back(sse_frame(&e.body()));
                    st.queue.push_back(Bytes::from_static(DONE));
                }
                None => {
                    st.deltas = None;
                    if let Some(u) = st.usage_chunk.take() {
                        st.queue.push_back(sse_frame(&u(st.completion_tokens)));
                    }
                    st.queue.push_back(Bytes::from_static(DONE));
                }
            }
        }
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(events),
    )
        .into_response()
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
