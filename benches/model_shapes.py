"""Model configs (architecture fields only) that the benchmarks instantiate with dummy weights.

Shared by `offline_throughput.py` and `serving.py` so both measure the same shapes.
"""

from __future__ import annotations

# Qwen/Qwen3-0.6B config.json (architecture fields only).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
# A 4-layer Qwen3 small enough for the CPU.
TINY = {
    **QWEN3_0_6B,
    "vocab_size": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}

# Qwen/Qwen3-32B config.json (architecture fields only).
QWEN3_32B = {
    **QWEN3_0_6B,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}

# meta-llama/Meta-Llama-3-8B config.json (architecture fields only).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

# Qwen/Qwen3-30B-A3B config.json (architecture fields only): 48 layers, each a sparse block of 128
# experts (768 features each), top-8, renormalised; 30.5B parameters, 3.3B of them per token.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
# A 4-layer Qwen3-MoE small enough for the CPU (32 experts of 128 features, top-8).
TINY_QWEN3_MOE = {
    **QWEN3_30B_A3B,
    "vocab_size": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 128,
    "num_experts": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}


def write_dummy_tokenizer(model_dir, vocab_size: int, seed: int = 0) -> None:
    """A byte-level BPE `tokenizer.json` with `vocab_size` tokens in `model_dir`, so that a dummy-weight
    model can run through `LLM.generate` (which detokenizes). Token i is a random 1-8 byte string, as a
    real vocabulary's are; there are no merges (benchmarks pass token ids, never text to encode)."""
    import json
    import random
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(seed)
    vocab: dict[str, int] = {c: i for i, c in enumerate(sorted(byte_chars))}
    while len(vocab) < vocab_size:
        vocab.setdefault("".join(rng.choices(byte_chars, k=rng.randint(2, 8))), len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    Path(model_dir, "tokenizer.json").write_text(tokenizer.to_str())
    Path(model_dir, "tokenizer_config.json").write_text(json.dumps({"eos_token": None, "bos_token": None}))


# The dummy AWQ checkpoints' quantization_config: 4-bit, group 128, zero points, AutoAWQ's GEMM layout.
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
