#!/bin/bash
# One device call that checks and measures everything GPU-side, in order of importance, each step
# under its own time limit, printing a short log (and writing the full ones under $OUT if set).
#
#   bash tools/gpu_run.sh [tests|kernels|engine|all]      # default: all
#
# Carry the msgspec and pyzmq wheels the GPU machine lacks (tools/gpu_wheels.sh says how). The front-end
# benchmark also needs the built `python/voltllm/_core.abi3.so` carried. Kernels build on first use
# (~75 s on an H200).
set -u
export PYTHONUNBUFFERED=1
what=${1:-all}
out=${OUT:-/tmp/gpu_run}
mkdir -p "$out"
source "$(dirname "$0")/gpu_wheels.sh"
install_carried_wheels || exit 1
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/tests/engine
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -m voltllm.ops 2>&1 | tail -1
el "kernel build"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_cuda.py \
    tests/kernels/test_gemv_cuda.py tests/kernels/test_prologue_cuda.py tests/engine/test_gpu_engine.py \
    > "$out/gpu_tests.log" 2>&1
  tail -1 "$out/gpu_tests.log"; grep -E "^FAILED|margin" "$out/gpu_tests.log" | head -8
  el "GPU tests"
fi
if [ "$what" = kernels ] || [ "$what" = all ]; then
  timeout 100 python benches/kernels.py 2>&1 | tee "$out/kernels.log" | grep -v -i warn
  el "kernel bench"
fi
if [ "$what" = engine ] || [ "$what" = all ]; then
  timeout 120 python benches/decode_latency.py --no-eager --tokens 128 2>&1 | tee "$out/decode.log" | grep "^|"
  timeout 70 python benches/host_overhead.py --model-config qwen3-0.6b --device cuda 2>&1 | tee "$out/host.log" | tail -4
  timeout 280 python benches/offline_throughput.py 2>&1 | grep -v Capturing | tee "$out/offline.log"
  el "engine benches"
fi
