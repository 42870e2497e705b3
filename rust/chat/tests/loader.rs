//! Finding chat templates in model folders, with transformers' precedence rules.

use std::path::PathBuf;

use serde_json::json;
use voltllm_chat::{ChatError, ChatTemplate, RenderOptions};

/// A fresh scratch folder under the system temp dir.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("voltllm-chat-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write(dir: &std::path::Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

fn user(text: &str) -> Vec<serde_json::Value> {
    vec![json!({"role": "user", "content": text})]
}

#[test]
fn base_model_without_template_is_none() {
    let dir = scratch_dir("none");
    assert!(ChatTemplate::from_model_dir(&dir).unwrap().is_none());
    write(
        &dir,
        "tokenizer_config.json",
        r#"{"bos_token": "<s>", "chat_template": null}"#,
    );
    assert!(ChatTemplate::from_model_dir(&dir).unwrap().is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn config_string_template_with_added_token_objects() {
    let dir = scratch_dir("string");
    let config = json!({
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
        "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
    });
    write(&dir, "tokenizer_config.json", &config.to_string());
    let template = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
    assert_eq!(template.names(), ["default"]);
    let out = template
        .render(&user("hi"), &RenderOptions::default())
        .unwrap();
    assert_eq!(out, "<s>hi</s>");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn config_list_of_named_templates() {
    let dir = scratch_dir("list");
    let config = json!({
        "chat_template": [
            {"name": "default", "template": "D:{{ messages[0].content }}"},
            {"name": "rag", "template": "R:{{ documents | length }}"},
        ],
    });
    write(&dir, "tokenizer_config.json", &config.to_string());
    let template = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
    assert_eq!(template.names(), ["default", "rag"]);
    assert_eq!(
        template
            .render(&user("x"), &RenderOptions::default())
            .unwrap(),
        "D:x"
    );
    let rag = RenderOptions {
        template_name: Some("rag".into()),
        documents: Some(vec![json!({"title": "t", "text": "b"})]),
        ..Default::default()
    };
    assert_eq!(template.render(&user("x"), &rag).unwrap(), "R:1");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn jinja_files_take_priority_over_the_config() {
    let dir = scratch_dir("files");
    write(
        &dir,
        "tokenizer_config.json",
        r#"{"chat_template": "from config"}"#,
    );
    write(&dir, "chat_template.jinja", "from file\n");
    std::fs::create_dir(dir.join("additional_chat_templates")).unwrap();
    write(
        &dir.join("additional_chat_templates"),
        "tool_use.jinja",
        "tools={{ tools | length }}",
    );
    let template = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
    assert_eq!(template.names(), ["default", "tool_use"]);
    // Jinja drops a single trailing newline of the template source, as transformers' Jinja2 does.
    assert_eq!(
        template
            .render(&user("x"), &RenderOptions::default())
            .unwrap(),
        "from file"
    );
    let with_tools = RenderOptions {
        tools: Some(vec![json!({"type": "function"})]),
        ..Default::default()
    };
    assert_eq!(template.render(&user("x"), &with_tools).unwrap(), "tools=1");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn malformed_configs_are_typed_errors() {
    let dir = scratch_dir("bad");
    write(&dir, "tokenizer_config.json", "{ nope");
    assert!(matches!(
        ChatTemplate::from_model_dir(&dir),
        Err(ChatError::Config { .. })
    ));
    write(&dir, "tokenizer_config.json", r#"{"chat_template": 42}"#);
    assert!(matches!(
        ChatTemplate::from_model_dir(&dir),
        Err(ChatError::Config { .. })
    ));
    write(
        &dir,
        "tokenizer_config.json",
        r#"{"chat_template": [{"name": "x"}]}"#,
    );
    assert!(matches!(
        ChatTemplate::from_model_dir(&dir),
        Err(ChatError::Config { .. })
    ));
    write(
        &dir,
        "tokenizer_config.json",
        r#"{"chat_template": "{% if %}"}"#,
    );
    assert!(matches!(
        ChatTemplate::from_model_dir(&dir),
        Err(ChatError::Syntax { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}
