//! `voltllm-bench`: the load-testing harness behind `voltllm bench serve`.
//!
//! It drives any OpenAI-compatible server (voltllm, vLLM, TGI, llama.cpp server) with a workload
//! whose token lengths are exact under the model's tokenizer, shapes the load (Poisson/gamma
//! arrivals, ramps, closed-loop concurrency, duration), measures TTFT, TPOT, ITL and end-to-end
//! latency per request on the client, and reports them as a console table and a JSON document whose
//! keys follow `vllm bench serve`. Plots are drawn from that JSON by `python -m voltllm.bench`.
//!
//! Layout: `args` (flags) → `dataset` (prompts) + `schedule` (arrival times) → `client` (one timed
//! streaming request) → `metrics` (summary) → `report` (table, JSON); `runner` ties them together.

pub mod args;
pub mod client;
pub mod dataset;
pub mod error;
pub mod metrics;
pub mod prom;
pub mod report;
pub mod runner;
pub mod schedule;

use clap::Parser;

pub use error::{BenchError, Result};

/// Parses `args` (the first element is the program name, as in `std::env::args()`), runs the
/// benchmark and returns the process exit code: 0 on success, 1 when the run failed (the reason is
/// printed as one line on stderr), 2 on a command-line error. Used by the binary and by the pyo3
/// bindings (`voltllm bench serve`).
pub fn run_cli(args: Vec<String>) -> i32 {
    let cli = match args::Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are "errors" to clap but succeed.
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return 1;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            args::Command::Serve(a) => runner::serve(*a).await,
        }
    });
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}
