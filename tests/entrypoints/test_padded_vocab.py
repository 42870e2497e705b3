"""Token ids past the tokenizer's last token but below the model's `vocab_size` are valid.

Real checkpoints pad the embedding matrix (Qwen2.5/Qwen3: `vocab_size` 151,936, 151,669 tokens), so
a model can generate such an id and a client can send one. They read as empty text, over HTTP and
through `LLM.generate`; ids at or past `vocab_size` are still refused, naming the field.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from voltllm_cli import serving

from voltllm import LLM, SamplingParams

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "bytefallback"
VOCAB_SIZE = 384  # the tokenizer has 347 tokens: ids 347..383 are the padding


def _num_tokens() -> int:
    data = json.loads((FIXTURE / "tokenizer.json").read_text())
    return len(data["model"]["vocab"]) + len(data.get("added_tokens", []))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose embedding has more rows than its tokenizer has tokens."""
    out = tmp_path_factory.mktemp("padded_vocab")
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, out / name)
    return out


@pytest.fixture(scope="module")
def padded_ids() -> list[int]:
    first = _num_tokens()
    assert first < VOCAB_SIZE - 4, "the fixture tokenizer must leave padded ids below vocab_size"
    return [first, first + 1, VOCAB_SIZE - 1]


def test_llm_generates_and_reads_padded_ids(model_dir: Path, padded_ids: list[int]) -> None:
    llm = LLM(model=str(model_dir), num_kv_blocks=64, seed=0)
    tokenizer = llm.get_tokenizer()
    text_ids = tokenizer.encode("hello", add_special_tokens=False)
    # A logit bias makes the model generate a padded id on every step.
    forced = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={padded_ids[0]: 100.0}, logprobs=1)
    out = llm.generate({"prompt_token_ids": [*text_ids, *padded_ids]}, forced, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.token_ids == [padded_ids[0]] * 4
    assert completion.text == ""
    assert completion.logprobs is not None and padded_ids[0] in completion.logprobs[0]
    # Padded ids as the detokenizer's left context (the prompt's last tokens) leave the text intact.
    word = text_ids[0]
    after = llm.generate(
        {"prompt_token_ids": [*text_ids, *padded_ids]},
        SamplingParams(temperature=0.0, max_tokens=3, logit_bias={word: 100.0}),
        use_tqdm=False,
    )[0].outputs[0]
    assert after.token_ids == [word] * 3
    # The padded ids decode as nothing: the text is what follows "hello" in the full decode.
    context = tokenizer.decode(text_ids)
    full = tokenizer.decode([*text_ids, *padded_ids, *after.token_ids])
    assert full.startswith(context) and after.text == full[len(context) :] != ""
    with pytest.raises(ValueError, match=str(VOCAB_SIZE)):
        llm.generate({"prompt_token_ids": [*text_ids, VOCAB_SIZE]}, forced, use_tqdm=False)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[str]:
    with serving(str(model_dir), "--num-kv-blocks", "64") as (_, base):
        yield base


def test_server_generates_and_reads_padded_ids(server: str, model_dir: Path, padded_ids: list[int]) -> None:
    body = {
        "model": str(model_dir),
        "prompt": [5, 6, *padded_ids],
        "max_tokens": 3,
        "temperature": 0,
        "logit_bias": {str(padded_ids[1]): 100},
        "logprobs": 1,
    }
    for stream in (False, True):
        resp = httpx.post(f"{server}/v1/completions", json={**body, "stream": stream}, timeout=120)
        assert resp.status_code == 200, resp.text
        if not stream:
            choice = resp.json()["choices"][0]
            assert choice["text"] == ""
            assert resp.json()["usage"]["completion_tokens"] == 3
            assert len(choice["logprobs"]["tokens"]) == 3
        else:
            events = [line for line in resp.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
    detok = httpx.post(f"{server}/detokenize", json={"tokens": [5, *padded_ids]}, timeout=30)
    assert detok.status_code == 200, detok.text
    too_big = httpx.post(f"{server}/v1/completions", json={**body, "prompt": [5, VOCAB_SIZE]}, timeout=30)
    assert too_big.status_code == 400
    assert str(VOCAB_SIZE) in too_big.json()["error"]["message"]
