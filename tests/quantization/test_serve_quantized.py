"""A quantized checkpoint folder serves with no extra flag: `LLM` and `voltllm serve` read the format
from its config.json and answer what transformers answers on the dequantized weights."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from checkpoints import Format, save_quantized_model
from tiny_models import add_fixture_tokenizer, hf_greedy
from voltllm_cli import serving

from voltllm import LLM, SamplingParams

PROMPT = [5, 17, 42, 99, 7, 250, 31]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """An AWQ Llama with the fixture tokenizer (347 tokens, vocab 384), and transformers' greedy tokens."""
    out = tmp_path_factory.mktemp("awq")
    hf_model = save_quantized_model("llama", Format("awq", group_size=32), out, vocab_size=384)
    add_fixture_tokenizer(out)
    with torch.inference_mode():
        expected, _ = hf_greedy(hf_model, PROMPT, NEW_TOKENS)
    return out, expected


def test_llm_reads_the_format_from_the_checkpoint(model_dir: tuple[Path, list[int]]) -> None:
    path, expected = model_dir
    llm = LLM(model=str(path), num_kv_blocks=64, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected


def test_serve_answers_from_a_quantized_folder_with_no_flag(model_dir: tuple[Path, list[int]]) -> None:
    path, expected = model_dir
    body = {
        "model": str(path),
        "prompt": PROMPT,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    with serving(str(path), "--num-kv-blocks", "64", "--device", "cpu") as (_, base):
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == NEW_TOKENS
        # transformers' tokens as text, through the server's own detokenizer
        reference = httpx.post(f"{base}/detokenize", json={"tokens": expected}, timeout=30)
    assert reference.status_code == 200, reference.text
    assert resp.json()["choices"][0]["text"] == reference.json()["prompt"]
