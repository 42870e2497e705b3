"""`voltllm._core` from Python: the Rust text layer agrees with the Python libraries it replaces."""

from __future__ import annotations

import pytest
import tokenizers
import transformers

from voltllm import _core
from voltllm.loader import default_model_dir

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "Ünïcödé, 中文字符, 한국어 and emoji 🤖🚀👍🏽",
    "def f(x):\n\treturn x ** 2  # tabs and newlines\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "And of Spain?"},
    ],
    [{"role": "user", "content": "Ünïcödé and emoji 🤖 survive templating."}],
]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(default_model_dir())


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> _core.Tokenizer:
    return _core.Tokenizer.from_model_dir(model_dir)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenizer_matches_the_tokenizers_package(
    model_dir: str, tokenizer: _core.Tokenizer, text: str, add_special_tokens: bool
) -> None:
    reference = tokenizers.Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    ids = tokenizer.encode(text, add_special_tokens)
    assert ids == reference.encode(text, add_special_tokens=add_special_tokens).ids
    for skip in (True, False):
        assert tokenizer.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip)
    assert tokenizer.encode_batch([text, "x"], add_special_tokens)[0] == ids


def test_tokenizer_metadata(tokenizer: _core.Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_ids == [tokenizer.token_to_id("<|im_end|>")]
    assert tokenizer.id_to_token(tokenizer.token_to_id("Hello")) == "Hello"
    # An id without a token (a padded vocabulary row) adds no text, as in Hugging Face tokenizers.
    hello = tokenizer.token_to_id("Hello")
    assert tokenizer.decode([10**9]) == ""
    assert tokenizer.decode([hello, 10**9, hello]) == tokenizer.decode([hello, hello])


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    model_dir: str, messages: list, add_generation_prompt: bool
) -> None:
    template = _core.ChatTemplate.from_model_dir(model_dir)
    reference = transformers.AutoTokenizer.from_pretrained(model_dir)
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_errors_are_value_errors(model_dir: str) -> None:
    template = _core.ChatTemplate.from_model_dir(model_dir)
    with pytest.raises(ValueError):
        template.render("not a list")


@pytest.mark.parametrize("text", TEXTS[:4])
def test_detokenizer_streaming_equals_full_decode(tokenizer: _core.Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Say something:", False)
    ids = tokenizer.encode(text, False)
    detok = _core.Detokenizer(tokenizer, prompt)
    pieces = [detok.push(token_id) for token_id in ids]
    pieces.append(detok.flush())
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == tokenizer.decode(ids)


def test_detokenizer_stops_on_a_stop_string_split_across_tokens(tokenizer: _core.Tokenizer) -> None:
    ids = tokenizer.encode("The answer is 42. The end of the story.", False)
    detok = _core.Detokenizer(tokenizer, [], stop=["end of"])
    emitted = ""
    for token_id in ids:
        emitted += detok.push(token_id)
        if detok.stopped is not None:
            break
    assert detok.stopped == "end of"
    assert emitted == "The answer is 42. The "
    kept = _core.Detokenizer(tokenizer, [], stop=["end of"], include_stop_str_in_output=True)
    assert "".join(kept.push(t) for t in ids).endswith("The end of")


def test_detokenize_step_batches_sequences_and_stops_mid_step(tokenizer: _core.Tokenizer) -> None:
    """One call for a whole step's tokens of many sequences gives what per-token pushes give; a
    sequence whose stop string completes mid-step reports how many of its tokens it took."""
    texts = ["The answer is 42. The end of the story.", "Plain text without the stop."]
    ids = [tokenizer.encode(t, False) for t in texts]
    batched = [_core.Detokenizer(tokenizer, [], stop=["end of"]) for _ in texts]
    one_by_one = [_core.Detokenizer(tokenizer, [], stop=["end of"]) for _ in texts]
    got = _core.detokenize_step(batched, ids)
    for (text, taken), detok, seq_ids in zip(got, one_by_one, ids, strict=True):
        want, want_taken = "", 0
        for token_id in seq_ids:
            if detok.stopped is not None:
                break
            want += detok.push(token_id)
            want_taken += 1
        assert (text, taken) == (want, want_taken)
    assert got[0][1] < len(ids[0]) and batched[0].stopped == "end of"
    assert got[1][1] == len(ids[1]) and batched[1].stopped is None
    with pytest.raises(ValueError, match="2 detokenizers but 1 token lists"):
        _core.detokenize_step(batched, ids[:1])
