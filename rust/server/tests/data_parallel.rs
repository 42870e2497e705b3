//! Two engines behind one server (issue 18), against the mock engine: `/metrics` labels every
//! per-engine series by engine and shows the spread; when one engine dies its streams end with an
//! error, `/health` reports the loss as degraded while the other serves, and the server only exits
//! once the last engine is gone.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};
use voltllm_engine_client::mock::{MockEngine, MockEngineConfig};
use voltllm_server::{Server, ServerConfig, ServerError};

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2")
}

/// The value of `name` per `engine` label (its other labels summed over).
fn per_engine(metrics: &str, name: &str) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let (labels, value) = rest.split_once("} ").unwrap();
        let engine = labels
            .split(',')
            .find_map(|l| l.strip_prefix("engine=\""))
            .unwrap_or_else(|| panic!("no engine label: {line}"))
            .trim_end_matches('"')
            .to_string();
        *out.entry(engine).or_default() += value.parse::<f64>().unwrap();
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_split_the_load_and_one_death_degrades_but_serves() {
    let base = format!("ipc:///tmp/voltllm-srv-dp-{}", std::process::id());
    let (input, output) = (format!("{base}-in"), format!("{base}-out"));
    let mut config = ServerConfig::new(model_dir(), &input, &output);
    config.port = 0;
    config.num_engines = 2;
    config.engine_ready_timeout = Duration::from_secs(20);
    config.engine_death_grace = Duration::from_millis(500);
    let starting = tokio::spawn(Server::start(config));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut engines = Vec::new();
    for index in 0..2 {
        let mut mock = MockEngineConfig::new(&input, &output);
        mock.engine_index = index;
        mock.max_model_len = 256;
        mock.step_interval = Duration::from_millis(5);
        engines.push(MockEngine::start(mock).await.unwrap());
    }
    let server = starting.await.unwrap().unwrap();
    let url = format!("http://{}", server.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(server.run(async move {
        let _ = stopped.await;
    }));
    let http = reqwest::Client::new();
    let metrics = || async {
        let r = http.get(format!("{url}/metrics")).send().await.unwrap();
        r.text().await.unwrap()
    };
    let complete = |prompt: String, max_tokens: u32| {
        let request = http
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": prompt, "max_tokens": max_tokens}));
        async move {
            let r = request.send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };

    // Every engine's series exist before it ran anything.
    let m = metrics().await;
    for name in [
        "vllm:request_success_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "voltllm:engine_up",
        "voltllm:engine_requests_in_flight",
        "voltllm:engine_restarts_total",
    ] {
        let values = per_engine(&m, name);
        assert_eq!(values.len(), 2, "{name}: {values:?}\n{m}");
    }
    assert!(m.contains("vllm:time_to_first_token_seconds_bucket{"));

    // 32 concurrent requests: 16 on each engine.
    let results =
        futures::future::join_all((0..32).map(|i| complete(format!("request {i}"), 20))).await;
    assert!(results.iter().all(|(status, _)| *status == 200));
    let m = metrics().await;
    let spread = per_engine(&m, "vllm:request_success_total");
    assert_eq!(spread["0"] + spread["1"], 32.0);
    assert!((spread["0"] - 16.0).abs() <= 2.0, "{spread:?}");
    let up = per_engine(&m, "voltllm:engine_up");
    assert_eq!((up["0"], up["1"]), (1.0, 1.0));
    let added: Vec<usize> = engines.iter().map(|e| e.log().added.len()).collect();
    assert_eq!(added, vec![spread["0"] as usize, spread["1"] as usize]);

    // Engine 1 dies: the server degrades, answers 200 on /health with the report, and serves.
    engines.remove(1).die("out of memory").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let report: Value = loop {
        let health = http.get(format!("{url}/health")).send().await.unwrap();
        assert_eq!(health.status(), 200);
        let body = health.text().await.unwrap();
        if !body.is_empty() {
            break serde_json::from_str(&body).unwrap();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the death never showed in /health"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(report["status"], "degraded");
    assert_eq!(report["engines"][0]["state"], "serving");
    assert_eq!(report["engines"][1]["state"], "lost");
    assert!(report["engines"][1]["reason"]
        .as_str()
        .unwrap()
        .contains("out of memory"));
    for i in 0..8 {
        let (status, body) = complete(format!("after {i}"), 3).await;
        assert_eq!(status, 200, "{body}");
    }
    let m = metrics().await;
    assert_eq!(per_engine(&m, "voltllm:engine_up")["1"], 0.0);
    assert_eq!(
        per_engine(&m, "vllm:request_success_total")["0"],
        spread["0"] + 8.0
    );

    // The last engine's death ends the server.
    engines.remove(0).die("gone too").await;
    let result = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap();
    match result {
        Err(ServerError::EngineDied(reason)) => assert!(reason.contains("gone too"), "{reason}"),
        other => panic!("expected EngineDied, got {other:?}"),
    }
    drop(stop);
}
