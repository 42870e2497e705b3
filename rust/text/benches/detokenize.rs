//! Streaming detokenization cost per token, against the naive correct alternative.
//!
//! Workload: the SmolLM2 fixture tokenizer streams a ~2,000-token mixed ASCII / CJK / emoji text
//! one token at a time through `IncrementalDetokenizer` + `StopChecker`. Baseline, measured in
//! the same run: re-decoding all output ids after every token and diffing against the previous
//! text (what a server without incremental detokenization must do to stay UTF-8 correct). The
//! incremental cost per token is independent of the output length; the baseline's grows with it.
//!
//! Run: `cargo bench -p voltllm-text --bench detokenize`.

use std::path::Path;
use std::time::Instant;

use voltllm_text::{IncrementalDetokenizer, StopChecker, Tokenizer};

fn main() {
    let dir = Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("run under cargo"))
        .join("../../tests/fixtures/smollm2");
    let tok = Tokenizer::from_model_dir(dir).expect("fixture tokenizer");
    let paragraph = "The quick brown fox jumps over the lazy dog. 中文测试：你好，世界！ \
                     Emoji 😀👍🏽👨‍👩‍👧‍👦 and code `fn main() {}`.\n";
    let text = paragraph.repeat(60);
    let ids = tok.encode(&text, false).expect("encode");
    let prompt = tok
        .encode("<|im_start|>assistant\n", false)
        .expect("encode");
    println!("output tokens: {}", ids.len());

    let rounds = 5;
    let start = Instant::now();
    let mut streamed = String::new();
    for _ in 0..rounds {
        streamed.clear();
        let mut detok = IncrementalDetokenizer::new(tok.clone(), &prompt, false).unwrap();
        let mut stop = StopChecker::new(["<|never|>", "\n\n\n"], false).unwrap();
        for &id in &ids {
            streamed.push_str(&stop.push(&detok.push(id).unwrap()).emit);
        }
        streamed.push_str(&stop.push(&detok.flush().unwrap()).emit);
        streamed.push_str(&stop.flush());
    }
    let incremental = start.elapsed().as_secs_f64() / (rounds * ids.len()) as f64;
    assert_eq!(streamed, text);

    let start = Instant::now();
    let mut emitted = 0usize;
    for n in 1..=ids.len() {
        let full = tok.decode(&ids[..n], false).unwrap();
        // Emit only up to the last complete character, as the incremental path does.
        let complete = full.trim_end_matches('\u{FFFD}').len();
        emitted = emitted.max(complete);
    }
    let naive = start.elapsed().as_secs_f64() / ids.len() as f64;
    assert_eq!(emitted, text.len());

    println!(
        "incremental detokenizer + stop checker: {:8.2} us/token",
        incremental * 1e6
    );
    println!(
        "baseline: full re-decode per token:      {:8.2} us/token",
        naive * 1e6
    );
    println!("speedup: {:.1}x", naive / incremental);
}
