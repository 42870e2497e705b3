//! Command-line flags. Names follow `vllm bench serve` wherever the meaning is the same, so a command
//! line written for vLLM's harness runs here unchanged (flags only vLLM has are simply not offered).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Top-level parser: `voltllm-bench serve [FLAGS]` (also reached as `voltllm bench serve`).
#[derive(Debug, Parser)]
#[command(
    name = "voltllm-bench",
    about = "Load-test an OpenAI-compatible LLM server",
    version
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Sub-commands of the harness.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Drive a serving endpoint with a workload and report TTFT, TPOT, ITL, latency and throughput.
    Serve(Box<ServeArgs>),
}

/// Which OpenAI route is exercised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// `/v1/completions` with a text prompt.
    #[value(name = "openai", alias = "vllm")]
    OpenAi,
    /// `/v1/chat/completions` with one user message.
    #[value(name = "openai-chat")]
    OpenAiChat,
}

/// Workload generators (`--dataset-name`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DatasetName {
    /// Random token sequences with exact token lengths.
    Random,
    /// ShareGPT-format JSON conversations (`--dataset-path`).
    Sharegpt,
    /// Few shared prefixes with random suffixes, to exercise prefix caching.
    #[value(name = "prefix_repetition")]
    PrefixRepetition,
    /// A prompts file: JSONL with a `prompt` field per line, or plain text with one prompt per line.
    Custom,
}

/// Shape of a request-rate ramp (`--ramp-up-strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RampUp {
    Linear,
    Exponential,
}

/// All flags of `serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    // ---- target -------------------------------------------------------------------------------
    /// Server base URL, e.g. http://127.0.0.1:8000 (without /v1).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// Route to drive; defaults to /v1/completions (openai) or /v1/chat/completions (openai-chat).
    #[arg(long)]
    pub endpoint: Option<String>,
    /// Request format.
    #[arg(long, value_enum, default_value = "openai")]
    pub backend: Backend,
    /// Model name sent in requests; discovered from /v1/models when omitted.
    #[arg(long)]
    pub model: Option<String>,
    /// Bearer token (default: $OPENAI_API_KEY if set).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Tokenizer used to build prompts of exact token length and to count tokens: a tokenizer.json
    /// file or a model folder containing one (default: --model when it is such a folder).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Label for the result (default: the backend name).
    #[arg(long)]
    pub label: Option<String>,

    // ---- workload -----------------------------------------------------------------------------
    #[arg(long, value_enum, default_value = "random")]
    pub dataset_name: DatasetName,
    /// Dataset file for sharegpt and custom.
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Number of requests to send (ignored when --duration is given).
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    /// Stop issuing new requests after this many seconds (cycling through the dataset).
    #[arg(long)]
    pub duration: Option<f64>,
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    #[arg(long, default_value_t = 128)]
    pub random_output_len: usize,
    /// Lengths are drawn uniformly from [len*(1-r), len*(1+r)].
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// Fixed random prefix (tokens) prepended to every random prompt.
    #[arg(long, default_value_t = 0)]
    pub random_prefix_len: usize,
    /// Override the output length taken from the ShareGPT completions.
    #[arg(long)]
    pub sharegpt_output_len: Option<usize>,
    #[arg(long, default_value_t = 256)]
    pub custom_output_len: usize,
    #[arg(long, default_value_t = 256)]
    pub prefix_repetition_prefix_len: usize,
    #[arg(long, default_value_t = 256)]
    pub prefix_repetition_suffix_len: usize,
    #[arg(long, default_value_t = 10)]
    pub prefix_repetition_num_prefixes: usize,
    #[arg(long, default_value_t = 128)]
    pub prefix_repetition_output_len: usize,
    /// Ask the server to ignore EOS so outputs have exactly the requested length (always on for
    /// --dataset-name random, as in vLLM).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Sampling temperature sent with every request (server default when omitted).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Extra JSON object merged into every request body.
    #[arg(long)]
    pub extra_body: Option<String>,
    /// Seed for the workload and the arrival process.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    // ---- load shape ---------------------------------------------------------------------------
    /// Requests per second ("inf" sends everything at once).
    #[arg(long, default_value = "inf")]
    pub request_rate: f64,
    /// Gamma shape of inter-arrival times: 1 = Poisson, <1 burstier, >1 more uniform.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// Closed-loop cap on requests in flight.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    #[arg(long, value_enum)]
    pub ramp_up_strategy: Option<RampUp>,
    #[arg(long)]
    pub ramp_up_start_rps: Option<f64>,
    #[arg(long)]
    pub ramp_up_end_rps: Option<f64>,
    /// Requests sent before the measured run and excluded from the results.
    #[arg(long, default_value_t = 0)]
    pub num_warmups: usize,
    /// Run once per value: `request_rate=1,2,4` or `max_concurrency=1,8,64`.
    #[arg(long)]
    pub sweep: Option<String>,
    /// Seconds without a byte from the server before a request fails.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,

    // ---- metrics and output -------------------------------------------------------------------
    /// Metrics to report percentiles for (ttft,tpot,itl,e2el).
    #[arg(long, default_value = "ttft,tpot,itl,e2el")]
    pub percentile_metrics: String,
    #[arg(long, default_value = "99")]
    pub metric_percentiles: String,
    /// SLOs in ms, e.g. `--goodput ttft:500 tpot:50 e2el:5000`.
    #[arg(long, num_args = 1..)]
    pub goodput: Vec<String>,
    #[arg(long)]
    pub save_result: bool,
    #[arg(long)]
    pub result_dir: Option<PathBuf>,
    #[arg(long)]
    pub result_filename: Option<String>,
    /// Extra KEY=VALUE pairs copied into the result JSON.
    #[arg(long, num_args = 1..)]
    pub metadata: Vec<String>,
    /// Hide the progress bar.
    #[arg(long)]
    pub disable_tqdm: bool,
    /// Do not scrape the server's /metrics before and after the run.
    #[arg(long)]
    pub no_server_metrics: bool,
}

impl ServeArgs {
    /// The route actually driven.
    pub fn endpoint(&self) -> &str {
        match (&self.endpoint, self.backend) {
            (Some(e), _) => e,
            (None, Backend::OpenAi) => "/v1/completions",
            (None, Backend::OpenAiChat) => "/v1/chat/completions",
        }
    }

    /// Whether requests use the chat format: `--backend openai-chat`, or an endpoint ending in
    /// `chat/completions` (so `--endpoint /v1/chat/completions` alone is enough).
    pub fn is_chat(&self) -> bool {
        self.backend == Backend::OpenAiChat
            || self
                .endpoint()
                .trim_end_matches('/')
                .ends_with("chat/completions")
    }

    /// Name of the backend as written on the command line.
    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::OpenAi => "openai",
            Backend::OpenAiChat => "openai-chat",
        }
    }
}
