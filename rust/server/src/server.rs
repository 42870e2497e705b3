//! Server assembly: configuration, state, the router (built in this one place), and the run loop
//! that ends on a shutdown request or an engine death.

use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use subtle::ConstantTimeEq;
use tokio::sync::{Notify, Semaphore};
use voltllm_engine_client::{EngineClient, EngineClientConfig};

use axum::serve::ListenerExt as _;
use futures::FutureExt as _;

use crate::error::{ApiError, ServerError};
use crate::metrics::Metrics;
use crate::routes;
use crate::state::AppState;

/// Everything the server needs to start.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// Model folder with `tokenizer.json`, `tokenizer_config.json` and the chat template.
    pub model: PathBuf,
    /// Names accepted in `model`; empty means the `--model` argument as given.
    pub served_model_name: Vec<String>,
    /// When set, every route but `/health` requires `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// ZeroMQ endpoint bound for requests (engines' DEALERs connect).
    pub engine_input_address: String,
    /// ZeroMQ endpoint bound for outputs (engines' PUSHes connect).
    pub engine_output_address: String,
    pub num_engines: u32,
    /// Caps the engines' `max_model_len` from READY (never raises it).
    pub max_model_len: Option<u32>,
    /// Engine requests allowed to wait beyond what the engines run at once; past it, 503.
    pub max_waiting_requests: usize,
    pub max_request_body_bytes: usize,
    pub engine_ready_timeout: Duration,
    /// `None` disables the pid watch (engines on another host).
    pub engine_pid_poll_interval: Option<Duration>,
    /// Pids of engines the caller started: a crash before READY fails start-up at once.
    pub engine_pids: Vec<u32>,
    /// After an engine death, how long to keep answering (503 on /health, errors to in-flight
    /// streams) before the server exits.
    pub engine_death_grace: Duration,
    /// After shutdown starts, how long open connections may take to finish.
    pub drain_timeout: Duration,
}

impl ServerConfig {
    /// Defaults as vLLM spells them, for a model folder and the two engine endpoints.
    pub fn new(
        model: impl Into<PathBuf>,
        engine_input_address: impl Into<String>,
        engine_output_address: impl Into<String>,
    ) -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            model: model.into(),
            served_model_name: Vec::new(),
            api_key: None,
            engine_input_address: engine_input_address.into(),
            engine_output_address: engine_output_address.into(),
            num_engines: 1,
            max_model_len: None,
            max_waiting_requests: 1024,
            max_request_body_bytes: 32 << 20,
            engine_ready_timeout: Duration::from_secs(600),
            engine_pid_poll_interval: Some(Duration::from_millis(500)),
            engine_pids: Vec::new(),
            engine_death_grace: Duration::from_secs(1),
            drain_timeout: Duration::from_secs(5),
        }
    }
}

/// A server whose engines are ready and whose listener is bound, not yet serving.
pub struct Server {
    listener: tokio::net::TcpListener,
    app: Router,
    client: EngineClient,
    config: ServerConfig,
}

/// Checks `Authorization: Bearer <key>` in constant time.
async fn require_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !bool::from(given.as_bytes().ct_eq(key.as_bytes())) {
            return ApiError::Unauthorized("invalid or missing API key".into()).into_response();
        }
    }
    next.run(req).await
}

async fn not_found(req: Request) -> ApiError {
    ApiError::RouteNotFound(format!("{} {}", req.method(), req.uri().path()))
}

