"""Checks and times the pair-by-pair expert path (`csrc/moe/pair_gemv.cuh`) built as its own extension
next to the main one: its results against the torch form, then `benches/moe.py`'s kernel rows at 1-8
tokens (pairs vs the tiled GEMV vs the grouped GEMM, in the same run).

    python benches/moe_pairs_probe.py            # builds the extension (or --build-only)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build() -> None:
    """Compile `torch_glue/ops_moe_pairs.cu` into its own library (its ops join `torch.ops.voltllm_C`)."""
    from torch.utils import cpp_extension

    from voltllm.ops import build as main_build

    main_build.load()  # the library the fragment adds to
    build_dir = Path("/tmp/voltllm_moe_pairs")
    build_dir.mkdir(exist_ok=True)
    cpp_extension.load(
        name="voltllm_moe_pairs",
        sources=[str(main_build.CSRC_DIR / "torch_glue/ops_moe_pairs.cu")],
        extra_include_paths=[str(main_build.CSRC_DIR)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo"],
        build_directory=str(build_dir),
        is_python_module=False,
    )


@torch.inference_mode()
def check() -> None:
    from voltllm.layers.fused_moe.experts_torch import experts_grouped
    from voltllm.ops.moe import fused_moe_pairs, topk_softmax

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    failures = 0
    for dtype in (torch.float16, torch.bfloat16):
        for experts, hidden, inter in ((128, 2048, 768), (10, 1048, 40)):
            for tokens in (1, 2, 3, 8):
                for top_k in (1, 5, 8):
                    w13 = (
                        torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5
                    ).to(dtype)
                    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).to(
                        dtype
                    )
                    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
                    logits = torch.randn(tokens, experts, device="cuda", generator=gen).to(dtype)
                    weights, ids = topk_softmax(logits, top_k, True)
                    got = fused_moe_pairs(x, w13, w2, weights, ids).float()
                    want = experts_grouped(x.float(), w13.float(), w2.float(), weights, ids.long())
                    tol = 2e-2 if dtype == torch.float16 else 6e-2
                    if not torch.allclose(got, want, atol=tol, rtol=tol):
                        failures += 1
                        err = (got - want).abs().max().item()
                        print(f"MISMATCH {dtype} E{experts} H{hidden} I{inter} T{tokens} k{top_k}: {err:.3g}")
    torch.cuda.synchronize()
    print(f"pair path vs torch form: {'all match' if failures == 0 else f'{failures} mismatches'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build-only", action="store_true")
    args = p.parse_args()
    build()
    if args.build_only:
        return
    check()
    import moe

    sys.argv = ["moe.py", "--only", "kernels", "--kernel-tokens", "1", "2", "4", "8"]
    moe.main()


if __name__ == "__main__":
    main()
