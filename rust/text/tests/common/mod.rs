//! Helpers shared by the integration tests: fixture paths, golden files, streaming.

#![allow(dead_code)] // each test binary uses a subset

use std::path::{Path, PathBuf};

use serde::Deserialize;
use voltllm_text::{IncrementalDetokenizer, Tokenizer};

/// `tests/fixtures/<name>` at the repository root.
pub fn fixture_dir(name: &str) -> PathBuf {
    Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("run under cargo"))
        .join("../../tests/fixtures")
        .join(name)
}

/// `encode_golden.json` written by `tests/fixtures/gen_tokenizer_fixtures.py`.
#[derive(Deserialize)]
pub struct Golden {
    pub vocab_size: usize,
    pub cases: Vec<GoldenCase>,
}

/// One text encoded by the Python `tokenizers` package.
#[derive(Deserialize)]
pub struct GoldenCase {
    pub text: String,
    pub add_special_tokens: bool,
    pub ids: Vec<u32>,
    pub decoded: String,
    pub decoded_skip_special: String,
}

pub fn golden(fixture: &str) -> Golden {
    let path = fixture_dir(fixture).join("encode_golden.json");
    let text = std::fs::read_to_string(&path).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Asserts that encoding and both decodes reproduce the Python results for every golden case.
pub fn assert_matches_golden(tok: &Tokenizer, fixture: &str) {
    let golden = golden(fixture);
    assert_eq!(tok.vocab_size(), golden.vocab_size);
    assert!(golden.cases.len() >= 20);
    for case in &golden.cases {
        let ids = tok.encode(&case.text, case.add_special_tokens).unwrap();
        assert_eq!(ids, case.ids, "encode {:?}", case.text);
        assert_eq!(tok.decode(&ids, false).unwrap(), case.decoded);
        assert_eq!(tok.decode(&ids, true).unwrap(), case.decoded_skip_special);
    }
}

/// Streams `output` through a detokenizer token by token; returns the pieces, the last one
/// being what `flush` returned.
pub fn stream(tok: &Tokenizer, prompt: &[u32], output: &[u32], skip_special: bool) -> Vec<String> {
    let mut detok = IncrementalDetokenizer::new(tok.clone(), prompt, skip_special).unwrap();
    let mut pieces: Vec<String> = output.iter().map(|&id| detok.push(id).unwrap()).collect();
    pieces.push(detok.flush().unwrap());
    pieces
}

/// A scratch folder under the system temp dir, unique per test.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("voltllm-text-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
