"""Tiny random Hugging Face checkpoints (saved with `save_pretrained`) for the engine's parity tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.3,
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=False),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True),
}


def save_tiny(arch: str, out_dir: Path, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """Write a random `arch` checkpoint to `out_dir`; returns it and the HF model (float32, eval)."""
    torch.manual_seed(seed)
    config = CONFIGS[arch]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out_dir)
    return out_dir, model
