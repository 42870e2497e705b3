//! Measured TTFT and TPOT match the mock server's injected delays within 5% (the p99s at 256 streams
//! within 10%), at 1 and 256 concurrent streams. A test binary of its own, so that no other test competes for the CPU while
//! the timings are taken (cargo runs test binaries one after another).

mod common;

use common::harness::{bench, mock, within};

#[test]
fn ttft_and_tpot_match_injected_delays_single_stream() {
    let server = mock(200.0, 20.0);
    let r = bench(
        &server,
        &[
            "--num-prompts",
            "6",
            "--max-concurrency",
            "1",
            "--random-output-len",
            "30",
        ],
    );
    assert_eq!(r["completed"], 6);
    assert_eq!(r["max_concurrent_requests"], 1);
    within(r["mean_ttft_ms"].as_f64().unwrap(), 200.0, 0.05, "TTFT");
    within(r["mean_tpot_ms"].as_f64().unwrap(), 20.0, 0.05, "TPOT");
    within(r["median_itl_ms"].as_f64().unwrap(), 20.0, 0.05, "ITL");
    // e2e = ttft + 29 gaps.
    within(
        r["mean_e2el_ms"].as_f64().unwrap(),
        200.0 + 29.0 * 20.0,
        0.05,
        "E2EL",
    );
    assert_eq!(r["total_output_tokens"], 180);
    assert_eq!(r["output_lens"].as_array().unwrap().len(), 6);
    assert_eq!(
        r["itls"][0].as_array().unwrap().len(),
        29,
        "one ITL per chunk after the first"
    );
}

/// 256 streams need an optimized client and mock: an unoptimized build on a small machine spends
/// more time per chunk than the 5% budget. Run with `cargo test --release -p voltllm-bench`.
#[test]
#[cfg_attr(debug_assertions, ignore = "timing at 256 streams needs --release")]
fn ttft_and_tpot_match_injected_delays_256_streams() {
    let server = mock(300.0, 30.0);
    // The warm-ups open the 256 pooled connections the measured run reuses, so TCP setup (and a
    // SYN-backlog overflow on the server, which costs a 1 s retransmit) stays out of the TTFTs.
    let r = bench(
        &server,
        &[
            "--num-warmups",
            "256",
            "--num-prompts",
            "256",
            "--max-concurrency",
            "256",
            "--random-output-len",
            "24",
            "--backend",
            "openai-chat",
        ],
    );
    assert_eq!(r["completed"], 256);
    assert_eq!(r["failed"], 0);
    assert!(
        r["max_concurrent_requests"].as_u64().unwrap() >= 200,
        "streams really overlapped: {}",
        r["max_concurrent_requests"]
    );
    within(r["mean_ttft_ms"].as_f64().unwrap(), 300.0, 0.05, "TTFT");
    within(r["mean_tpot_ms"].as_f64().unwrap(), 30.0, 0.05, "TPOT");
    // A p99 over 256 streams is the slowest 3 of them: on a 2-core CI machine, where the client and
    // the mock share the cores, that tail also holds the OS scheduler's delays (a clean CI run
    // measured +5.6% TTFT once, the recorded run +3.5%). The means above keep the 5% bound.
    within(r["p99_ttft_ms"].as_f64().unwrap(), 300.0, 0.10, "P99 TTFT");
    within(r["p99_tpot_ms"].as_f64().unwrap(), 30.0, 0.10, "P99 TPOT");
}
