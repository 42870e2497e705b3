"""Each architecture against transformers: a flattened multi-sequence prefill, then mixed steps that
read the paged cache (decodes and a chunked-prefill continuation). fp32, tight tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from paged_batch import PagedBatch
from tiny_models import hf_logits, load_hf_reference, save_tiny_model

from voltllm.config import ModelConfig
from voltllm.layers.attention import get_attention_backend
from voltllm.loader import load_model

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
BLOCK_SIZE = 4
ATOL = 2e-4


def _run_step(loaded, batch: PagedBatch, kv_caches, new_tokens: list[list[int]]) -> list[torch.Tensor]:
    query_lens = [len(t) for t in new_tokens]
    metadata = batch.step(query_lens)
    positions = batch.positions(query_lens)
    input_ids = torch.tensor([t for seq in new_tokens for t in seq])
    with torch.inference_mode():
        hidden = loaded.model(input_ids, positions, metadata, kv_caches)
        logits = loaded.model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    return list(logits.split(query_lens))


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(arch: str, tmp_path: Path) -> None:
    config = save_tiny_model(arch, tmp_path)
    loaded = load_model(
        ModelConfig(model=str(tmp_path)), "cpu", torch.float32, get_attention_backend("torch", "cpu")
    )
    hf_model = load_hf_reference(tmp_path)

    gen = torch.Generator().manual_seed(1)
    prompt_lens = [5, 17, 1, 12]  # 17 > Mistral's window of 8
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    model = loaded.model
    kv_caches = [torch.zeros(model.kv_cache_shape_per_layer(64, BLOCK_SIZE)) for _ in range(model.num_layers)]
    batch = PagedBatch(len(seqs), num_blocks=64, block_size=BLOCK_SIZE)

    # Step 1: all prompts at once.
    for seq, logits in zip(seqs, _run_step(loaded, batch, kv_caches, seqs), strict=True):
        torch.testing.assert_close(logits, hf_logits(hf_model, seq), atol=ATOL, rtol=0)

    # Steps 2-3: one new token for three sequences, three for another (a chunk after a cached prefix).
    for _ in range(2):
        new = [[int(torch.randint(0, config.vocab_size, (1,), generator=gen))] for _ in seqs]
        new[1] = torch.randint(0, config.vocab_size, (3,), generator=gen).tolist()
        for seq, extra in zip(seqs, new, strict=True):
            seq.extend(extra)
        for seq, extra, logits in zip(seqs, new, _run_step(loaded, batch, kv_caches, new), strict=True):
            expected = hf_logits(hf_model, seq)[-len(extra) :]
            torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
