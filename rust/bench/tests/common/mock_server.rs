//! A mock OpenAI-compatible server with known timing: the first token is sent `ttft_ms` after the
//! request arrives and token k (k ≥ 1) at `ttft_ms + k·tpot_ms`. Deadlines are absolute, so timer
//! overshoot never accumulates across tokens. With zero delays it answers as fast as it can, which
//! is what the client-headroom measurement needs.
//!
//! Shared by the integration tests and the `mock_server` example (`#[path]`-included in both).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::{Json, Router};
use futures_util::stream;
use serde_json::{json, Value};
use tokio::time::Instant;

/// Timing and identity of the mock.
#[derive(Debug, Clone)]
pub struct MockConfig {
    pub model: String,
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

struct AppState {
    cfg: MockConfig,
    requests: AtomicU64,
    tokens: AtomicU64,
}

/// Builds the router (routes: /v1/models, /v1/completions, /v1/chat/completions, /metrics).
pub fn router(cfg: MockConfig) -> Router {
    let state = Arc::new(AppState {
        cfg,
        requests: AtomicU64::new(0),
        tokens: AtomicU64::new(0),
    });
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(|s, b| generate(s, b, false)))
        .route("/v1/chat/completions", post(|s, b| generate(s, b, true)))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": st.cfg.model, "object": "model", "root": st.cfg.model}]}),
    )
}

async fn metrics(State(st): State<Arc<AppState>>) -> String {
    format!(
        "# TYPE mock_requests_total counter\nmock_requests_total {}\n# TYPE mock_tokens_total counter\nmock_tokens_total {}\n",
        st.requests.load(Ordering::Relaxed),
        st.tokens.load(Ordering::Relaxed)
    )
}

fn error(status: StatusCode, msg: &str) -> Response {
    (status, Json(json!({"error": {"message": msg, "type": "invalid_request_error", "code": status.as_u16()}})))
        .into_response()
}

async fn generate(
    State(st): State<Arc<AppState>>,
    Json(body): Json<Value>,
    chat: bool,
) -> Response {
    let arrived = Instant::now();
    if body.get("model").and_then(Value::as_str) != Some(st.cfg.model.as_str()) {
        return error(StatusCode::NOT_FOUND, "The model does not exist.");
    }
    let n = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(16)
        .max(1);
    st.requests.fetch_add(1, Ordering::Relaxed);
    st.tokens.fetch_add(n, Ordering::Relaxed);
    let ttft = Duration::from_secs_f64(st.cfg.ttft_ms / 1000.0);
    let tpot = Duration::from_secs_f64(st.cfg.tpot_ms / 1000.0);
    let delayed = !(ttft.is_zero() && tpot.is_zero());
    // Events: n token chunks, one usage chunk, [DONE].
    let events = stream::unfold(0u64, move |k| async move {
        if k > n + 1 {
            return None;
        }
        let data = if k < n {
            if delayed {
                tokio::time::sleep_until(arrived + ttft + tpot * k as u32).await;
            }
            let text = format!(" t{k}");
            if chat {
                json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]})
            } else {
                json!({"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": null}]})
            }
            .to_string()
        } else if k == n {
            json!({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}).to_string()
        } else {
            "[DONE]".to_string()
        };
        Some((
            Ok::<_, std::convert::Infallible>(Bytes::from(format!("data: {data}\n\n"))),
            k + 1,
        ))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(events))
        .expect("static response parts")
}

/// A mock running on its own runtime and threads, so its timing does not depend on the client's
/// runtime being responsive (and vice versa).
pub struct MockServer {
    pub addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MockServer {
    /// Binds 127.0.0.1 on `port` (0 = any free port) and serves until dropped.
    pub fn start(cfg: MockConfig, port: u16, worker_threads: usize) -> MockServer {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(worker_threads)
                .enable_all()
                .build()
                .expect("mock runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                    .await
                    .expect("bind mock");
                addr_tx
                    .send(listener.local_addr().expect("addr"))
                    .expect("report addr");
                // Without TCP_NODELAY, Nagle's algorithm holds each small SSE write until the
                // client's delayed ACK (~40 ms) once a connection is reused, distorting every ITL.
                let listener = listener.tap_io(|tcp| {
                    let _ = tcp.set_nodelay(true);
                });
                axum::serve(listener, router(cfg))
                    .with_graceful_shutdown(async {
                        let _ = stop_rx.await;
                    })
                    .await
                    .expect("mock serve");
            });
        });
        let addr = addr_rx.recv().expect("mock server started");
        MockServer {
            addr,
            shutdown: Some(stop_tx),
            thread: Some(thread),
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Blocks until the server thread exits (never, unless dropped from elsewhere).
    pub fn join(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}
