//! Helpers shared by the integration tests: run the harness binary against a mock server.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use super::mock_server::{MockConfig, MockServer};

/// The SmolLM2 tokenizer fixture.
pub fn tokenizer() -> PathBuf {
    Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("run under cargo"))
        .join("../../tests/fixtures/smollm2/tokenizer.json")
}

/// A mock server with the given delays on its own runtime.
pub fn mock(ttft_ms: f64, tpot_ms: f64) -> MockServer {
    MockServer::start(
        MockConfig {
            model: "mock-model".into(),
            ttft_ms,
            tpot_ms,
        },
        0,
        2,
    )
}

/// Runs the binary; returns (exit code, stdout, stderr).
pub fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_voltllm-bench"))
        .arg("serve")
        .args(args)
        .output()
        .expect("spawn");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs a benchmark against `server` and returns the saved result.
pub fn bench(server: &MockServer, extra: &[&str]) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let base = server.base_url();
    let tok = tokenizer();
    let mut args = vec![
        "--base-url",
        &base,
        "--tokenizer",
        tok.to_str().unwrap(),
        "--random-input-len",
        "16",
        "--save-result",
        "--result-dir",
        dir.path().to_str().unwrap(),
        "--result-filename",
        "r.json",
        "--disable-tqdm",
    ];
    args.extend_from_slice(extra);
    let (code, stdout, stderr) = run(&args);
    assert_eq!(code, 0, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("Serving Benchmark Result"), "{stdout}");
    serde_json::from_slice(&std::fs::read(dir.path().join("r.json")).unwrap()).unwrap()
}

/// Asserts a relative error of at most `tol`.
pub fn within(measured: f64, expected: f64, tol: f64, what: &str) {
    let err = (measured - expected).abs() / expected;
    assert!(
        err <= tol,
        "{what}: measured {measured:.2} ms vs injected {expected:.2} ms ({:.1}% off)",
        err * 100.0
    );
}