/// The router. Layer order matters: the body limit applies to every route; authentication wraps
/// only the API routes, so `/health` stays open to load balancers.
pub fn router(state: Arc<AppState>) -> Router {
    let max_body = state.max_body_bytes;
    let api = Router::new()
        .route("/v1/chat/completions", post(routes::chat::chat_completions))
        .route("/v1/completions", post(routes::completions::completions))
        .route("/v1/models", get(routes::misc::models))
        .route("/version", get(routes::misc::version))
        .route("/tokenize", post(routes::misc::tokenize))
        .route("/detokenize", post(routes::misc::detokenize))
        .route("/metrics", get(routes::misc::metrics))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .route("/health", get(routes::misc::health))
        .merge(api)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

impl Server {
    /// Loads the tokenizer and chat template, waits for the engines' READY, binds the listener.
    pub async fn start(config: ServerConfig) -> Result<Self, ServerError> {
        let model_dir = config.model.clone();
        let (tokenizer, template) = tokio::task::spawn_blocking(move || {
            let tokenizer = voltllm_text::Tokenizer::from_model_dir(&model_dir)?;
            let template = voltllm_chat::ChatTemplate::from_model_dir(&model_dir)?;
            Ok::<_, ServerError>((tokenizer, template))
        })
        .await
        .map_err(|e| ServerError::Config(format!("loading the model folder panicked: {e}")))??;
        if template.is_none() {
            tracing::warn!(model = %config.model.display(), "no chat template: /v1/chat/completions will answer 400");
        }

        let mut engine_config =
            EngineClientConfig::new(&config.engine_input_address, &config.engine_output_address);
        engine_config.num_engines = config.num_engines;
        engine_config.ready_timeout = config.engine_ready_timeout;
        engine_config.pid_poll_interval = config.engine_pid_poll_interval;
        engine_config.startup_pids = config.engine_pids.clone();
        tracing::info!(
            input = %config.engine_input_address,
            output = %config.engine_output_address,
            engines = config.num_engines,
            "waiting for engines"
        );
        let client = EngineClient::connect(engine_config).await?;

        let engine_len = client.max_model_len();
        let max_model_len = config
            .max_model_len
            .map_or(engine_len, |m| m.min(engine_len));
        let engine_vocab = client
            .engines()
            .iter()
            .map(|e| e.vocab_size)
            .min()
            .unwrap_or(0);
        let vocab_size = engine_vocab.min(tokenizer.vocab_size() as u32);
        let running: usize = client
            .engines()
            .iter()
            .map(|e| e.max_num_seqs as usize)
            .sum();
        let model_arg = config.model.display().to_string();
        let served_model_names = if config.served_model_name.is_empty() {
            vec![model_arg.clone()]
        } else {
            config.served_model_name.clone()
        };
        let (metrics, registry) = Metrics::new(&served_model_names[0], client.clone());
        let state = Arc::new(AppState {
            client: client.clone(),
            tokenizer,
            template,
            served_model_names,
            model_root: model_arg,
            max_model_len,
            vocab_size,
            admission: Arc::new(Semaphore::new(
                (running + config.max_waiting_requests).min(Semaphore::MAX_PERMITS),
            )),
            metrics,
            registry,
            api_key: config.api_key.clone(),
            max_body_bytes: config.max_request_body_bytes,
        });

        let address = format!("{}:{}", config.host, config.port);
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .map_err(|source| ServerError::Bind { address, source })?;
        Ok(Self {
            listener,
            app: router(state),
            client,
            config,
        })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown` resolves (Ok) or an engine dies (`Err(EngineDied)`, after the grace
    /// period that lets in-flight streams report the error).
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let Server {
            listener,
            app,
            client,
            config,
        } = self;
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, "serving");
        }
        let death: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        let started = Arc::new(Notify::new());
        let signal = {
            let (death, started) = (death.clone(), started.clone());
            let grace = config.engine_death_grace;
            async move {
                tokio::select! {
                    _ = shutdown => tracing::info!("shutting down"),
                    reason = client.wait_dead() => {
                        tracing::error!(%reason, "engine died; exiting after {grace:?}");
                        if let Ok(mut d) = death.lock() {
                            *d = Some(reason);
                        }
                        tokio::time::sleep(grace).await;
                    }
                }
                started.notify_one();
            }
        };
        // Streamed tokens are small writes: without TCP_NODELAY each one after the first can wait
        // for the client's delayed ACK (~40 ms), which would dominate inter-token latency.
        let listener = listener.tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!("cannot set TCP_NODELAY: {e}");
            }
        });
        let serve = axum::serve(listener, app).with_graceful_shutdown(signal);
        let drain = config.drain_timeout;
        tokio::select! {
            result = serve.into_future() => result.map_err(ServerError::Serve)?,
            _ = async { started.notified().await; tokio::time::sleep(drain).await } => {
                tracing::warn!("connections did not close within {drain:?}; exiting anyway");
            }
        }
        let reason = death.lock().ok().and_then(|d| d.clone());
        match reason {
            Some(reason) => Err(ServerError::EngineDied(reason)),
            None => Ok(()),
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// Starts the server and serves until Ctrl-C / SIGTERM or an engine death.
pub async fn run_server(config: ServerConfig) -> Result<(), ServerError> {
    Server::start(config).await?.run(shutdown_signal()).await
}

/// A flag another thread (e.g. Python's signal handling) can raise to stop a blocking server.
#[derive(Clone, Default)]
pub struct ShutdownHandle {
    requested: Arc<AtomicBool>,
    notify: Arc<Notify>,
}

impl ShutdownHandle {
    /// A handle that has not been triggered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the server to stop; safe to call from any thread, any number of times.
    pub fn shutdown(&self) {
        self.requested.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    /// True once `shutdown` was called.
    pub fn is_shutdown(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    /// Resolves once `shutdown` is called.
    pub async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            // Registered before the flag is read, so a concurrent `shutdown` cannot be missed.
            notified.as_mut().enable();
            if self.is_shutdown() {
                return;
            }
            notified.await;
        }
    }
}

/// Blocking entry point: builds a multi-threaded tokio runtime and serves until `shutdown` is
/// triggered (or, with `handle_signals`, Ctrl-C / SIGTERM arrives) or an engine dies. A shutdown
/// while the engines are still starting returns `Ok(())` at once.
pub fn run_server_blocking(
    config: ServerConfig,
    shutdown: ShutdownHandle,
    handle_signals: bool,
) -> Result<(), ServerError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("voltllm-server")
        .build()
        .map_err(ServerError::Runtime)?;
    runtime.block_on(async move {
        let stop = async move {
            if handle_signals {
                tokio::select! {
                    _ = shutdown.wait() => {}
                    _ = shutdown_signal() => {}
                }
            } else {
                shutdown.wait().await;
            }
        };
        let stop = stop.shared();
        // Start-up (waiting for the engines' READY) yields to a shutdown request too.
        let server = tokio::select! {
            server = Server::start(config) => server?,
            _ = stop.clone() => return Ok(()),
        };
        server.run(stop).await
    })
}
