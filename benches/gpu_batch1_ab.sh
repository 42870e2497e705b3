#!/bin/bash
# Issue 21 item 2 (Qwen3-0.6B batch-1 decode through LLM.generate >= 1,250 tok/s, greedy and T=0.6 top-p
# 0.95): the session-11 GPU A/B of the sampling methods, in one process each, decisive lines first.
#   1. batch-1 decode through LLM.generate, sampler "select" (the default) vs "race_first", each with
#      the lm_head's cast kernel (the default) and without it (+lm32: the GEMV stores fp32 logits),
#      greedy and T=0.6/top-p 0.95, rounds alternating (benches/batch1_ab.py; the target column is the
#      issue's 1,250 tok/s);
#   2. the draw alone, device time per call, batch 1 and 256, both methods (benches/sampling.py; every
#      method's tokens checked against the torch reference);
#   3. unless --no-tests (tools/gpu_run.sh's tests phase runs them): the sampling and GEMV GPU tests
#      (both methods against the reference, batch independence, distributions, the fp32-out GEMV).
# Run from the repository root with the kernels built; PYTHONPATH=python:tests/engine.
#
#   bash benches/gpu_batch1_ab.sh [--no-tests]
set -u
tests=1
[ "${1:-}" = "--no-tests" ] && tests=0
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-python:tests/engine}
py=${PYTHON:-python}
echo "== 1. batch-1 decode, LLM.generate: sampler select vs race_first, lm_head cast vs fp32 GEMV"
timeout 85 "$py" benches/batch1_ab.py --models qwen3-0.6b --variants fold+ticket/64 fold+ticket/64+lm32 \
  --samplers select race_first --sampling greedy 0.6/0.95 --rounds 4
echo "== 2. the draw alone (device us per call)"
timeout 50 "$py" benches/sampling.py --batches 1 4 8 16 32 64 128 256 --reps 30
[ "$tests" = 1 ] || exit 0
echo "== 3. GPU tests"
timeout 35 "$py" -m pytest -q -x tests/kernels/test_sampling_cuda.py tests/kernels/test_sampling_distribution.py \
  tests/kernels/test_gemv_cuda.py
