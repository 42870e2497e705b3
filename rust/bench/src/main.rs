//! The standalone `voltllm-bench` binary; `voltllm bench serve` reaches the same code through pyo3.

fn main() {
    std::process::exit(voltllm_bench::run_cli(std::env::args().collect()));
}
