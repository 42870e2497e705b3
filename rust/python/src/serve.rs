//! `serve(...)`: the HTTP front end, run from Python with the GIL released.
//!
//! The server runs on its own thread and tokio runtime. The calling thread waits on it in short
//! slices, re-attaching to Python between slices so that Ctrl-C raises `KeyboardInterrupt` promptly
//! (Python only runs signal handlers on a thread that holds the interpreter).

use std::path::PathBuf;
use std::sync::{mpsc, Mutex};
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use voltllm_server::{run_server_blocking, ServerConfig, ShutdownHandle};

const POLL_SLICE: Duration = Duration::from_millis(100);

/// Run the OpenAI-compatible server until Ctrl-C / SIGTERM (then drain) or an engine death that
/// cannot be healed.
///
/// With `engine_command` the server starts the engines itself (appending `--engine-index I`) and
/// restarts one that dies or hangs, up to `max_engine_restarts` times. `engine_pids` (engines the
/// caller started) are watched from the start, so an engine that dies while loading fails start-up
/// at once. Raises `RuntimeError` when the server fails (engine death, port in use, engines not
/// ready). `engine_hang_timeout` 0 turns the hang check off. `enable_auto_tool_choice`,
/// `tool_call_parser` and `reasoning_parser` are vLLM's flags of the same names.
#[pyfunction]
#[pyo3(signature = (
    model_dir, engine_input_address, engine_output_address, *, host = "127.0.0.1".to_string(),
    port = 8000, api_key = None, served_model_name = None, num_engines = 1, max_model_len = None,
    max_waiting_requests = 1024, max_pending_outputs = 4096, engine_ready_timeout = 600.0, engine_pids = Vec::new(),
    engine_command = Vec::new(), max_engine_restarts = 5, engine_hang_timeout = 30.0,
    shutdown_timeout = 30.0, max_request_body_bytes = 32 << 20,
    allowed_origins = vec!["*".to_string()], allowed_methods = vec!["*".to_string()],
    allowed_headers = vec!["*".to_string()], allow_credentials = false,
    enable_auto_tool_choice = false, tool_call_parser = None, reasoning_parser = None
))]
#[allow(clippy::too_many_arguments)]
pub fn serve(
    py: Python<'_>,
    model_dir: PathBuf,
    engine_input_address: String,
    engine_output_address: String,
    host: String,
    port: u16,
    api_key: Option<String>,
    served_model_name: Option<Vec<String>>,
    num_engines: u32,
    max_model_len: Option<u32>,
    max_waiting_requests: usize,
    max_pending_outputs: usize,
    engine_ready_timeout: f64,
    engine_pids: Vec<u32>,
    engine_command: Vec<String>,
    max_engine_restarts: u32,
    engine_hang_timeout: f64,
    shutdown_timeout: f64,
    max_request_body_bytes: usize,
    allowed_origins: Vec<String>,
    allowed_methods: Vec<String>,
    allowed_headers: Vec<String>,
    allow_credentials: bool,
    enable_auto_tool_choice: bool,
    tool_call_parser: Option<String>,
    reasoning_parser: Option<String>,
) -> PyResult<()> {
    let seconds = |name: &str, value: f64, zero_ok: bool| {
        if value.is_finite() && (value > 0.0 || (zero_ok && value == 0.0)) {
            Ok(Duration::from_secs_f64(value))
        } else {
            Err(PyValueError::new_err(format!(
                "{name} must be a positive number of seconds"
            )))
        }
    };
    let engine_ready_timeout = seconds("engine_ready_timeout", engine_ready_timeout, false)?;
    let engine_hang_timeout = seconds("engine_hang_timeout", engine_hang_timeout, true)?;
    let shutdown_timeout = seconds("shutdown_timeout", shutdown_timeout, true)?;
    voltllm_server::init_logging();
    let mut config = ServerConfig::new(model_dir, engine_input_address, engine_output_address);
    config.host = host;
    config.port = port;
    config.api_key = api_key.filter(|k| !k.is_empty());
    config.served_model_name = served_model_name.unwrap_or_default();
    config.num_engines = num_engines;
    config.max_model_len = max_model_len;
    config.max_waiting_requests = max_waiting_requests;
    if max_pending_outputs == 0 {
        return Err(PyValueError::new_err(
            "max_pending_outputs must be at least 1",
        ));
    }
    config.max_pending_outputs = max_pending_outputs;
    config.engine_ready_timeout = engine_ready_timeout;
    config.engine_pids = engine_pids;
    config.engine_command = engine_command;
    config.max_engine_restarts = max_engine_restarts;
    config.engine_hang_timeout = (!engine_hang_timeout.is_zero()).then_some(engine_hang_timeout);
    config.shutdown_timeout = shutdown_timeout;
    config.max_request_body_bytes = max_request_body_bytes;
    config.allowed_origins = allowed_origins;
    config.allowed_methods = allowed_methods;
    config.allowed_headers = allowed_headers;
    config.allow_credentials = allow_credentials;
    config.enable_auto_tool_choice = enable_auto_tool_choice;
    config.tool_call_parser = tool_call_parser;
    config.reasoning_parser = reasoning_parser;

    let shutdown = ShutdownHandle::new();
    let (done_tx, done_rx) = mpsc::channel();
    let server_thread = {
        let shutdown = shutdown.clone();
        std::thread::Builder::new()
            .name("voltllm-serve".into())
            .spawn(move || {
                let _ = done_tx.send(run_server_blocking(config, shutdown, false));
            })
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start the server thread: {e}")))?
    };

    // A Mutex makes the receiver Sync, as `detach` requires; only this thread ever locks it.
    let done_rx = Mutex::new(done_rx);
    let result = loop {
        let received = py.detach(|| match done_rx.lock() {
            Ok(rx) => rx.recv_timeout(POLL_SLICE),
            Err(_) => Err(mpsc::RecvTimeoutError::Disconnected),
        });
        match received {
            Ok(result) => break result,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(PyRuntimeError::new_err("the server thread panicked"))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if let Err(interrupt) = py.check_signals() {
            shutdown.shutdown();
            py.detach(|| server_thread.join()).ok();
            return Err(interrupt);
        }
    };
    py.detach(|| server_thread.join()).ok();
    result.map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// `voltllm bench ...`: runs the load tester with these command-line arguments; returns the exit code.
#[pyfunction]
pub fn bench_main(py: Python<'_>, args: Vec<String>) -> i32 {
    let mut argv = vec!["voltllm bench".to_string()];
    argv.extend(args);
    py.detach(|| voltllm_bench::run_cli(argv))
}
