//! Standalone mock OpenAI server with injected delays, for measuring the harness itself:
//!
//! ```text
//! cargo run --release -p voltllm-bench --example mock_server -- --port 8100 --ttft-ms 0 --tpot-ms 0
//! ```

#[path = "../tests/common/mock_server.rs"]
mod mock_server;

use clap::Parser;
use mock_server::{MockConfig, MockServer};

#[derive(Parser)]
struct Opts {
    #[arg(long, default_value_t = 8100)]
    port: u16,
    #[arg(long, default_value_t = 0.0)]
    ttft_ms: f64,
    #[arg(long, default_value_t = 0.0)]
    tpot_ms: f64,
    #[arg(long, default_value = "mock-model")]
    model: String,
    /// Runtime worker threads of the mock.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

fn main() {
    let o = Opts::parse();
    let server = MockServer::start(
        MockConfig {
            model: o.model,
            ttft_ms: o.ttft_ms,
            tpot_ms: o.tpot_ms,
        },
        o.port,
        o.threads,
    );
    eprintln!("mock server on {}", server.base_url());
    server.join();
}
