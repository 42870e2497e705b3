//! `voltllm-server`: the HTTP front end as a standalone binary, for engines started separately
//! (`voltllm engine --headless` or `python -m voltllm.engine.core_proc`). Flags follow vLLM.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use voltllm_server::{run_server, ServerConfig};

#[derive(Parser, Debug)]
#[command(
    name = "voltllm-server",
    version,
    about = "OpenAI-compatible front end for voltllm engines"
)]
struct Args {
    /// Model folder (tokenizer.json, tokenizer_config.json, chat template).
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer <key>` on every route but /health.
    #[arg(long, env = "VOLTLLM_API_KEY")]
    api_key: Option<String>,
    /// Model name(s) clients may use; defaults to --model.
    #[arg(long, num_args = 1..)]
    served_model_name: Vec<String>,
    /// ZeroMQ endpoint to bind for requests (engines connect their DEALER).
    #[arg(long)]
    engine_input_address: String,
    /// ZeroMQ endpoint to bind for outputs (engines connect their PUSH).
    #[arg(long)]
    engine_output_address: String,
    /// Number of engines (data-parallel ranks) that must send READY.
    #[arg(long, alias = "data-parallel-size", default_value_t = 1)]
    num_engines: u32,
    /// Cap on the context length; defaults to what the engines report in READY.
    #[arg(long)]
    max_model_len: Option<u32>,
    /// Engine requests that may wait beyond the engines' max_num_seqs; more get 503.
    #[arg(long, default_value_t = 1024)]
    max_waiting_requests: usize,
    /// Outputs held for one request whose client reads too slowly; past it the request is dropped
    /// with an error instead of stalling the others.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
    max_pending_outputs: u64,
    #[arg(long, default_value_t = 32 << 20)]
    max_request_body_bytes: usize,
    /// Seconds to wait for every engine's READY.
    #[arg(long, default_value_t = 600.0)]
    engine_ready_timeout: f64,
    /// Do not watch engine pids (engines on another host).
    #[arg(long)]
    no_engine_pid_watch: bool,
    /// Seconds an engine holding requests may send nothing (not even its heartbeat) before it
    /// counts as hung, which ends the server; 0 turns the check off.
    #[arg(long, default_value_t = 30.0)]
    engine_hang_timeout: f64,
    /// On SIGTERM/SIGINT, seconds in-flight requests may take to finish (new ones get 503).
    #[arg(long, default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// CORS origins, a JSON list.
    #[arg(long, default_value = r#"["*"]"#)]
    allowed_origins: String,
    /// CORS methods, a JSON list.
    #[arg(long, default_value = r#"["*"]"#)]
    allowed_methods: String,
    /// CORS request headers, a JSON list.
    #[arg(long, default_value = r#"["*"]"#)]
    allowed_headers: String,
    /// CORS: allow credentials.
    #[arg(long)]
    allow_credentials: bool,
    /// Parse the model's own tool calls for `tool_choice: "auto"` (needs --tool-call-parser).
    #[arg(long)]
    enable_auto_tool_choice: bool,
    /// The model's tool-call format: hermes, qwen3_coder, llama3_json, mistral or pythonic.
    #[arg(long)]
    tool_call_parser: Option<String>,
    /// Split `<think>` reasoning into `reasoning_content`: qwen3 or deepseek_r1.
    #[arg(long)]
    reasoning_parser: Option<String>,
}

/// vLLM takes its CORS lists as JSON (`'["http://a", "http://b"]'`).
fn json_list(s: &str) -> Result<Vec<String>, String> {
    serde_json::from_str(s).map_err(|e| format!("expected a JSON list of strings: {e}"))
}

fn main() -> ExitCode {
    voltllm_server::init_logging();
    let args = Args::parse();
    let mut config = ServerConfig::new(
        args.model,
        args.engine_input_address,
        args.engine_output_address,
    );
    config.host = args.host;
    config.port = args.port;
    config.api_key = args.api_key;
    config.served_model_name = args.served_model_name;
    config.num_engines = args.num_engines;
    config.max_model_len = args.max_model_len;
    config.max_waiting_requests = args.max_waiting_requests;
    config.max_pending_outputs = args.max_pending_outputs as usize;
    config.max_request_body_bytes = args.max_request_body_bytes;
    config.engine_ready_timeout = Duration::from_secs_f64(args.engine_ready_timeout.max(0.0));
    config.engine_hang_timeout = (args.engine_hang_timeout > 0.0)
        .then(|| Duration::from_secs_f64(args.engine_hang_timeout.min(1e9)));
    config.shutdown_timeout = Duration::from_secs_f64(args.shutdown_timeout.clamp(0.0, 1e9));
    let lists = [
        ("--allowed-origins", &args.allowed_origins),
        ("--allowed-methods", &args.allowed_methods),
        ("--allowed-headers", &args.allowed_headers),
    ]
    .map(|(flag, value)| json_list(value).map_err(|e| format!("{flag}: {e}")));
    let [origins, methods, headers] = match lists {
        [Ok(o), Ok(m), Ok(h)] => [o, m, h],
        [o, m, h] => {
            let error = [o.err(), m.err(), h.err()].into_iter().flatten().next();
            eprintln!("voltllm-server: error: {}", error.unwrap_or_default());
            return ExitCode::from(2);
        }
    };
    config.allowed_origins = origins;
    config.allowed_methods = methods;
    config.allowed_headers = headers;
    config.allow_credentials = args.allow_credentials;
    config.enable_auto_tool_choice = args.enable_auto_tool_choice;
    config.tool_call_parser = args.tool_call_parser;
    config.reasoning_parser = args.reasoning_parser;
    if args.no_engine_pid_watch {
        config.engine_pid_poll_interval = None;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("voltllm-server: error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run_server(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("voltllm-server: error: {e}");
            ExitCode::FAILURE
        }
    }
}
