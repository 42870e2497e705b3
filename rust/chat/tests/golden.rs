//! Renders every golden case of `tests/chat/golden/` (written by `tools/gen_chat_golden.py` with
//! transformers' `apply_chat_template`) and requires byte-identical output, or the same
//! `raise_exception` message.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{Map, Value};
use voltllm_chat::{ChatError, ChatTemplate, RenderOptions, SpecialTokenStrings};

fn repo_path(relative: &str) -> PathBuf {
    Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("run under cargo"))
        .join("../..")
        .join(relative)
}

#[derive(Deserialize)]
struct GoldenCase {
    name: String,
    template: String,
    special_tokens: Map<String, Value>,
    messages: Vec<Value>,
    options: GoldenOptions,
    expected: Option<String>,
    error: Option<String>,
}

#[derive(Deserialize, Default)]
struct GoldenOptions {
    #[serde(default)]
    add_generation_prompt: bool,
    #[serde(default)]
    continue_final_message: bool,
    tools: Option<Vec<Value>>,
    #[serde(default)]
    extra: Map<String, Value>,
}

fn token(map: &Map<String, Value>, key: &str) -> Option<String> {
    map.get(key).and_then(Value::as_str).map(str::to_string)
}

fn load_cases() -> Vec<GoldenCase> {
    let dir = repo_path("tests/chat/golden");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "json"))
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|path| {
            let text = std::fs::read_to_string(path).unwrap();
            serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("bad golden file {}: {e}", path.display()))
        })
        .collect()
}

#[test]
fn every_golden_case_renders_like_transformers() {
    let cases = load_cases();
    assert!(cases.len() >= 100, "only {} golden cases", cases.len());
    let mut failures = Vec::new();
    let mut raised = 0;
    for case in &cases {
        let tokens = SpecialTokenStrings {
            bos_token: token(&case.special_tokens, "bos_token"),
            eos_token: token(&case.special_tokens, "eos_token"),
            unk_token: token(&case.special_tokens, "unk_token"),
            pad_token: token(&case.special_tokens, "pad_token"),
        };
        let template = ChatTemplate::new(case.template.clone(), tokens)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let opts = RenderOptions {
            add_generation_prompt: case.options.add_generation_prompt,
            continue_final_message: case.options.continue_final_message,
            tools: case.options.tools.clone(),
            extra: case.options.extra.clone(),
            ..Default::default()
        };
        let result = template.render(&case.messages, &opts);
        match (&case.expected, &case.error, result) {
            (Some(expected), None, Ok(got)) if &got == expected => {}
            (None, Some(message), Err(ChatError::TemplateRaised(got))) if &got == message => {
                raised += 1;
            }
            (expected, error, got) => failures.push(format!(
                "{}:\n  expected {:?}\n  error    {:?}\n  got      {:?}",
                case.name, expected, error, got
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} golden cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    assert!(raised > 0, "no raise_exception case was exercised");
}

#[test]
fn default_model_template_loads_from_model_dir() {
    let dir = repo_path("tests/fixtures/smollm2");
    let template = ChatTemplate::from_model_dir(&dir)
        .unwrap()
        .expect("SmolLM2 has a template");
    let expected = std::fs::read_to_string(dir.join("chat_template.jinja")).unwrap();
    assert_eq!(template.source("default"), Some(expected.as_str()));
    assert_eq!(
        template.special_tokens().bos_token.as_deref(),
        Some("<|im_start|>")
    );
    assert_eq!(
        template.special_tokens().eos_token.as_deref(),
        Some("<|im_end|>")
    );

    // The golden smollm2 cases render the same through the loaded template.
    for case in load_cases()
        .iter()
        .filter(|c| c.name.starts_with("smollm2__"))
    {
        let opts = RenderOptions {
            add_generation_prompt: case.options.add_generation_prompt,
            continue_final_message: case.options.continue_final_message,
            ..Default::default()
        };
        if case.options.tools.is_some() || !case.options.extra.is_empty() {
            continue;
        }
        let got = template.render(&case.messages, &opts).unwrap();
        assert_eq!(Some(&got), case.expected.as_ref(), "{}", case.name);
    }
}
