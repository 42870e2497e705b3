#!/bin/bash
# Everything a device call carries, made here in one go (the work tree is laid anew each session, so
# .carry/ starts empty): the wheels the GPU machine lacks (tools/gpu_wheels.sh says which), voltllm._core
# for this checkout and the kernels prebuilt for the GPU machine (tools/prebuild_kernels.sh). Then call
#   run(command="bash tools/gpu_run.sh ...", carry=[".carry", "python/voltllm/_core.abi3.so"])
#
#   bash tools/gpu_prepare.sh [--no-kernels]
#
# _core comes from the wheel the last tools/test.sh run built (~/.cache/voltllm/dist): run that first
# when the Rust crates changed since (the script refuses a wheel older than the newest commit to rust/).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .carry
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .carry msgspec pyzmq llguidance compressed-tensors pydantic \
  pydantic_core annotated-types typing-inspection loguru

wheel=$(ls -t "${VOLTLLM_CACHE_DIR:-$HOME/.cache/voltllm}"/dist/voltllm-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  echo "no wheel from tools/test.sh in ~/.cache/voltllm/dist: run it first" >&2
  exit 1
fi
rust_changed=$(git log -1 --format=%ct -- rust Cargo.toml Cargo.lock)
if [ "$(stat -c %Y "$wheel")" -lt "$rust_changed" ]; then
  echo "$wheel is older than the last commit to rust/: run tools/test.sh first" >&2
  exit 1
fi
python3 -m zipfile -e "$wheel" .carry/wheel
cp .carry/wheel/voltllm/_core.abi3.so python/voltllm/
rm -rf .carry/wheel

[ "${1:-}" = --no-kernels ] || bash tools/prebuild_kernels.sh
du -sh .carry python/voltllm/_core.abi3.so
