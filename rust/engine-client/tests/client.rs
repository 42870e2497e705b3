//! The engine client against the in-process mock engine over real ZeroMQ sockets.

use std::time::Duration;

use voltllm_engine_client::mock::{MockEngine, MockEngineConfig};
use voltllm_engine_client::{EngineClient, EngineClientConfig, EngineClientError};
use voltllm_protocol::{EngineCoreRequest, FinishReason, SamplingParams};

fn addresses(tag: &str) -> (String, String) {
    let base = format!("ipc:///tmp/voltllm-ec-test-{}-{tag}", std::process::id());
    (format!("{base}-in"), format!("{base}-out"))
}

async fn setup(tag: &str, pid: Option<u32>) -> (EngineClient, MockEngine) {
    let (input, output) = addresses(tag);
    let mut cfg = EngineClientConfig::new(&input, &output);
    cfg.ready_timeout = Duration::from_secs(10);
    cfg.pid_poll_interval = Some(Duration::from_millis(100));
    let client = tokio::spawn(EngineClient::connect(cfg));
    let mut mock_cfg = MockEngineConfig::new(&input, &output);
    if let Some(pid) = pid {
        mock_cfg.pid = pid;
    }
    // The client binds first; give it a moment so the engine's connect finds the endpoint.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let engine = MockEngine::start(mock_cfg).await.unwrap();
    (client.await.unwrap().unwrap(), engine)
}

