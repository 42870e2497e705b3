//! The HTTP server end to end against the mock engine over real ZeroMQ sockets and real HTTP.
//!
//! The mock echoes the prompt's token ids cyclically, so the expected text of every response is
//! known from the fixture tokenizer (`tests/fixtures/smollm2`).

use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};

mod common;

use common::{harness, Harness};
use voltllm_server::ServerError;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_plain_echo_and_token_prompts() {
    let h = harness("cmpl", |_, _| {}).await;
    let ids = h.tokenizer.encode("one two three four", true).unwrap();
    let (status, body) = h
        .post(
            "/v1/completions",
            json!({"model": "smol", "prompt": "one two three four", "max_tokens": 6,
                   "priority": -2, "seed": 11, "temperature": 0.5}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["text"], h.echo_text(&ids, 6));
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["prompt_tokens"], ids.len());
    assert_eq!(body["usage"]["completion_tokens"], 6);
    // What reached the engine: resolved sampling parameters and the priority.
    let sent = h.engine.as_ref().unwrap().log().added.pop().unwrap();
    assert_eq!(sent.prompt_token_ids, ids);
    assert_eq!(sent.priority, -2);
    assert_eq!(sent.sampling_params.max_tokens, 6);
    assert_eq!(sent.sampling_params.seed, Some(11));
    assert_eq!(sent.sampling_params.temperature, 0.5);

    // Several token-id prompts, echo on: choice i answers prompt i, prefixed with its text.
    let (status, body) = h
        .post(
            "/v1/completions",
            json!({"prompt": [[537, 827], [1296]], "max_tokens": 3, "echo": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let c = body["choices"].as_array().unwrap();
    assert_eq!(c.len(), 2);
    assert_eq!(
        c[0]["text"],
        "one two".to_string() + &h.echo_text(&[537, 827], 3)
    );
    assert_eq!(
        c[1]["text"],
        " three".to_string() + &h.echo_text(&[1296], 3)
    );
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    assert_eq!(body["usage"]["completion_tokens"], 6);

    // Logprobs: the mock reports -0.25 for the sampled token and N alternatives.
    let (_, body) = h
        .post(
            "/v1/completions",
            json!({"prompt": [537, 827], "max_tokens": 2, "logprobs": 2}),
        )
        .await;
    let lp = &body["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"], json!(["one", " two"]));
    assert_eq!(lp["token_logprobs"], json!([-0.25, -0.25]));
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streaming_with_n_and_usage() {
    let h = harness("chat", |_, _| {}).await;
    let messages = json!([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]);
    let (status, tok) = h.post("/tokenize", json!({"messages": messages})).await;
    assert_eq!(status, 200, "{tok}");
    let prompt: Vec<u32> = serde_json::from_value(tok["tokens"].clone()).unwrap();
    assert_eq!(tok["count"], prompt.len());

    let events = h
        .sse(
            "/v1/chat/completions",
            json!({"model": "smol", "messages": messages, "max_tokens": 5, "n": 2, "stream": true,
                   "stream_options": {"include_usage": true}, "store": false}),
        )
        .await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    // Role chunks first, one per choice.
    for (i, c) in chunks[..2].iter().enumerate() {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["choices"][0]["index"], i);
        assert_eq!(c["choices"][0]["delta"]["role"], "assistant");
    }
    let mut text = [String::new(), String::new()];
    let mut finish = [Value::Null, Value::Null];
    for c in &chunks[2..chunks.len() - 1] {
        let choice = &c["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        text[i] += choice["delta"]["content"].as_str().unwrap_or("");
        if !choice["finish_reason"].is_null() {
            finish[i] = choice["finish_reason"].clone();
        }
    }
    let expected = h.echo_text(&prompt, 5);
    assert_eq!(text, [expected.clone(), expected]);
    assert_eq!(finish, [json!("length"), json!("length")]);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 10);
    assert_eq!(usage["prompt_tokens"], prompt.len());

    // Non-streaming: the template's <|im_end|> (id 2, the mock's EOS) ends the echo; its text is hidden.
    let (status, body) = h
        .post(
            "/v1/chat/completions",
            json!({"messages": messages, "max_completion_tokens": 200}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["stop_reason"], 2);
    let eos_at = prompt.iter().position(|&t| t == 2).unwrap();
    assert_eq!(choice["message"]["content"], h.echo_text(&prompt, eos_at));
    assert_eq!(body["usage"]["completion_tokens"], eos_at + 1);
    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_string_across_tokens_ends_and_aborts() {
    let h = harness("stop", |_, _| {}).await;
    // Generated text: "one two three four one two ..."; "o thr" spans " two" and " three".
    for stream in [false, true] {
        let body = json!({"prompt": "one two three four", "max_tokens": 50, "stop": ["o thr", "zzz"], "stream": stream});
        let text = if stream {
            let events = h.sse("/v1/completions", body).await;
            let mut text = String::new();
            let mut finish = Value::Null;
            for e in &events[..events.len() - 1] {
                let v: Value = serde_json::from_str(e).unwrap();
                text += v["choices"][0]["text"].as_str().unwrap();
                if !v["choices"][0]["finish_reason"].is_null() {
                    finish = v["choices"][0]["finish_reason"].clone();
                    assert_eq!(v["choices"][0]["stop_reason"], "o thr");
                }
            }
            assert_eq!(finish, "stop");
            text
        } else {
            let (status, body) = h.post("/v1/completions", body).await;
            assert_eq!(status, 200);
            assert_eq!(body["choices"][0]["finish_reason"], "stop");
            assert_eq!(body["choices"][0]["stop_reason"], "o thr");
            assert_eq!(body["usage"]["completion_tokens"], 3);
            body["choices"][0]["text"].as_str().unwrap().to_string()
        };
        assert_eq!(text, "one tw");
    }
    // The engine was told to stop generating.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while h.engine.as_ref().unwrap().log().aborted.len() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "engine never saw ABORT after stop strings"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // include_stop_str_in_output keeps the matched stop string.
    let (_, body) = h
        .post("/v1/completions", json!({"prompt": "one two three four", "max_tokens": 50, "stop": "o thr", "include_stop_str_in_output": true}))
        .await;
    assert_eq!(body["choices"][0]["text"], "one two thr");
    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_aborts_in_the_engine() {
    let h = harness("disconnect", |_, m| {
        m.step_interval = Duration::from_millis(20)
    })
    .await;
    let r = h
        .http
        .post(format!("{}/v1/completions", h.base))
        .json(&json!({"prompt": "one two", "max_tokens": 200, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = r.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(std::str::from_utf8(&first).unwrap().starts_with("data: "));
    drop(body);
    let engine = h.engine.as_ref().unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while engine.log().aborted.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "engine never saw ABORT after disconnect"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(engine.log().aborted[0].starts_with("cmpl-"));
    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_death_fails_streams_turns_health_503_and_exits() {
    let mut h = harness("death", |_, m| m.step_interval = Duration::from_millis(20)).await;
    assert_eq!(h.get("/health").await.0, 200);
    let r = h
        .http
        .post(format!("{}/v1/chat/completions", h.base))
        .json(&json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200, "stream": true, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    let reader = tokio::spawn(async move { r.text().await.unwrap() });
    tokio::time::sleep(Duration::from_millis(100)).await;
    h.engine.take().unwrap().die("CUDA out of memory").await;
    let text = tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .unwrap()
        .unwrap();
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(*events.last().unwrap(), "[DONE]");
    let error: Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("CUDA out of memory"),
        "{error}"
    );

    let (status, body) = h.get("/health").await;
    assert_eq!(status, 503, "{body}");
    let (status, body) = h
        .post("/v1/completions", json!({"prompt": "x", "max_tokens": 2}))
        .await;
    assert_eq!(status, 503);
    assert_eq!(body["error"]["type"], "ServiceUnavailableError");
    // The server exits on its own with the reason (the binary turns this into a non-zero exit).
    let result = tokio::time::timeout(Duration::from_secs(10), h.server)
        .await
        .unwrap()
        .unwrap();
    match result {
        Err(ServerError::EngineDied(reason)) => assert!(reason.contains("CUDA out of memory")),
        other => panic!("expected EngineDied, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors() {
    let h = harness("bad", |c, m| {
        c.api_key = Some("sekret".into());
        c.max_waiting_requests = 0;
        c.max_request_body_bytes = 4096;
        m.max_num_seqs = 1;
        m.step_interval = Duration::from_millis(20);
    })
    .await;
    let auth = |r: reqwest::RequestBuilder| r.bearer_auth("sekret");
    let post = |path: &str, body: Value| {
        auth(h.http.post(format!("{}{path}", h.base)))
            .json(&body)
            .send()
    };

    // Auth: /health is open, everything else needs the key.
    assert_eq!(h.get("/health").await.0, 200);
    let (status, body) = h.post("/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(status, 401);
    assert_eq!(body["error"]["type"], "AuthenticationError");
    assert_eq!(h.get("/v1/models").await.0, 401);

    for (body, code, param) in [
        (
            json!({"prompt": "x", "temperature": -1}),
            400,
            Some("temperature"),
        ),
        (json!({"prompt": "x", "top_p": 2}), 400, Some("top_p")),
        (
            json!({"prompt": "x", "max_tokens": 0}),
            400,
            Some("max_tokens"),
        ),
        (
            json!({"prompt": "x", "max_tokens": 1000}),
            400,
            Some("max_tokens"),
        ),
        (json!({"prompt": "x", "n": 0}), 400, Some("n")),
        (
            json!({"prompt": "x", "logit_bias": {"99999999": 1}}),
            400,
            Some("logit_bias"),
        ),
        (json!({"prompt": [49152]}), 400, Some("prompt")),
        (
            json!({"prompt": "x", "temperature": "hot"}),
            400,
            Some("temperature"),
        ),
        (json!({"prompt": "x", "model": "gpt-4"}), 404, Some("model")),
        (json!({"nothing": true}), 400, None),
    ] {
        let r = post("/v1/completions", body.clone()).await.unwrap();
        assert_eq!(r.status().as_u16(), code, "{body}");
        let err: Value = r.json().await.unwrap();
        assert_eq!(err["error"]["param"], json!(param), "{body}: {err}");
        assert_eq!(err["error"]["code"], code);
    }
    let r = post(
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 1000}),
    )
    .await
    .unwrap();
    let msg = r.json::<Value>().await.unwrap()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(msg.contains("256") && msg.contains("1000"), "{msg}");
    let r = post(
        "/v1/chat/completions",
        json!({"messages": [{"role": "wizard", "content": "x"}]}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 400);
    let r = auth(h.http.post(format!("{}/v1/completions", h.base)))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["type"],
        "BadRequestError"
    );

    let r = post("/v1/embeddings", json!({"input": "x"})).await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["type"],
        "NotFoundError"
    );
    let r = post("/v1/completions", json!({"prompt": "x".repeat(10_000)}))
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["type"],
        "RequestTooLargeError"
    );

    // Admission: the engine runs 1 and 0 may wait, so a second concurrent request gets 503.
    let first = post(
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 200, "stream": true}),
    )
    .await
    .unwrap();
    assert_eq!(first.status(), 200);
    let r = post("/v1/completions", json!({"prompt": "x", "max_tokens": 2}))
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    drop(first);

    // Models, tokenize/detokenize, version, metrics.
    let models: Value = auth(h.http.get(format!("{}/v1/models", h.base)))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "smol");
    assert_eq!(models["data"][0]["max_model_len"], 256);
    let r: Value = post("/detokenize", json!({"tokens": [537, 827]}))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["prompt"], "one two");
    let r = post("/detokenize", json!({"tokens": [-1]})).await.unwrap();
    assert_eq!(r.status(), 400);
    let metrics = auth(h.http.get(format!("{}/metrics", h.base)))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
    ] {
        assert!(
            metrics.contains(name),
            "{name} missing from /metrics:\n{metrics}"
        );
    }
    assert!(metrics.contains("model_name=\"smol\""));
    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_in_flight_requests_and_turns_new_ones_away() {
    let h = harness("drain", |c, m| {
        c.shutdown_timeout = Duration::from_secs(20);
        m.step_interval = Duration::from_millis(10);
    })
    .await;
    // ~2 s of generation each: longer than the old drain would have waited once it began.
    let long = |stream: bool| {
        let (http, base) = (h.http.clone(), h.base.clone());
        tokio::spawn(async move {
            let r = http
                .post(format!("{base}/v1/completions"))
                .json(&json!({"prompt": "x", "max_tokens": 200, "ignore_eos": true, "stream": stream}))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        })
    };
    let (streamed, plain) = (long(true), long(false));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let Harness {
        base,
        http,
        server,
        mut stop,
        ..
    } = h;
    let _ = stop.take().unwrap().send(());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = http
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": "x", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let health = http.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(health.status(), 503);
    assert!(health.text().await.unwrap().contains("shutting down"));

    let (status, text) = streamed.await.unwrap();
    assert_eq!(status, 200);
    assert!(
        text.ends_with("data: [DONE]\n\n") && !text.contains("\"error\""),
        "{text}"
    );
    let (status, text) = plain.await.unwrap();
    assert_eq!(status, 200, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 200);
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_preflight_and_ping() {
    let h = harness("cors", |c, _| {
        c.api_key = Some("sekret".into());
        c.allowed_origins = vec!["http://app.example".into()];
    })
    .await;
    let preflight = h
        .http
        .request(
            reqwest::Method::OPTIONS,
            format!("{}/v1/chat/completions", h.base),
        )
        .header("Origin", "http://app.example")
        .header("Access-Control-Request-Method", "POST")
        .header("Access-Control-Request-Headers", "authorization")
        .send()
        .await
        .unwrap();
    assert_eq!(preflight.status(), 200);
    assert_eq!(
        preflight.headers()["access-control-allow-origin"],
        "http://app.example"
    );
    let ping = h
        .http
        .post(format!("{}/ping", h.base))
        .send()
        .await
        .unwrap();
    assert_eq!(ping.status(), 200);
    assert_eq!(h.get("/ping").await.0, 200);
    h.shutdown().await.unwrap();
}
