"""load_model: safetensors (single and sharded), dummy weights, metadata, and clear errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_models import save_tiny_model  # noqa: E402

from voltllm.config import ModelConfig  # noqa: E402
from voltllm.layers.attention import get_attention_backend  # noqa: E402
from voltllm.loader import load_model, resolve_dtype  # noqa: E402
from voltllm.loader.dummy import DUMMY_WEIGHT_RANGE  # noqa: E402
from voltllm.models import UnsupportedArchitectureError  # noqa: E402

ARCH = "Qwen2ForCausalLM"  # untied head and q/k/v biases: the most tensors to place


def _load(model_dir: Path, **kwargs: object):
    config = ModelConfig(model=str(model_dir), **kwargs)
    return load_model(config, "cpu", None, get_attention_backend("torch", "cpu"), progress=False)


def _fused_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint as voltllm lays it out (q/k/v and gate/up stacked), for direct comparison."""
    files = sorted(model_dir.glob("*.safetensors"))
    raw = {k: v for f in files for k, v in load_file(f).items()}
    fused = {}
    for name in list(raw):
        if ".q_proj." in name:
            k, v = name.replace(".q_proj.", ".k_proj."), name.replace(".q_proj.", ".v_proj.")
            fused[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat([raw[name], raw[k], raw[v]])
        elif ".gate_proj." in name:
            fused[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat(
                [raw[name], raw[name.replace(".gate_proj.", ".up_proj.")]]
            )
        elif not any(p in name for p in (".k_proj.", ".v_proj.", ".up_proj.")):
            fused[name] = raw[name]
    return fused


def _assert_weights_equal(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert set(expected) <= set(state)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("sharded", [False, True])
def test_safetensors_weights_land_in_place(tmp_path: Path, sharded: bool) -> None:
    save_kwargs = {"max_shard_size": "40KB"} if sharded else {}
    save_tiny_model(ARCH, tmp_path, **save_kwargs)
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 2
    loaded = _load(tmp_path)
    _assert_weights_equal(loaded.model, _fused_state(tmp_path))
    assert loaded.dtype == torch.float32 and loaded.model_dir == tmp_path
    assert loaded.vocab_size == 200 and loaded.max_model_len == 256


def test_dtype_and_max_model_len(tmp_path: Path) -> None:
    save_tiny_model(ARCH, tmp_path)
    loaded = _load(tmp_path, dtype="bfloat16", max_model_len=100)
    assert loaded.dtype == torch.bfloat16 and loaded.max_model_len == 100
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    # RoPE frequencies stay fp32 whatever the weights' dtype.
    assert loaded.model.model.layers[0].self_attn.rotary_emb.inv_freq.dtype == torch.float32
    with pytest.raises(ValueError, match="exceeds the model's limit of 256"):
        _load(tmp_path, max_model_len=1000)


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.float16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16


def test_eos_ids_merge_generation_config_and_config(tmp_path: Path) -> None:
    save_tiny_model(ARCH, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["eos_token_id"] = 7
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert _load(tmp_path).eos_token_ids == [5, 7]


def test_dummy_weights_read_no_files_and_are_seeded(tmp_path: Path) -> None:
    save_tiny_model(ARCH, tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()  # dummy loading needs config.json only
    a = _load(tmp_path, load_format="dummy", seed=3).model.state_dict()
    b = _load(tmp_path, load_format="dummy", seed=3).model.state_dict()
    c = _load(tmp_path, load_format="dummy", seed=4).model.state_dict()
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert a[name].shape == (64 + 2 * 32, 64)
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])
    assert float(a[name].abs().max()) <= DUMMY_WEIGHT_RANGE
    assert torch.equal(a["model.norm.weight"], torch.ones(64))


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="never downloads"):
        _load(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        _load(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        _load(tmp_path)


def test_incomplete_or_mismatched_checkpoint(tmp_path: Path) -> None:
    save_tiny_model(ARCH, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensors: model\.layers\.1\.self_attn\.k_proj\.bias$"):
        _load(tmp_path)

    weights["model.layers.1.self_attn.k_proj.bias"] = torch.zeros(5)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_proj\.bias: checkpoint shape \(5,\) != expected \(32,\)"):
        _load(tmp_path)

    del weights["model.layers.1.self_attn.k_proj.bias"]
    weights["model.layers.1.self_attn.extra.weight"] = torch.zeros(1)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="has no place"):
        _load(tmp_path)


def test_sharded_index_naming_a_missing_shard(tmp_path: Path) -> None:
    save_tiny_model(ARCH, tmp_path, max_shard_size="40KB")
    next(iter(sorted(tmp_path.glob("model-*.safetensors")))).unlink()
    with pytest.raises(FileNotFoundError, match="shards that do not exist"):
        _load(tmp_path)


@pytest.mark.gpu
def test_dummy_model_runs_on_cuda_in_fp16(tmp_path: Path) -> None:
    from voltllm.layers.attention.backend import AttentionMetadata

    save_tiny_model(ARCH, tmp_path, head_size=64)
    config = ModelConfig(model=str(tmp_path), load_format="dummy")
    loaded = load_model(config, "cuda", None, get_attention_backend("auto", "cuda"), progress=False)
    model = loaded.model
    assert loaded.dtype == torch.float16
    assert all(p.is_cuda and p.dtype == torch.float16 for p in model.parameters())
    assert model.model.layers[0].self_attn.attn.backend.name == "sm70"
    n = 20
    shape = model.kv_cache_shape_per_layer(4, 16)
    kv_caches = [torch.zeros(shape, dtype=torch.float16, device="cuda") for _ in range(model.num_layers)]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([n], dtype=torch.int32, device="cuda"),
        block_tables=torch.tensor([[2, 0]], dtype=torch.int32, device="cuda"),
        slot_mapping=torch.cat([torch.arange(32, 48), torch.arange(0, 4)]).cuda(),
        max_query_len=n,
        max_seq_len=n,
        query_lens_cpu=(n,),
        seq_lens_cpu=(n,),
    )
    ids = torch.randint(0, loaded.vocab_size, (n,), device="cuda")
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, torch.arange(n, device="cuda"), metadata, kv_caches))
    assert logits.shape == (n, loaded.vocab_size) and torch.isfinite(logits).all()


def test_corrupt_safetensors_file(tmp_path: Path) -> None:
    save_tiny_model(ARCH, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        _load(tmp_path)
