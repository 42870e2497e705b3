//! End-to-end checks of `voltllm-bench serve` against the mock server: results carry the documented
//! keys, load shapes behave, and bad input ends in one clear error line with a non-zero exit.

mod common;

use common::harness::{bench, mock, run, tokenizer};
use serde_json::Value;

#[test]
fn rate_limited_run_reports_goodput_and_server_metrics() {
    let server = mock(50.0, 5.0);
    let r = bench(
        &server,
        &[
            "--num-prompts",
            "40",
            "--request-rate",
            "40",
            "--random-output-len",
            "8",
            "--goodput",
            "ttft:1000",
            "tpot:1",
            "--num-warmups",
            "3",
            "--metric-percentiles",
            "50,90,99",
        ],
    );
    assert_eq!(r["completed"], 40);
    assert_eq!(r["num_warmups"], 3);
    // 40 requests at 40 req/s: the last is sent at t = 1 s (rescaled), so the run takes ~1.09 s.
    let d = r["duration"].as_f64().unwrap();
    assert!((1.0..2.0).contains(&d), "duration {d}");
    assert_eq!(r["request_goodput"], 0.0, "tpot 5 ms misses a 1 ms SLO");
    assert!(r["p90_ttft_ms"].is_number());
    // Warm-ups run before the first /metrics scrape, so the delta counts exactly the 40 measured.
    assert_eq!(r["server_metrics"]["delta"]["mock_requests_total"], 40.0);
}

#[test]
fn sweep_writes_one_document_per_point_and_a_curve() {
    let server = mock(20.0, 2.0);
    let dir = tempfile::tempdir().unwrap();
    let (base, tok) = (server.base_url(), tokenizer());
    let (code, stdout, stderr) = run(&[
        "--base-url",
        &base,
        "--tokenizer",
        tok.to_str().unwrap(),
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
        "--num-prompts",
        "12",
        "--sweep",
        "max_concurrency=1,4",
        "--save-result",
        "--result-dir",
        dir.path().to_str().unwrap(),
        "--result-filename",
        "s.json",
        "--disable-tqdm",
    ]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let doc: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("s-sweep.json")).unwrap()).unwrap();
    assert_eq!(doc["sweep_parameter"], "max_concurrency");
    let runs = doc["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[1]["max_concurrency"], 4);
    assert!(
        runs[1]["request_throughput"].as_f64().unwrap()
            > runs[0]["request_throughput"].as_f64().unwrap()
    );
    assert!(dir.path().join("s-infqps-c1.json").is_file());
}

#[test]
fn duration_mode_keeps_sending_until_the_deadline() {
    let server = mock(10.0, 1.0);
    let r = bench(
        &server,
        &[
            "--num-prompts",
            "5",
            "--duration",
            "1",
            "--max-concurrency",
            "4",
            "--random-output-len",
            "4",
        ],
    );
    // Each request takes ~13 ms, 4 at a time → far more than the 5 distinct prompts in 1 s.
    assert!(r["completed"].as_u64().unwrap() > 50, "{}", r["completed"]);
    assert_eq!(r["failed"], 0);
}

fn assert_one_error_line(code: i32, stderr: &str, needle: &str) {
    assert_eq!(code, 1, "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {stderr}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(needle),
        "{stderr}"
    );
}

#[test]
fn unreachable_server_is_one_clear_line() {
    // A port that was just free: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let (code, _, stderr) = run(&[
        "--base-url",
        &url,
        "--tokenizer",
        tokenizer().to_str().unwrap(),
    ]);
    assert_one_error_line(code, &stderr, "cannot reach server");
}

#[test]
fn wrong_model_is_one_clear_line() {
    let server = mock(0.0, 0.0);
    let (code, _, stderr) = run(&[
        "--base-url",
        &server.base_url(),
        "--model",
        "nope",
        "--tokenizer",
        tokenizer().to_str().unwrap(),
    ]);
    assert_one_error_line(code, &stderr, "model 'nope' is not served");
    assert!(
        stderr.contains("mock-model"),
        "lists what is served: {stderr}"
    );
}

#[test]
fn malformed_dataset_is_one_clear_line() {
    let server = mock(0.0, 0.0);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sharegpt.json");
    std::fs::write(&path, "[{\"conversations\": [").unwrap();
    let (code, _, stderr) = run(&[
        "--base-url",
        &server.base_url(),
        "--tokenizer",
        tokenizer().to_str().unwrap(),
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        path.to_str().unwrap(),
    ]);
    assert_one_error_line(code, &stderr, "malformed dataset");
}

#[test]
fn bad_flags_exit_non_zero() {
    let (code, _, stderr) = run(&["--goodput", "ttft=5", "--tokenizer", "x"]);
    assert_one_error_line(code, &stderr, "--goodput");
    let (code, _, _) = run(&["--no-such-flag"]);
    assert_eq!(code, 2);
    let (code, _, stderr) = run(&[
        "--base-url",
        "http://127.0.0.1:1",
        "--tokenizer",
        "/nonexistent/tok.json",
    ]);
    assert_eq!(code, 1, "{stderr}");
}

#[test]
fn run_cli_is_callable_as_a_library() {
    let server = mock(0.0, 0.0);
    let code = voltllm_bench::run_cli(
        [
            "voltllm bench",
            "serve",
            "--base-url",
            &server.base_url(),
            "--tokenizer",
            tokenizer().to_str().unwrap(),
            "--num-prompts",
            "3",
            "--random-input-len",
            "4",
            "--random-output-len",
            "2",
            "--disable-tqdm",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
    );
    assert_eq!(code, 0);
}