fn request(id: &str, prompt: Vec<u32>, max_tokens: u32) -> EngineCoreRequest {
    EngineCoreRequest {
        request_id: id.into(),
        prompt_token_ids: prompt,
        sampling_params: SamplingParams {
            max_tokens,
            ..Default::default()
        },
        arrival_time: 0.0,
        priority: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_tokens_until_length() {
    let (client, _engine) = setup("len", None).await;
    assert_eq!(client.max_model_len(), 2048);
    let mut stream = client.add_request(request("a", vec![5, 6, 7], 5)).unwrap();
    let mut tokens = Vec::new();
    let mut finish = None;
    while let Some(out) = stream.next_output().await {
        let out = out.unwrap();
        tokens.extend(out.new_token_ids);
        finish = out.finish_reason;
    }
    assert_eq!(tokens, vec![5, 6, 7, 5, 6]);
    assert_eq!(finish, Some(FinishReason::Length));
    assert_eq!(client.num_in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eos_stops_and_engine_errors_reach_the_stream() {
    let (client, _engine) = setup("eos", None).await;
    let mut s = client
        .add_request(request("eos", vec![9, 2, 9], 50))
        .unwrap();
    let mut last = None;
    while let Some(out) = s.next_output().await {
        last = Some(out.unwrap());
    }
    let last = last.unwrap();
    assert_eq!(last.finish_reason, Some(FinishReason::Stop));
    assert_eq!(last.stop_reason, Some(2));

    let mut s = client.add_request(request("empty", vec![], 5)).unwrap();
    let out = s.next_output().await.unwrap().unwrap();
    assert_eq!(out.finish_reason, Some(FinishReason::Error));
    assert_eq!(out.error.as_deref(), Some("prompt is empty"));

    let _live = client.add_request(request("dup", vec![1], 1000)).unwrap();
    assert!(matches!(
        client.add_request(request("dup", vec![1], 5)),
        Err(EngineClientError::DuplicateRequestId(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_stream_aborts_in_the_engine() {
    let (client, engine) = setup("drop", None).await;
    let mut s = client
        .add_request(request("gone", vec![1, 3], 100_000))
        .unwrap();
    s.next_output().await.unwrap().unwrap();
    drop(s);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !engine.log().aborted.contains(&"gone".to_string()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "engine never saw ABORT"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(client.num_in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_message_fails_streams_and_health() {
    let (client, engine) = setup("dead", None).await;
    let mut s = client
        .add_request(request("x", vec![1, 3], 100_000))
        .unwrap();
    s.next_output().await.unwrap().unwrap();
    engine.die("out of memory").await;
    let err = loop {
        match tokio::time::timeout(Duration::from_secs(5), s.next_output())
            .await
            .unwrap()
        {
            Some(Ok(_)) => continue,
            Some(Err(e)) => break e,
            None => panic!("stream ended without an error"),
        }
    };
    assert!(matches!(err, EngineClientError::EngineDead { .. }), "{err}");
    assert!(err.to_string().contains("out of memory"));
    assert!(!client.is_healthy());
    assert!(client.wait_dead().await.contains("out of memory"));
    assert!(client.add_request(request("y", vec![1], 5)).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_engine_process_is_noticed_by_pid() {
    let mut stand_in = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let (client, _engine) = setup("pid", Some(stand_in.id())).await;
    let mut s = client
        .add_request(request("x", vec![1, 3], 100_000))
        .unwrap();
    s.next_output().await.unwrap().unwrap();
    assert!(client.is_healthy());
    stand_in.kill().unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(3), client.wait_dead())
        .await
        .expect("death noticed within the poll interval");
    assert!(reason.contains("exited"), "{reason}");
    let err = loop {
        match s.next_output().await {
            Some(Ok(_)) => continue,
            Some(Err(e)) => break e,
            None => panic!("stream ended without an error"),
        }
    };
    assert!(matches!(err, EngineClientError::EngineDead { .. }));
    stand_in.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_timeout_is_a_clear_error() {
    let (input, output) = addresses("timeout");
    let mut cfg = EngineClientConfig::new(input, output);
    cfg.ready_timeout = Duration::from_millis(200);
    let err = EngineClient::connect(cfg).await.err().unwrap();
    assert!(matches!(err, EngineClientError::ReadyTimeout { ref missing, .. } if missing == &[0]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn utility_ping() {
    let (client, _engine) = setup("util", None).await;
    let v = client.utility(0, "ping", vec![]).await.unwrap();
    assert_eq!(v.as_str(), Some("pong"));
    assert!(client.utility(0, "nope", vec![]).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_that_dies_during_startup_fails_connect_fast() {
    let (input, output) = addresses("startup");
    let mut starting = std::process::Command::new("sleep")
        .arg("0.3")
        .spawn()
        .unwrap();
    let mut cfg = EngineClientConfig::new(input, output);
    cfg.ready_timeout = Duration::from_secs(60);
    cfg.startup_pids = vec![starting.id()];
    let begun = std::time::Instant::now();
    let err = EngineClient::connect(cfg).await.err().unwrap();
    assert!(begun.elapsed() < Duration::from_secs(5));
    assert!(
        err.to_string().contains("exited before sending READY"),
        "{err}"
    );
    starting.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_go_to_the_least_loaded_engine() {
    let (input, output) = addresses("two");
    let mut cfg = EngineClientConfig::new(&input, &output);
    cfg.num_engines = 2;
    cfg.ready_timeout = Duration::from_secs(10);
    let client = tokio::spawn(EngineClient::connect(cfg));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut engines = Vec::new();
    for index in 0..2 {
        let mut mock = MockEngineConfig::new(&input, &output);
        mock.engine_index = index;
        mock.step_interval = Duration::from_millis(20);
        engines.push(MockEngine::start(mock).await.unwrap());
    }
    let client = client.await.unwrap().unwrap();
    assert_eq!(client.engines().len(), 2);
    // Four long requests spread 2 + 2; after two finish on one engine, it takes the next ones.
    let mut live: Vec<_> = (0..4)
        .map(|i| {
            client
                .add_request(request(&format!("r{i}"), vec![1, 3], 100_000))
                .unwrap()
        })
        .collect();
    for s in &mut live {
        s.next_output().await.unwrap().unwrap();
    }
    let counts: Vec<usize> = engines.iter().map(|e| e.log().added.len()).collect();
    assert_eq!(counts, vec![2, 2]);
    // Free engine 0's two requests (r0 and r2 went there, alternating), then add two more.
    let on_zero: Vec<String> = engines[0]
        .log()
        .added
        .iter()
        .map(|r| r.request_id.clone())
        .collect();
    live.retain(|s| !on_zero.contains(&s.request_id().to_string()));
    for i in 4..6 {
        let mut s = client
            .add_request(request(&format!("r{i}"), vec![1, 3], 100_000))
            .unwrap();
        s.next_output().await.unwrap().unwrap();
        live.push(s);
    }
    assert_eq!(engines[0].log().added.len(), 4);
    assert_eq!(engines[1].log().added.len(), 2);
}
