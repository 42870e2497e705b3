//! The test harness the server's integration tests share: a `Server` on a free port in front of the
//! mock engine over real ZeroMQ sockets, and small HTTP helpers.

// Each test binary uses a subset of the helpers.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;
use tokio::task::JoinHandle;
use voltllm_engine_client::mock::{MockEngine, MockEngineConfig};
use voltllm_server::{Server, ServerConfig, ServerError};
use voltllm_text::Tokenizer;

pub fn model_dir() -> PathBuf {
    PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("run under cargo"))
        .join("../../tests/fixtures/smollm2")
}

pub struct Harness {
    pub base: String,
    pub http: reqwest::Client,
    pub engine: Option<MockEngine>,
    pub server: JoinHandle<Result<(), ServerError>>,
    pub stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub tokenizer: Tokenizer,
}

pub async fn harness(
    tag: &str,
    tweak: impl FnOnce(&mut ServerConfig, &mut MockEngineConfig),
) -> Harness {
    let base = format!("ipc:///tmp/voltllm-srv-test-{}-{tag}", std::process::id());
    let (input, output) = (format!("{base}-in"), format!("{base}-out"));
    let mut config = ServerConfig::new(model_dir(), &input, &output);
    config.port = 0;
    config.served_model_name = vec!["smol".into()];
    config.engine_ready_timeout = Duration::from_secs(20);
    config.engine_death_grace = Duration::from_millis(1500);
    config.engine_pid_poll_interval = Some(Duration::from_millis(100));
    let mut mock = MockEngineConfig::new(&input, &output);
    mock.max_model_len = 256;
    tweak(&mut config, &mut mock);
    let starting = tokio::spawn(Server::start(config));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let engine = MockEngine::start(mock).await.unwrap();
    let server = starting.await.unwrap().unwrap();
    let addr = server.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(server.run(async move {
        let _ = stopped.await;
    }));
    Harness {
        base: format!("http://{addr}"),
        http: reqwest::Client::new(),
        engine: Some(engine),
        server,
        stop: Some(stop),
        tokenizer: Tokenizer::from_model_dir(model_dir()).unwrap(),
    }
}

impl Harness {
    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    /// All SSE `data:` payloads of a streaming request.
    pub async fn sse(&self, path: &str, body: Value) -> Vec<String> {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        text.lines()
            .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
            .collect()
    }

    /// Text the mock generates for a prompt: its ids repeated, `k` tokens, decoded.
    pub fn echo_text(&self, prompt_ids: &[u32], k: usize) -> String {
        let ids: Vec<u32> = prompt_ids.iter().cycle().take(k).copied().collect();
        self.tokenizer.decode(&ids, true).unwrap()
    }

    pub async fn shutdown(mut self) -> Result<(), ServerError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.server.await.unwrap()
    }
}
