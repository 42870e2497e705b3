"""Dense quantized checkpoints on a CUDA GPU (skipped without one): at decode rows the projections that
end a block (o_proj, down_proj) run the residual add and the next RMSNorm in their GEMV's last block and
hand the next projection its normalized input (`ResidualStream`, `apply_then_add_rms_norm`). The
engine's greedy outputs are the same with the decode step captured in CUDA graphs as eagerly, token for
token, with chunked prefill and mixed steps, and the fused path really runs. The tiny models are resized
to shapes the kernels take (head size 64, hidden and intermediate sizes multiples of 64)."""

from __future__ import annotations

import pytest
from checkpoints import Format, save_quantized_model
from test_moe_quantized_gpu import assert_graphs_match_eager

from voltllm.layers.quantization.quantized_method import QuantizedLinearMethod

pytestmark = pytest.mark.gpu

SIZES = {"hidden_size": 256, "head_dim": 64, "intermediate_size": 512}
FORMATS = {
    "awq-g32": Format("awq", group_size=32),
    "gptq-8bit-g32-act_order": Format("gptq", bits=8, group_size=32, act_order=True),
    "fp8-block32": Format("fp8", bits=8, scales="block", block=(32, 32)),
}


CASES = [("llama", "awq-g32"), ("qwen3", "gptq-8bit-g32-act_order"), ("llama", "fp8-block32")]


@pytest.mark.parametrize(("arch", "fmt_name"), CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_block_ends_fold_the_next_norm_and_graphs_match_eager(
    arch: str, fmt_name: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_quantized_model(arch, FORMATS[fmt_name], tmp_path, **SIZES)
    fused_calls = []
    original = QuantizedLinearMethod.apply_then_add_rms_norm

    def counting(self, layer, x, residual, norm, bias=None):
        result = original(self, layer, x, residual, norm, bias)
        fused_calls.append(result is not None)
        return result

    monkeypatch.setattr(QuantizedLinearMethod, "apply_then_add_rms_norm", counting)
    monkeypatch.setattr(QuantizedLinearMethod, "fold_norm_after", True)
    assert_graphs_match_eager(tmp_path)
    # Decode steps of up to 3 rows took the fused GEMV; prefill chunks and larger batches did not.
    assert any(fused_calls) and not all(fused_calls)
