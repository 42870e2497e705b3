//! `/openapi.json` against the router it describes, and the request fields it closes, over real
//! HTTP in front of the mock engine.

use serde_json::{json, Value};

mod common;

use common::harness;

/// Every documented operation is routed: no fallback 404 ("no route") and no 405.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_described_operation_is_served() {
    let h = harness("openapi", |_, _| {}).await;
    let (status, text) = h.get("/openapi.json").await;
    assert_eq!(status, 200);
    let doc: Value = serde_json::from_str(&text).unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    let paths = doc["paths"].as_object().unwrap();
    assert!(paths.len() >= 15, "{:?}", paths.keys());
    for (path, operations) in paths {
        let url = format!("{}{}", h.base, path.replace("{id}", "smol"));
        for method in operations.as_object().unwrap().keys() {
            let request = match method.as_str() {
                "get" => h.http.get(&url),
                "post" => h.http.post(&url).json(&json!({})),
                other => panic!("{other} {path}: not a method the router uses"),
            };
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let body = response.text().await.unwrap();
            assert_ne!(status, 405, "{method} {path}");
            assert!(
                !body.contains("no route for"),
                "{method} {path} is described but not routed: {body}"
            );
            let documented = &operations[method]["responses"][status.to_string()];
            assert!(
                documented.is_object(),
                "{method} {path} answered {status}, which is not documented: {body}"
            );
        }
    }
    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_and_unsupported_fields_are_a_400_naming_them() {
    let h = harness("fields", |_, _| {}).await;
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let with = |base: &Value, key: &str, value: Value| {
        let mut body = base.clone();
        body[key] = value;
        body
    };
    for (key, value) in [
        ("temprature", json!(0.5)),
        ("store", json!(true)),
        ("use_beam_search", json!(true)),
        ("guided_decoding_backend", json!("xgrammar")),
        ("guided_whitespace_pattern", json!(" ")),
        ("suffix", json!("x")),
    ] {
        let (status, body) = h
            .post("/v1/chat/completions", with(&chat, key, value.clone()))
            .await;
        assert_eq!(status, 400, "{key}: {body}");
        assert_eq!(body["error"]["param"], key, "{body}");
        assert_eq!(body["error"]["type"], "BadRequestError");
    }
    // The no-op values and the hints pass.
    let accepted = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                          "store": false, "use_beam_search": false, "service_tier": "auto",
                          "user": "u-7", "prompt_cache_key": "k", "guided_decoding_backend": "guidance"});
    let (status, body) = h.post("/v1/chat/completions", accepted).await;
    assert_eq!(status, 200, "{body}");
    let completion = json!({"prompt": "hi", "max_tokens": 2});
    for key in ["max_completion_tokens", "tools", "suffix"] {
        let value = if key == "suffix" {
            json!("x")
        } else {
            json!(1)
        };
        let (status, body) = h
            .post("/v1/completions", with(&completion, key, value))
            .await;
        assert_eq!(status, 400, "{key}: {body}");
        assert_eq!(body["error"]["param"], key, "{body}");
    }
    let (status, body) = h
        .post(
            "/tokenize",
            json!({"prompt": "hi", "return_token_strs": true}),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("return_token_strs"));
    h.shutdown().await.unwrap();
}

/// A copy of the fixture model whose tokenizer puts a BOS (`<|endoftext|>`, id 0) before every
/// text, as Llama's does (SmolLM2's adds none, so `add_special_tokens` would change nothing).
fn model_with_bos() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("voltllm-bos-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = common::model_dir();
    for name in [
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        std::fs::copy(source.join(name), dir.join(name)).unwrap();
    }
    let text = std::fs::read_to_string(source.join("tokenizer.json")).unwrap();
    let mut tokenizer: Value = serde_json::from_str(&text).unwrap();
    tokenizer["post_processor"] = json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    dir
}

/// The whitespace pattern reaches the engine on the request's JSON constraint, and
/// `add_special_tokens` decides whether the prompt's ids start with BOS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whitespace_pattern_and_special_tokens_reach_the_engine() {
    let model = model_with_bos();
    let h = harness("wsp", |c, _| c.model = model.clone()).await;
    let (status, body) = h
        .post(
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 2, "guided_json": {"type": "object"},
                   "guided_whitespace_pattern": "[ ]?"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let sent = h.engine.as_ref().unwrap().log().added.pop().unwrap();
    let constraint = sent.sampling_params.structured_output.unwrap();
    assert_eq!(constraint.whitespace_pattern.as_deref(), Some("[ ]?"));

    let ids_of = |with_special: bool| {
        let h = &h;
        async move {
            let (status, body) = h
                .post(
                    "/v1/completions",
                    json!({"prompt": "hi", "max_tokens": 1, "add_special_tokens": with_special}),
                )
                .await;
            assert_eq!(status, 200, "{body}");
            h.engine
                .as_ref()
                .unwrap()
                .log()
                .added
                .pop()
                .unwrap()
                .prompt_token_ids
        }
    };
    let plain = h.tokenizer.encode("hi", false).unwrap();
    assert_eq!(ids_of(false).await, plain);
    assert_eq!(ids_of(true).await, [&[0], &plain[..]].concat());
    // Chat: the template writes the specials, so the default adds none.
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let (status, _) = h.post("/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(status, 200);
    let default_ids = h
        .engine
        .as_ref()
        .unwrap()
        .log()
        .added
        .pop()
        .unwrap()
        .prompt_token_ids;
    assert_ne!(default_ids[0], 0);
    let (status, _) = h
        .post(
            "/v1/chat/completions",
            chat(json!({"add_special_tokens": true})),
        )
        .await;
    assert_eq!(status, 200);
    let with_bos = h
        .engine
        .as_ref()
        .unwrap()
        .log()
        .added
        .pop()
        .unwrap()
        .prompt_token_ids;
    assert_eq!(with_bos, [&[0], &default_ids[..]].concat());
    h.shutdown().await.unwrap();
    let _ = std::fs::remove_dir_all(&model);
}
