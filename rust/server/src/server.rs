//! Server assembly: configuration, state, the router (built in this one place), and the run loop
//! that ends on a shutdown request (after draining) or an engine death that cannot be healed.

use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderName, HeaderValue, Method};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use subtle::ConstantTimeEq;
use tokio::sync::{Notify, Semaphore};
use tower_http::cors::{AllowHeaders, AllowMethods, AllowOrigin, CorsLayer};
use voltllm_engine_client::{EngineClient, EngineClientConfig, EngineLaunch};

use axum::serve::ListenerExt as _;
use futures::{FutureExt as _, StreamExt as _};

use crate::assistant::OutputParsing;
use crate::error::{ApiError, ServerError};
use crate::metrics::{Metrics, Rejected};
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
    /// Outputs buffered for one request whose client reads slower than the engine writes; past
    /// it the request is dropped (its stream ends with an error) rather than stall the others.
    pub max_pending_outputs: usize,
    pub max_request_body_bytes: usize,
    pub engine_ready_timeout: Duration,
    /// `None` disables the pid watch (engines on another host).
    pub engine_pid_poll_interval: Option<Duration>,
    /// Pids of engines the caller started: a crash before READY fails start-up at once.
    pub engine_pids: Vec<u32>,
    /// After an engine death that ends the server, how long to keep answering (503 on /health,
    /// errors to in-flight streams) before it exits.
    pub engine_death_grace: Duration,
    /// After shutdown starts, how long in-flight requests may take to finish (new ones get 503).
    pub shutdown_timeout: Duration,
    /// Engine command line (without `--engine-index`): when set, the server starts the engines
    /// itself and restarts one that dies or hangs. Empty: the engines are started by someone else
    /// and a death ends the server.
    pub engine_command: Vec<String>,
    /// Restarts allowed over the server's life; the next death ends it.
    pub max_engine_restarts: u32,
    /// An engine holding requests that sent nothing (not even a heartbeat) this long is hung.
    pub engine_hang_timeout: Option<Duration>,
    /// CORS, as vLLM spells it: `*` allows any.
    pub allowed_origins: Vec<String>,
    pub allowed_methods: Vec<String>,
    pub allowed_headers: Vec<String>,
    pub allow_credentials: bool,
    /// `--enable-auto-tool-choice`: parse the model's own tool calls for `tool_choice: auto`.
    pub enable_auto_tool_choice: bool,
    /// `--tool-call-parser`: the model's tool-call format (one of `tools::TOOL_PARSER_NAMES`).
    pub tool_call_parser: Option<String>,
    /// `--reasoning-parser`: the model's reasoning format (`qwen3` or `deepseek_r1`).
    pub reasoning_parser: Option<String>,
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
            max_pending_outputs: 4096,
            max_request_body_bytes: 32 << 20,
            engine_ready_timeout: Duration::from_secs(600),
            engine_pid_poll_interval: Some(Duration::from_millis(500)),
            engine_pids: Vec::new(),
            engine_death_grace: Duration::from_secs(1),
            shutdown_timeout: Duration::from_secs(30),
            engine_command: Vec::new(),
            max_engine_restarts: 5,
            engine_hang_timeout: Some(Duration::from_secs(30)),
            allowed_origins: vec!["*".into()],
            allowed_methods: vec!["*".into()],
            allowed_headers: vec!["*".into()],
            allow_credentials: false,
            enable_auto_tool_choice: false,
            tool_call_parser: None,
            reasoning_parser: None,
        }
    }
}

/// A server whose engines are ready and whose listener is bound, not yet serving.
pub struct Server {
    listener: tokio::net::TcpListener,
    app: Router,
    state: Arc<AppState>,
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

/// The longest text one token decodes to, in bytes (at least 1).
fn longest_token_bytes(tokenizer: &voltllm_text::Tokenizer) -> usize {
    (0..tokenizer.vocab_size() as u32)
        .filter_map(|id| tokenizer.decode(&[id], false).ok())
        .map(|text| text.len())
        .max()
        .unwrap_or(1)
        .max(1)
}

/// Bodies at least this large hand their memory back to the OS when their request ends.
const LARGE_BODY_BYTES: u64 = 1 << 20;

/// Returns freed heap pages to the OS. glibc keeps what a large request freed in its per-thread
/// arenas, so without this the peak of a burst of large bodies stays resident for good.
fn release_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::ffi::c_int;
        }
        // SAFETY: malloc_trim only walks glibc's own arenas under their locks.
        unsafe {
            malloc_trim(0);
        }
    }
}

