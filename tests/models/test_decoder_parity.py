"""Each architecture against transformers: a flattened multi-sequence prefill, then mixed steps that
read the paged cache (decodes and a chunked-prefill continuation).

On CPU in fp32 with a tight tolerance; on CUDA (marked gpu) in fp16 through the CUDA kernels.
"""

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


def run_step(loaded, batch: PagedBatch, kv_caches, new_tokens: list[list[int]]) -> list[torch.Tensor]:
    """One engine step over the paged cache; returns each sequence's logits for its new tokens."""
    device = kv_caches[0].device
    query_lens = [len(t) for t in new_tokens]
    metadata = batch.step(query_lens, device)
    positions = batch.positions(query_lens).to(device)
    input_ids = torch.tensor([t for seq in new_tokens for t in seq], device=device)
    with torch.inference_mode():
        hidden = loaded.model(input_ids, positions, metadata, kv_caches)
        logits = loaded.model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    return list(logits.split(query_lens))


def check_against_transformers(
    model_dir: Path, device: str, dtype: torch.dtype, backend: str, atol: float, block_size: int
) -> None:
    """Load `model_dir` with voltllm and compare three steps' logits with transformers (fp32)."""
    attn_backend = get_attention_backend(backend, device)
    loaded = load_model(ModelConfig(model=str(model_dir)), device, dtype, attn_backend, progress=False)
    hf_model = load_hf_reference(model_dir, device)
    vocab_size = loaded.vocab_size

    gen = torch.Generator().manual_seed(1)
    prompt_lens = [5, 17, 1, 12]  # 17 > Mistral's window of 8
    seqs = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    model = loaded.model
    num_blocks = 64
    kv_caches = [
        torch.zeros(model.kv_cache_shape_per_layer(num_blocks, block_size), dtype=dtype, device=device)
        for _ in range(model.num_layers)
    ]
    batch = PagedBatch(len(seqs), num_blocks=num_blocks, block_size=block_size)

    # Step 1: all prompts at once.
    for seq, logits in zip(seqs, run_step(loaded, batch, kv_caches, seqs), strict=True):
        torch.testing.assert_close(logits, hf_logits(hf_model, seq), atol=atol, rtol=0)

    # Steps 2-3: one new token for three sequences, three for another (a chunk after a cached prefix).
    for _ in range(2):
        new = [[int(torch.randint(0, vocab_size, (1,), generator=gen))] for _ in seqs]
        new[1] = torch.randint(0, vocab_size, (3,), generator=gen).tolist()
        for seq, extra in zip(seqs, new, strict=True):
            seq.extend(extra)
        for seq, extra, logits in zip(seqs, new, run_step(loaded, batch, kv_caches, new), strict=True):
            expected = hf_logits(hf_model, seq)[-len(extra) :]
            torch.testing.assert_close(logits, expected, atol=atol, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers_cpu_fp32(arch: str, tmp_path: Path) -> None:
    save_tiny_model(arch, tmp_path)
    check_against_transformers(tmp_path, "cpu", torch.float32, "torch", atol=2e-4, block_size=4)


def test_yarn_matches_transformers_cpu_fp32(tmp_path: Path) -> None:
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}
    save_tiny_model("Qwen3ForCausalLM", tmp_path, rope_parameters=yarn)
    check_against_transformers(tmp_path, "cpu", torch.float32, "torch", atol=2e-4, block_size=4)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sm70", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers_cuda_fp16(arch: str, backend: str, tmp_path: Path) -> None:
    # Kernels take head sizes 64/128/256 and 16-token blocks; fp16 vs the fp32 oracle.
    save_tiny_model(arch, tmp_path, head_size=64)
    check_against_transformers(tmp_path, "cuda", torch.float16, backend, atol=3e-2, block_size=16)


@pytest.mark.gpu
def test_yarn_matches_transformers_cuda_fp16(tmp_path: Path) -> None:
    # YaRN's attention factor rides in the kernel's cos/sin table.
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}
    save_tiny_model("Qwen3ForCausalLM", tmp_path, head_size=64, rope_parameters=yarn)
    check_against_transformers(tmp_path, "cuda", torch.float16, "sm70", atol=3e-2, block_size=16)
