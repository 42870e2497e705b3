//! Tokenizer and detokenizer behaviour on the default model's real tokenizer (SmolLM2, byte-level
//! BPE), against golden ids produced by the Python `tokenizers` package
//! (`tests/fixtures/gen_tokenizer_fixtures.py`).

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use voltllm_text::{IncrementalDetokenizer, StopChecker, TextError, Tokenizer};

fn fixture_dir() -> PathBuf {
    common::fixture_dir("smollm2")
}

/// The fixture tokenizer, loaded once: parsing the 3.5 MB `tokenizer.json` dominates test time.
fn tokenizer() -> Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| Tokenizer::from_model_dir(fixture_dir()).expect("fixture tokenizer loads"))
        .clone()
}

#[test]
fn encode_and_decode_match_python_tokenizers() {
    common::assert_matches_golden(&tokenizer(), "smollm2");
}

#[test]
fn batch_apis_agree_with_single_calls() {
    let tok = tokenizer();
    let texts: Vec<String> = common::golden("smollm2")
        .cases
        .into_iter()
        .map(|c| c.text)
        .collect();
    let batch = tok.encode_batch(&texts, false).unwrap();
    for (text, ids) in texts.iter().zip(&batch) {
        assert_eq!(ids, &tok.encode(text, false).unwrap());
    }
    let refs: Vec<&[u32]> = batch.iter().map(Vec::as_slice).collect();
    let decoded = tok.decode_batch(&refs, false).unwrap();
    assert_eq!(decoded, texts);
}

#[test]
fn special_tokens_come_from_tokenizer_config() {
    let tok = tokenizer();
    assert_eq!(tok.bos_token(), Some("<|im_start|>"));
    assert_eq!(tok.bos_token_id(), Some(1));
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.eos_token_ids(), &[2]);
    assert_eq!(tok.pad_token_id(), Some(2));
    assert_eq!(tok.unk_token(), Some("<|endoftext|>"));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(tok.id_to_token(2).as_deref(), Some("<|im_end|>"));
    assert!(tok.is_special_token(2));
    assert!(!tok.is_special_token(tok.token_to_id("hello").unwrap()));
    assert!(tok.special_token_ids().windows(2).all(|w| w[0] < w[1]));
    // SmolLM2's post-processor adds nothing: chat templates write the special tokens.
    assert!(!tok.add_bos_token());
    assert_eq!(
        tok.encode("hi", true).unwrap(),
        tok.encode("hi", false).unwrap()
    );
}

#[test]
fn from_file_knows_no_special_token_names() {
    let tok = Tokenizer::from_file(fixture_dir().join("tokenizer.json")).unwrap();
    assert!(tok.eos_token_ids().is_empty());
    assert_eq!(tok.bos_token(), None);
    assert_eq!(
        tok.encode("Hello", false).unwrap(),
        tokenizer().encode("Hello", false).unwrap()
    );
}

