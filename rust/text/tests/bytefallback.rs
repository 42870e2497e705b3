//! The other common tokenizer family (Llama 2 / Mistral style): SentencePiece `▁` spaces, BPE with
//! byte fallback, a decoder that strips the sequence's leading space, and `<s>` added by the
//! post-processor. The fixture (`tests/fixtures/bytefallback`) has a tiny vocabulary, so every
//! non-ASCII character is spelled as UTF-8 byte tokens.

mod common;

use voltllm_text::Tokenizer;

fn tokenizer() -> Tokenizer {
    Tokenizer::from_model_dir(common::fixture_dir("bytefallback")).unwrap()
}

#[test]
fn encode_and_decode_match_python_tokenizers() {
    common::assert_matches_golden(&tokenizer(), "bytefallback");
}

#[test]
fn post_processor_adds_bos() {
    let tok = tokenizer();
    assert_eq!(tok.bos_token_id(), Some(1));
    assert_eq!(tok.eos_token_ids(), &[2]);
    assert!(tok.add_bos_token());
    assert!(!tok.add_eos_token());
    assert_eq!(tok.encode("Hello", true).unwrap()[0], 1);
}

#[test]
fn byte_tokens_are_held_until_the_character_is_complete() {
    let tok = tokenizer();
    let ids = tok.encode("中文 😀", false).unwrap();
    // Each CJK character is 3 byte tokens and the emoji 4: most pushes complete nothing.
    assert!(ids.len() >= 10);
    let pieces = common::stream(&tok, &[], &ids, false);
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    let non_empty: Vec<&str> = pieces
        .iter()
        .map(String::as_str)
        .filter(|p| !p.is_empty())
        .collect();
    assert_eq!(non_empty, ["中", "文", " ", "😀"]);
    assert_eq!(pieces.concat(), "中文 😀");
}

#[test]
fn leading_space_of_the_first_output_token_is_kept_after_a_prompt() {
    // Decoding the output alone would strip its leading space (the `Strip` decoder); with the
    // prompt as left context the stream must produce exactly the continuation of the prompt.
    let tok = tokenizer();
    for (prompt, output) in [
        ("The answer is", " the world"),
        ("Cost:", " 5 €, ok"),
        ("Emoji", " 😀😀 and 中文"),
    ] {
        let prompt_ids = tok.encode(prompt, true).unwrap();
        let output_ids = tok.encode(output, false).unwrap();
        let full: Vec<u32> = prompt_ids.iter().chain(&output_ids).copied().collect();
        let full_text = tok.decode(&full, true).unwrap();
        let prompt_text = tok.decode(&prompt_ids, true).unwrap();
        let expected = full_text.strip_prefix(&prompt_text).unwrap();
        assert!(expected.starts_with(' '));

        let pieces = common::stream(&tok, &prompt_ids, &output_ids, true);
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        assert_eq!(pieces.concat(), expected, "prompt {prompt:?}");
    }
}

#[test]
fn without_a_prompt_the_stream_equals_the_plain_decode() {
    let tok = tokenizer();
    for case in common::golden("bytefallback").cases {
        let pieces = common::stream(&tok, &[], &case.ids, true);
        assert_eq!(
            pieces.concat(),
            case.decoded_skip_special,
            "{:?}",
            case.text
        );
        let pieces = common::stream(&tok, &[], &case.ids, false);
        assert_eq!(pieces.concat(), case.decoded, "{:?}", case.text);
    }
}
