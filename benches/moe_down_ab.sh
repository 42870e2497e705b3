#!/bin/bash
# Issue 17 item 3 (batch-1 decode >= 0.6 of its floor): the pair path's down-stage kernels on the GPU, in
# one call. Run from the repo root with PYTHONPATH=python:tests/engine, kernels built.
#   1. correctness on the GPU of both down-stage kernels (moe_pair_down_kernel, chunks 0, and the staged
#      one at 12 loads in flight);
#   2. `benches/moe.py --only pair-down`: one Qwen3-30B-A3B layer from a CUDA graph, the down stage by
#      difference and the whole layer, chunks 0 vs 12, at 1, 8, 16 and 64 tokens;
#   3. `--only down-ab`: both in one 48-layer engine (graphs recaptured per variant, rounds A B B A) at
#      batch 1, against the floor measured in the same run (target >= 0.6), and 8;
#   4. the whole of tests/kernels/test_moe_cuda.py if time is left.
# --no-tests: 2 and 3 only (tools/gpu_run.sh runs every GPU test file itself).
# Decided on the H100 (issue 17): 12 is voltllm.ops.moe.PAIR_DOWN_CHUNKS up to PAIR_DOWN_STAGED_MAX_TOKENS
# (16) tokens, chunks 0 past that; 24 loads in flight and routing inside the pair stages lost and are gone.
set -u
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
tests=1
[ "${1:-}" = --no-tests ] && tests=0
if [ $tests = 1 ]; then
  timeout 30 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_moe_cuda.py \
    -k "staged or pair_path or down_variant" 2>&1 | tail -3
fi
python benches/moe.py --only pair-down down-ab --pair-down-tokens 1 8 16 64 --ab-batches 1 8 --ab-tokens 16 \
  --json "$out/moe_down_ab.json" 2>&1 | grep -v -i warn
if [ $tests = 1 ]; then
  timeout 40 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_moe_cuda.py 2>&1 | tail -3
fi