/// Turns requests away while draining, and counts the ones let in until their body is sent.
async fn admit(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if state.draining.load(Ordering::SeqCst) {
        state.metrics.rejected(Rejected::Draining);
        return ApiError::Draining.into_response();
    }
    let large = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .is_some_and(|n| n >= LARGE_BODY_BYTES);
    let guard = InFlight::enter(state.clone(), large);
    let response = next.run(req).await;
    // A streamed body outlives the handler: the request counts until its last byte is sent.
    response.map(|body| {
        Body::from_stream(body.into_data_stream().map(move |chunk| {
            let _held = &guard;
            chunk
        }))
    })
}

/// One admitted request, counted in `AppState::in_flight` while alive; a large one trims the
/// heap when it ends.
struct InFlight {
    state: Arc<AppState>,
    large: bool,
}

impl InFlight {
    fn enter(state: Arc<AppState>, large: bool) -> Self {
        state.in_flight.fetch_add(1, Ordering::SeqCst);
        Self { state, large }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.state.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.state.idle.notify_waiters();
        }
        if self.large {
            // Trimming walks every arena (milliseconds): off the async workers.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn_blocking(release_memory);
            }
        }
    }
}

/// The CORS layer as vLLM configures it (`*` = any). With credentials a wildcard cannot be sent
/// literally, so the request's own origin, method and headers are mirrored, as Starlette does.
fn cors_layer(config: &ServerConfig) -> Result<CorsLayer, ServerError> {
    let any = |list: &[String]| list.iter().any(|v| v == "*");
    let credentials = config.allow_credentials;
    let bad = |what: &str, v: &str| ServerError::Config(format!("invalid CORS {what} {v:?}"));
    let origin = if any(&config.allowed_origins) {
        if credentials {
            AllowOrigin::mirror_request()
        } else {
            AllowOrigin::any()
        }
    } else {
        let list: Result<Vec<HeaderValue>, _> = config
            .allowed_origins
            .iter()
            .map(|o| HeaderValue::from_str(o).map_err(|_| bad("origin", o)))
            .collect();
        AllowOrigin::list(list?)
    };
    let methods = if any(&config.allowed_methods) {
        if credentials {
            AllowMethods::mirror_request()
        } else {
            AllowMethods::any()
        }
    } else {
        let list: Result<Vec<Method>, _> = config
            .allowed_methods
            .iter()
            .map(|m| Method::from_bytes(m.to_uppercase().as_bytes()).map_err(|_| bad("method", m)))
            .collect();
        AllowMethods::list(list?)
    };
    let headers = if any(&config.allowed_headers) {
        if credentials {
            AllowHeaders::mirror_request()
        } else {
            AllowHeaders::any()
        }
    } else {
        let list: Result<Vec<HeaderName>, _> = config
            .allowed_headers
            .iter()
            .map(|h| HeaderName::from_bytes(h.as_bytes()).map_err(|_| bad("header", h)))
            .collect();
        AllowHeaders::list(list?)
    };
    Ok(CorsLayer::new()
        .allow_origin(origin)
        .allow_methods(methods)
        .allow_headers(headers)
        .allow_credentials(credentials))
}

async fn not_found(req: Request) -> ApiError {
    ApiError::RouteNotFound(format!("{} {}", req.method(), req.uri().path()))
}

/// The router. Layer order matters (the last added runs first): CORS answers a browser's
/// preflight before routing or authentication see it; the body limit applies to every route;
/// authentication, then the drain gate, wrap only the API routes, so `/health` and `/ping` stay
/// open to load balancers and tell them when the server drains, and the chat page (`/`, which
/// asks the person for the key) loads without one.
pub fn router(state: Arc<AppState>, cors: CorsLayer) -> Router {
    let max_body = state.max_body_bytes;
    let api = Router::new()
        .route("/v1/chat/completions", post(routes::chat::chat_completions))
        .route("/v1/completions", post(routes::completions::completions))
        .route("/v1/models", get(routes::misc::models))
        .route("/v1/models/{*id}", get(routes::misc::model))
        .route("/v1/responses", post(routes::responses::responses))
        .route("/version", get(routes::misc::version))
        .route("/tokenize", post(routes::misc::tokenize))
        .route("/detokenize", post(routes::misc::detokenize))
        .route("/metrics", get(routes::misc::metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), admit))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .route("/health", get(routes::misc::health))
        .route(
            "/ping",
            get(routes::misc::health).post(routes::misc::health),
        )
        .merge(routes::page::router())
        .merge(crate::openapi::router())
        .merge(api)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(cors)
        .with_state(state)
}

