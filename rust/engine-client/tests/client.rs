//! The engine client against the in-process mock engine over real ZeroMQ sockets.

use std::time::Duration;

use voltllm_engine_client::mock::{MockEngine, MockEngineConfig};
use voltllm_engine_client::{
    EngineClient, EngineClientConfig, EngineClientError, EngineHealth, EngineState,
};
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

async fn two_engines(tag: &str) -> (EngineClient, Vec<MockEngine>) {
    let (input, output) = addresses(tag);
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
    (client.await.unwrap().unwrap(), engines)
}

/// The ids each engine received, in order.
fn added(engine: &MockEngine) -> Vec<String> {
    engine
        .log()
        .added
        .iter()
        .map(|r| r.request_id.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_stays_on_the_engine_holding_its_prefix() {
    let (client, engines) = two_engines("affinity").await;
    // Two conversations with their own 48-token system prompts (three 16-token blocks).
    let system = |c: u32| -> Vec<u32> { (0..48).map(|t| 1000 * (c + 1) + t).collect() };
    let mut turns = Vec::new();
    for turn in 0..4u32 {
        for c in 0..2u32 {
            let mut prompt = system(c);
            // Each turn extends the conversation (the earlier turns' tokens come first).
            prompt.extend((0..=turn).flat_map(|t| [7, 8, 9, t]));
            let id = format!("c{c}t{turn}");
            let mut s = client.add_request(request(&id, prompt, 2)).unwrap();
            while let Some(out) = s.next_output().await {
                out.unwrap();
            }
            turns.push((c, s.engine()));
        }
    }
    let home = |c: u32| turns.iter().find(|(cc, _)| *cc == c).unwrap().1;
    assert_ne!(home(0), home(1), "idle engines take turns: {turns:?}");
    for (c, engine) in &turns {
        assert_eq!(
            *engine,
            home(*c),
            "a turn of conversation {c} moved: {turns:?}"
        );
    }
    assert_eq!(added(&engines[home(0)]).len(), 4);
    assert_eq!(added(&engines[home(1)]).len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_prefix_engine_gives_requests_to_the_other() {
    let (client, engines) = two_engines("overload").await;
    let shared: Vec<u32> = (100..164).collect(); // four whole blocks every request shares
    let live: Vec<_> = (0..30)
        .map(|i| {
            client
                .add_request(request(&format!("r{i}"), shared.clone(), 100_000))
                .unwrap()
        })
        .collect();
    let engine_of: Vec<usize> = live.iter().map(|s| s.engine()).collect();
    // The prefix's engine keeps it until it holds more than 8 beyond, and 1.5x, the other's count:
    // the first nine go to one engine, the tenth to the other, which then holds the prefix too.
    assert!(
        engine_of[..9].iter().all(|&e| e == engine_of[0]),
        "{engine_of:?}"
    );
    assert_ne!(engine_of[9], engine_of[0], "{engine_of:?}");
    let in_flight = client.engine_in_flight();
    assert_eq!(in_flight.iter().sum::<usize>(), 30);
    assert!(in_flight.iter().all(|&n| n >= 9), "{in_flight:?}");
    drop(live);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while engines.iter().map(|e| e.log().aborted.len()).sum::<usize>() < 30 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "aborts did not reach the engines"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Each abort went to the engine that had the request.
    for (i, e) in engine_of.iter().enumerate() {
        assert!(engines[*e].log().aborted.contains(&format!("r{i}")), "r{i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_engine_dying_fails_only_its_requests_and_the_other_serves() {
    let (client, mut engines) = two_engines("one-dies").await;
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
    assert_eq!(client.engine_in_flight(), vec![2, 2]);
    let survivor = engines.remove(0);
    engines.remove(0).die("out of memory").await;
    // Engine 1's streams end with its error at once; engine 0's keep going.
    for s in &mut live {
        let ended = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match s.next_output().await {
                    Some(Ok(_)) if s.engine() == 0 => return None,
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => return Some(e),
                    None => panic!("stream ended without an error"),
                }
            }
        })
        .await
        .unwrap();
        match (s.engine(), ended) {
            (0, None) => {}
            (1, Some(e)) => {
                assert!(
                    matches!(
                        e,
                        EngineClientError::EngineDead {
                            engine_index: 1,
                            ..
                        }
                    ),
                    "{e}"
                )
            }
            (engine, e) => panic!("engine {engine}: {e:?}"),
        }
    }
    assert!(!client.is_healthy());
    assert!(client.is_serving());
    assert!(matches!(client.health(), EngineHealth::Degraded(r) if r.contains("engine 1 lost")));
    assert_eq!(
        client.engine_states()[1],
        EngineState::Lost("engine 1: out of memory".into())
    );
    // New requests all go to the survivor.
    for i in 0..4 {
        let mut s = client
            .add_request(request(&format!("n{i}"), vec![4, 5], 3))
            .unwrap();
        assert_eq!(s.engine(), 0);
        while let Some(out) = s.next_output().await {
            out.unwrap();
        }
    }
    assert!(client.utility(1, "ping", vec![]).await.is_err());
    drop(live);
    // The last engine's death ends the client.
    survivor.die("gone too").await;
    assert!(client.wait_dead().await.contains("gone too"));
    assert!(matches!(client.health(), EngineHealth::Dead(_)));
}
