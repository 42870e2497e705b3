"""The Volta legality gate, run on CPU: every shipped kernel variant compiles for compute_70 / sm_70.

Needs the CUDA 12.9 compiler pieces from PyPI (CI installs them):
    pip install "nvidia-cuda-nvrtc-cu12==12.9.*" "nvidia-cuda-nvcc-cu12==12.9.*" \
        "nvidia-cuda-runtime-cu12==12.9.*"
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_TOOLCHAIN = ("nvidia.cuda_nvrtc", "nvidia.cuda_nvcc", "nvidia.cuda_runtime")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


needs_toolchain = pytest.mark.skipif(
    not all(_installed(m) for m in _TOOLCHAIN), reason="CUDA 12.9 nvrtc/nvcc/runtime wheels are not installed"
)


@pytest.fixture(scope="module")
def gate():
    spec = importlib.util.spec_from_file_location("sm70_gate", REPO / "tools" / "sm70_gate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sm70_gate"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# Not marked slow (about 30 s on 2 cores for sm_70, sm_80 and sm_90): CI must always run the gate.
@needs_toolchain
def test_every_variant_compiles_for_sm70_without_spills(gate) -> None:
    results = gate.run_gate()
    variants = gate.load_variants()
    probes = gate._variants_module().dynamic_smem_probes()
    built = {(arch, r.expr) for arch, r in results}
    expected = {(arch, e) for arch, sources in variants.items() for exprs in sources.values() for e in exprs}
    assert built == expected
    assert {arch for arch, _ in built} == {70, 80, 90}
    for arch, r in results:
        assert r.registers > 0, r.expr
        assert r.smem + r.dynamic_smem <= gate.smem_limit(arch), r.expr
        # The attention kernels' dynamic shared memory is read from the PTX, not assumed.
        assert (r.dynamic_smem > 0) == (r.expr in probes), r.expr
        if arch == 70:
            assert (r.spill_stores, r.spill_loads) == (0, 0), f"{r.expr} spills on sm_70"


def test_sm80_kernels_are_checked_where_they_have_bodies(gate) -> None:
    """The _mma_sm80 kernel compiles to a trap on sm_70 (checked so a V100 build cannot break) and for
    real on sm_80/90."""
    variants = gate.load_variants()
    source = "attention/paged_prefill_mma_sm80.cuh"
    sm80 = set(variants[80][source])
    assert {e for e in sm80 if "__nv_bfloat16" in e} and {e for e in sm80 if "__half" in e}
    assert sm80 <= set(variants[90][source])
    assert set(variants[70][source]) <= sm80
    everything = {e for sources in variants.values() for exprs in sources.values() for e in exprs}
    assert everything == {e for exprs in variants[90].values() for e in exprs}


@needs_toolchain
def test_gate_reports_compile_errors(gate) -> None:
    tools = gate.Toolchain.find()
    with pytest.raises(gate.GateError, match="no_such_kernel"):
        tools.compile_ptx("ops/rms_norm.cuh", ["voltllm::no_such_kernel<__half>"], 70)


def test_forbidden_instructions_are_recognised(gate) -> None:
    import re

    samples = {
        "cp.async.ca.shared.global [%r1], [%rd2], 16;": "cp.async",
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];": "ldmatrix",
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16": "wgmma",
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};": "bf16",
        "wmma.mma.sync.aligned.row.col.m16n16k16.f32.bf16.bf16.f32": "bf16",
    }
    for line, what in samples.items():
        hits = [reason for pattern, reason in gate.FORBIDDEN_PTX.items() if re.search(pattern, line)]
        assert any(what in h for h in hits), (line, hits)
    legal = "wmma.mma.sync.aligned.row.col.m16n16k16.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f2};"
    assert not [p for p in gate.FORBIDDEN_PTX if re.search(p, legal)]


def test_ptxas_report_parsing_catches_spills(gate) -> None:
    report = """ptxas info    : Compiling entry function '_Z3fooi' for 'sm_70'
ptxas info    : Function properties for _Z3fooi
    24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, 1024 bytes smem, 356 bytes cmem[0]
"""
    (r,) = gate.parse_ptxas(report, {"_Z3fooi": "foo<int>"})
    assert (r.expr, r.registers, r.smem, r.stack, r.spill_stores, r.spill_loads) == (
        "foo<int>",
        255,
        1024,
        24,
        8,
        12,
    )
    with pytest.raises(gate.GateError, match="no entry"):
        gate.parse_ptxas(report, {"_Z3fooi": "foo<int>", "_Z3barv": "bar"})


def test_gate_variants_match_what_the_glue_dispatches(gate) -> None:
    """The gate must check exactly the head sizes and dtypes that the torch glue can launch."""
    import re

    from voltllm.layers.attention.sm70 import SUPPORTED_HEAD_SIZES

    module = gate._variants_module()
    glue = (REPO / "csrc" / "torch_glue" / "torch_glue.h").read_text()
    dispatch = glue[glue.index("void dispatch_head_size") :]
    dispatch = dispatch[: dispatch.index("\n}\n")]
    dispatched_heads = tuple(int(h) for h in re.findall(r"case (\d+):", dispatch))
    assert dispatched_heads == module.HEAD_SIZES == SUPPORTED_HEAD_SIZES
    dtypes = glue[glue.index("void dispatch_dtype") :]
    dtypes = dtypes[: dtypes.index("\n}\n")]
    assert set(re.findall(r"fn\((__\w+)\{\}\)", dtypes)) == set(module.DTYPES)


def test_glue_check_rewrites_kernel_launches(gate) -> None:
    """--glue turns each `kernel<<<cfg>>>(args)` into a call that type-checks args against the kernel."""
    src = """  kernel<<<grid, 32 * plan.warps, Tr::smem_bytes(plan.warps), stream>>>(p);
    paged_decode_reduce_kernel<T, H>
        <<<dim3(shape.num_heads, num_seqs), H * kReduceGroups, reduce_smem, stream>>>(r);"""
    out = gate._LAUNCH.sub(lambda m: f"voltllm_launch({m['kernel']}, {m['cfg']})(", src)
    assert "<<<" not in out and ">>>" not in out
    assert "voltllm_launch(kernel, grid, 32 * plan.warps, Tr::smem_bytes(plan.warps), stream)(p);" in out
    assert "voltllm_launch(paged_decode_reduce_kernel<T, H>, dim3(shape.num_heads, num_seqs)," in out