#[test]
fn generation_config_adds_eos_ids() {
    let dir = common::scratch_dir("genconfig");
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture_dir().join(name), dir.join(name)).unwrap();
    }
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [0, 2]}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_model_dir(&dir).unwrap();
    assert_eq!(tok.eos_token_ids(), &[2, 0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_files_give_typed_errors() {
    let empty = common::scratch_dir("empty");
    assert!(matches!(
        Tokenizer::from_model_dir(&empty),
        Err(TextError::MissingTokenizerFile(_))
    ));
    std::fs::write(empty.join("tokenizer.json"), "{not json").unwrap();
    assert!(matches!(
        Tokenizer::from_model_dir(&empty),
        Err(TextError::Load { .. })
    ));
    std::fs::copy(
        fixture_dir().join("tokenizer.json"),
        empty.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(empty.join("tokenizer_config.json"), r#"{"eos_token": 5"#).unwrap();
    assert!(matches!(
        Tokenizer::from_model_dir(&empty),
        Err(TextError::Config { .. })
    ));
    std::fs::remove_dir_all(&empty).unwrap();
}

#[test]
fn ids_without_a_token_decode_as_empty_text() {
    // Checkpoints pad the embedding matrix past the tokenizer (Qwen: 151,936 rows, 151,669
    // tokens); a model can generate an id of the padding, and it must not break the request.
    let tok = tokenizer();
    let padded = tok.vocab_size() as u32 + 7;
    let hello = tok.encode("Hello", false).unwrap();
    let with_padding = [hello.as_slice(), &[padded]].concat();
    assert_eq!(tok.decode(&with_padding, false).unwrap(), "Hello");
    assert_eq!(tok.decode(&[padded], false).unwrap(), "");

    // Prompt context and generated ids alike: the padded id adds nothing, the stream goes on.
    let mut detok = IncrementalDetokenizer::new(tok.clone(), &[padded], false).unwrap();
    assert_eq!(detok.push(padded).unwrap(), "");
    let ids = tok.encode("still fine", false).unwrap();
    assert_eq!(detok.push_many(&ids).unwrap(), "still fine");
    assert_eq!(detok.flush().unwrap(), "");
}

#[test]
fn detokenizer_never_emits_broken_characters() {
    let tok = tokenizer();
    let prompt = tok
        .encode(
            "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .unwrap();
    let texts = [
        "Emoji: 😀👍🏽👨‍👩‍👧‍👦🇯🇵🏳️‍🌈 done",
        "中文测试：你好，世界！",
        "日本語のテキストとカタカナ",
        "한국어 문장입니다",
        "Ünïcödé: café, naïve, façade, Straße",
        "plain ascii, with  double spaces\nand lines",
    ];
    let mut held_back_somewhere = false;
    for text in texts {
        let ids = tok.encode(text, false).unwrap();
        let pieces = common::stream(&tok, &prompt, &ids, false);
        for piece in &pieces {
            assert!(
                !piece.contains('\u{FFFD}'),
                "broken char in {piece:?} for {text:?}"
            );
        }
        assert_eq!(pieces.concat(), tok.decode(&ids, false).unwrap());
        assert_eq!(pieces.concat(), text);
        held_back_somewhere |= pieces[..ids.len()].iter().any(String::is_empty);
    }
    // The texts really do split characters across tokens, so hold-back was exercised.
    assert!(held_back_somewhere);
}

#[test]
fn single_tokens_of_an_emoji_are_incomplete_utf8() {
    // Precondition of the test above: byte-level BPE splits this emoji into several tokens
    // that are not valid UTF-8 on their own.
    let tok = tokenizer();
    let ids = tok.encode("👨‍👩‍👧‍👦", false).unwrap();
    assert!(ids.len() > 1);
    assert!(ids
        .iter()
        .any(|&id| tok.decode(&[id], false).unwrap().contains('\u{FFFD}')));
}

#[test]
fn detokenizer_without_prompt_and_with_skipped_special_tokens() {
    let tok = tokenizer();
    let ids = tok
        .encode("Hi 🤖!<|im_end|>\n<|im_start|>user\n再见", false)
        .unwrap();
    let pieces = common::stream(&tok, &[], &ids, true);
    assert_eq!(pieces.concat(), tok.decode(&ids, true).unwrap());
    assert!(!pieces.concat().contains("<|im_end|>"));
    let pieces = common::stream(&tok, &[], &ids, false);
    assert_eq!(pieces.concat(), tok.decode(&ids, false).unwrap());
}

#[test]
fn flush_releases_an_incomplete_character_as_a_full_decode_would() {
    let tok = tokenizer();
    let ids = tok.encode("ok 👨‍👩‍👧‍👦", false).unwrap();
    // Cut in the middle of the emoji, where the decode ends in U+FFFD.
    let cut = (1..ids.len())
        .find(|&n| tok.decode(&ids[..n], false).unwrap().ends_with('\u{FFFD}'))
        .expect("some prefix ends inside the emoji");
    let mut detok = IncrementalDetokenizer::new(tok.clone(), &[], false).unwrap();
    let streamed = detok.push_many(&ids[..cut]).unwrap();
    assert!(!streamed.contains('\u{FFFD}'));
    let rest = detok.flush().unwrap();
    assert_eq!(streamed + &rest, tok.decode(&ids[..cut], false).unwrap());
    assert_eq!(detok.flush().unwrap(), "");
}

#[test]
fn detokenizer_and_stop_checker_compose() {
    // The server's pipeline: ids -> detokenizer -> stop checker; the stop string "</a>" is split
    // over several tokens and must not leak.
    let tok = tokenizer();
    let ids = tok
        .encode("answer: 42 😀</answer> trailing", false)
        .unwrap();
    let mut detok = IncrementalDetokenizer::new(tok.clone(), &[], false).unwrap();
    let mut stop = StopChecker::new(["</answer>"], false).unwrap();
    let mut shown = String::new();
    let mut stopped = None;
    for &id in &ids {
        let update = stop.push(&detok.push(id).unwrap());
        assert!(
            !update.emit.contains('<'),
            "partial stop leaked: {:?}",
            update.emit
        );
        shown.push_str(&update.emit);
        if update.stopped.is_some() {
            stopped = update.stopped;
            break;
        }
    }
    assert_eq!(stopped.as_deref(), Some("</answer>"));
    assert_eq!(shown, "answer: 42 😀");
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    let tok = tokenizer();
    let handles: Vec<_> = (0..2)
        .map(|i| {
            let tok = tok.clone();
            std::thread::spawn(move || tok.encode(&format!("thread {i} 你好"), false).unwrap())
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(
            h.join().unwrap(),
            tok.encode(&format!("thread {i} 你好"), false).unwrap()
        );
    }
}

#[test]
fn random_token_streams_reassemble_to_the_full_decode() {
    // Random ids (any mix of byte fragments, invalid sequences and special tokens): for byte-level
    // BPE the streamed pieces must still concatenate to exactly the full decode, and a piece may
    // only contain U+FFFD where the full decode has one that no later token repairs.
    let tok = tokenizer();
    let prompt = tok.encode("<|im_start|>assistant\n", false).unwrap();
    let vocab = tok.vocab_size() as u64;
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        // xorshift64*: deterministic, no dependency.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    for round in 0..200 {
        let len = 1 + (next() % 40) as usize;
        let ids: Vec<u32> = (0..len).map(|_| (next() % vocab) as u32).collect();
        let skip_special = round % 2 == 0;
        let pieces = common::stream(&tok, &prompt, &ids, skip_special);
        let full = tok.decode(&ids, skip_special).unwrap();
        assert_eq!(pieces.concat(), full, "ids {ids:?}");
        // Only a stream that ends inside a character leaves anything for the flush.
        if !full.ends_with('\u{FFFD}') {
            assert_eq!(pieces[len], "", "ids {ids:?}");
        }
    }
}