impl Server {
    /// Binds the listener (a taken port fails before anything is loaded), loads the tokenizer
    /// and chat template, starts the engines when `engine_command` is set, waits for their READY.
    pub async fn start(config: ServerConfig) -> Result<Self, ServerError> {
        let cors = cors_layer(&config)?;
        let output_parsing = OutputParsing::from_config(&config)?;
        let address = format!("{}:{}", config.host, config.port);
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .map_err(|source| ServerError::Bind { address, source })?;
        let model_dir = config.model.clone();
        let (tokenizer, template, max_token_bytes) = tokio::task::spawn_blocking(move || {
            let tokenizer = voltllm_text::Tokenizer::from_model_dir(&model_dir)?;
            let template = voltllm_chat::ChatTemplate::from_model_dir(&model_dir)?;
            let max_token_bytes = longest_token_bytes(&tokenizer);
            Ok::<_, ServerError>((tokenizer, template, max_token_bytes))
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
        engine_config.hang_timeout = config.engine_hang_timeout;
        engine_config.stream_capacity = config.max_pending_outputs;
        if !config.engine_command.is_empty() {
            let mut launch = EngineLaunch::new(config.engine_command.clone());
            launch.max_restarts = config.max_engine_restarts;
            engine_config.launch = Some(launch);
        }
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
        let admission_capacity =
            (running + config.max_waiting_requests).min(Semaphore::MAX_PERMITS);
        let admission = Arc::new(Semaphore::new(admission_capacity));
        let (metrics, registry) = Metrics::new(
            &served_model_names[0],
            client.clone(),
            admission.clone(),
            admission_capacity,
        );
        let state = Arc::new(AppState {
            client: client.clone(),
            tokenizer,
            template,
            served_model_names,
            model_root: model_arg,
            max_model_len,
            max_token_bytes,
            vocab_size: engine_vocab,
            admission,
            admission_capacity,
            metrics,
            registry,
            api_key: config.api_key.clone(),
            max_body_bytes: config.max_request_body_bytes,
            draining: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            idle: Notify::new(),
            output_parsing,
        });
        Ok(Self {
            listener,
            app: router(state.clone(), cors),
            state,
            client,
            config,
        })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown` resolves, then drains: new requests get 503, in-flight ones may
    /// finish within `shutdown_timeout` (the rest end with an error), the engines are stopped and
    /// it returns Ok. An engine death that cannot be healed returns `Err(EngineDied)` after the
    /// grace period that lets in-flight streams report the error.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let Server {
            listener,
            app,
            state,
            client,
            config,
        } = self;
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, "serving");
        }
        // Streamed tokens are small writes: without TCP_NODELAY each one after the first can wait
        // for the client's delayed ACK (~40 ms), which would dominate inter-token latency.
        let listener = listener.tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!("cannot set TCP_NODELAY: {e}");
            }
        });
        let stop_serving = Arc::new(Notify::new());
        let serve = {
            let stop = stop_serving.clone();
            let serve = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.notified().await });
            tokio::spawn(serve.into_future())
        };
        tokio::pin!(serve);
        let death = tokio::select! {
            _ = shutdown => None,
            reason = client.wait_dead() => Some(reason),
            result = &mut serve => {
                client.shutdown_engines(ENGINE_STOP_GRACE).await;
                return match result {
                    Ok(r) => r.map_err(ServerError::Serve),
                    Err(e) => Err(ServerError::Config(format!("HTTP server task failed: {e}"))),
                };
            }
        };
        match &death {
            None => drain(&state, &client, config.shutdown_timeout).await,
            Some(reason) => {
                let grace = config.engine_death_grace;
                tracing::error!(%reason, "engine died for good; exiting after {grace:?}");
                tokio::time::sleep(grace).await;
            }
        }
        // Open connections are idle or past their last byte by now; keep-alives close at once.
        stop_serving.notify_one();
        if tokio::time::timeout(Duration::from_secs(2), &mut serve)
            .await
            .is_err()
        {
            tracing::warn!("connections still open after draining; closing them");
        }
        client.shutdown_engines(ENGINE_STOP_GRACE).await;
        match death {
            Some(reason) => Err(ServerError::EngineDied(reason)),
            None => Ok(()),
        }
    }
}

/// How long a stopped engine gets to exit on SIGTERM before it is killed.
const ENGINE_STOP_GRACE: Duration = Duration::from_secs(10);

/// Stops admitting requests and waits up to `timeout` for the admitted ones to finish; those still
/// running then end with an error event (streams) or an error body, not a cut connection.
async fn drain(state: &AppState, client: &EngineClient, timeout: Duration) {
    state.draining.store(true, Ordering::SeqCst);
    let running = state.in_flight.load(Ordering::SeqCst);
    tracing::info!(running, "shutting down: draining for up to {timeout:?}");
    let idle = async {
        loop {
            let notified = state.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if state.in_flight.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    };
    if tokio::time::timeout(timeout, idle).await.is_err() {
        let left = state.in_flight.load(Ordering::SeqCst);
        tracing::warn!(
            left,
            "requests still running after {timeout:?}; ending them"
        );
        client.fail_all("the server is shutting down");
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while state.in_flight.load(Ordering::SeqCst) > 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
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
