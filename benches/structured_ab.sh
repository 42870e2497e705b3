#!/bin/bash
# Issue 20 item 6 on the GPU, one process: a JSON-schema-constrained decode step at batch 64 against an
# unconstrained one, both under asynchronous scheduling (the CUDA default; a step with grammars runs
# ahead, the mask thread queueing its apply and draw). Run from the repo root with
# PYTHONPATH=python:tests/engine and the kernels built. It prints:
#   ratio ...          JSON schema / unconstrained (target <= 1.05)
#   exactness ...      greedy tokens of each schema workload against JSON schema-sync's (must be equal)
#   grammar check ...  every constrained output follows its schema
# with no-maxLength (the same schema, unbounded string) and JSON schema-sync (synchronous steps) beside
# those two; then (unless --no-tests: tools/gpu_run.sh runs every GPU test file itself) the GPU tests of the
# mask kernel, TokenMasks' upload and the engine's constrained steps ahead on CUDA.
set -u
echo "cores: $(nproc)"
python benches/structured_step.py --steps 50 --rounds 3 \
  --variants "unconstrained,JSON schema,no-maxLength,JSON schema-sync" \
  2>&1 | grep -v -i "warn\|Capturing" | tail -60
[ "${1:-}" = "--no-tests" ] && exit 0
python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_structured_cuda.py \
  tests/structured_output/test_masks.py tests/engine/test_grammar_steps_gpu.py 2>&1 | tail -4
