//! Overload (issue 22): a full admission queue answers 503 with `Retry-After` at once and the bound
//! shows in the metrics; a request that could never be admitted is a 400; a client's own timeout
//! (the OpenAI SDK's `timeout=`, which vLLM also leaves to the client) ends its engine request.

mod common;

use std::time::{Duration, Instant};

use common::{harness, Harness};
use futures::StreamExt;
use serde_json::json;

/// The value of the sample of metric `name` whose labels contain `label` (`""`: any).
async fn metric(h: &Harness, name: &str, label: &str) -> f64 {
    let (_, text) = h.get("/metrics").await;
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| line.split(['{', ' ']).next() == Some(name) && line.contains(label))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} {label} in\n{text}"))
}

async fn wait_for_metric(h: &Harness, name: &str, value: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(h, name, "").await != value {
        assert!(Instant::now() < deadline, "{name} never reached {value}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_503_at_once_and_every_bound_has_a_metric() {
    // The engine runs 2 and 1 may wait: capacity 3.
    let h = harness("overload", |config, mock| {
        config.max_waiting_requests = 1;
        mock.max_num_seqs = 2;
        mock.step_interval = Duration::from_millis(50);
    })
    .await;
    assert_eq!(metric(&h, "voltllm:request_capacity", "").await, 3.0);
    let long = json!({"prompt": "one two", "max_tokens": 200, "stream": true, "ignore_eos": true});
    let mut held = Vec::new();
    for _ in 0..3 {
        let r = h
            .http
            .post(format!("{}/v1/completions", h.base))
            .json(&long)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        held.push(r.bytes_stream());
    }
    wait_for_metric(&h, "voltllm:requests_admitted", 3.0).await;

    let asked = Instant::now();
    let r = h
        .http
        .post(format!("{}/v1/completions", h.base))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert!(
        asked.elapsed() < Duration::from_millis(500),
        "503 not at once"
    );
    assert_eq!(r.headers()["retry-after"], "1");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "ServiceUnavailableError");
    assert_eq!(
        metric(&h, "voltllm:requests_rejected_total", "reason=\"capacity\"").await,
        1.0
    );

    // More choices than the server ever admits can never succeed: 400, not a 503 to retry.
    let (status, body) = h
        .post(
            "/v1/completions",
            json!({"prompt": "one", "max_tokens": 2, "n": 4}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "n");

    // A body over the limit is counted too.
    let big = "x".repeat(33 << 20);
    let (status, _) = h
        .post("/v1/completions", json!({"prompt": big, "max_tokens": 1}))
        .await;
    assert_eq!(status, 413);
    assert_eq!(
        metric(
            &h,
            "voltllm:requests_rejected_total",
            "reason=\"body_too_large\""
        )
        .await,
        1.0
    );
    for name in [
        "voltllm:requests_dropped_slow_reader_total",
        "voltllm:engine_restarts_total",
    ] {
        assert_eq!(metric(&h, name, "").await, 0.0, "{name}");
    }

    // Streams that end hand their places back.
    drop(held);
    wait_for_metric(&h, "voltllm:requests_admitted", 0.0).await;
    let (status, _) = h
        .post("/v1/completions", json!({"prompt": "one", "max_tokens": 2}))
        .await;
    assert_eq!(status, 200);
    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_timeout_ends_its_request_in_the_engine() {
    let h = harness("timeout", |_, mock| {
        mock.step_interval = Duration::from_millis(20)
    })
    .await;
    // Non-streaming: nothing is written until the end, so only the closed connection tells.
    let r = h
        .http
        .post(format!("{}/v1/chat/completions", h.base))
        .timeout(Duration::from_millis(300))
        .json(
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                      "ignore_eos": true}),
        )
        .send()
        .await;
    assert!(r.is_err_and(|e| e.is_timeout()));
    let engine = h.engine.as_ref().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while engine.log().aborted.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the engine never saw ABORT after the client gave up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(engine.log().aborted[0].starts_with("chatcmpl-"));
    wait_for_metric(&h, "voltllm:requests_admitted", 0.0).await;
    // Streaming, with the SDK-style read timeout: the stream is dropped mid-answer.
    let r = h
        .http
        .post(format!("{}/v1/completions", h.base))
        .json(&json!({"prompt": "one two", "max_tokens": 200, "stream": true, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    let mut body = r.bytes_stream();
    assert!(body.next().await.is_some());
    drop(body);
    wait_for_metric(&h, "voltllm:requests_admitted", 0.0).await;
    assert_eq!(engine.log().aborted.len(), 2);
    h.shutdown().await.unwrap();
}
