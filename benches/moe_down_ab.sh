#!/bin/bash
# Issue 17 item 3 (batch-1 decode >= 0.6 of its floor), session 11: the pair path's down-stage kernels on
# the H200, decided in one call. Run from the repo root with PYTHONPATH=python:tests/engine, kernels built.
#   1. correctness on the GPU of both down-stage kernels (the staged one at 12 and 24 loads in flight)
#      and of the pair stages that route themselves (no top-k launch);
#   2. `benches/moe.py --only pair-down`: one Qwen3-30B-A3B layer from a CUDA graph, the down stage by
#      difference, chunks 0 (moe_pair_down_kernel, the default) vs 12 vs 24, and the whole layer for
#      those and routed (12R, 24R), at 1, 8, 16 and 64 tokens;
#   3. `--only down-ab`: the five variants in one 48-layer engine (graphs recaptured per variant, rounds
#      A B C D E E D C B A) at batch 1, against the floor measured in the same run (target >= 0.6), and 8;
#   4. the whole of tests/kernels/test_moe_cuda.py if time is left.
# --no-tests: 2 and 3 only (tools/gpu_run.sh runs every GPU test file itself).
# The winner of 3 at batch 1 (and not slower at 8) sets voltllm.ops.moe.PAIR_DOWN_CHUNKS / PAIR_ROUTED.
set -u
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
tests=1
[ "${1:-}" = --no-tests ] && tests=0
if [ $tests = 1 ]; then
  timeout 30 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_moe_cuda.py \
    -k "staged or pair_path or down_variant or routed" 2>&1 | tail -3
fi
python benches/moe.py --only pair-down down-ab --pair-down-tokens 1 8 16 64 --ab-batches 1 8 --ab-tokens 16 \
  --json "$out/moe_down_ab.json" 2>&1 | grep -v -i warn
if [ $tests = 1 ]; then
  timeout 40 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_moe_cuda.py 2>&1 | tail -3
fi
