#!/bin/bash
# Everything a device call carries, made here in one go (the work tree is laid anew each session, so
# .carry/ starts empty): the wheels the GPU machine lacks (tools/gpu_wheels.sh says which), voltllm._core
# for this checkout and the kernels prebuilt for the GPU machine (tools/prebuild_kernels.sh). Then call
#   run(command="bash tools/gpu_run.sh ...", carry=[".carry", "python/voltllm/_core.abi3.so"])
#
#   bash tools/gpu_prepare.sh [--no-kernels]
#
# _core comes from the wheel the last tools/test.sh run built (~/.cache/voltllm/dist); where there is none,
# or it is older than the newest commit to rust/, this script builds one with maturin first.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .carry
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .carry msgspec pyzmq llguidance compressed-tensors pydantic \
  pydantic_core annotated-types typing-inspection loguru

cache=${VOLTLLM_CACHE_DIR:-$HOME/.cache/voltllm}
rust_changed=$(git log -1 --format=%ct -- rust Cargo.toml Cargo.lock)
# The newest wheel of tools/test.sh (dist/) or of an earlier run of this script (core-dist/).
wheel=$(ls -t "$cache"/dist/voltllm-*.whl "$cache"/core-dist/voltllm-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ] || [ "$(stat -c %Y "$wheel")" -lt "$rust_changed" ]; then
  # None, or older than the last commit to rust/ (a fresh machine, say): build one here rather than wait
  # for a whole tools/test.sh, in a target dir of its own (tools/test.sh's holds only its mirror's
  # builds). ~11 min cold on 2 cores, seconds when nothing changed.
  echo "building voltllm._core with maturin into $cache/core-dist" >&2
  rm -rf "$cache/core-dist"
  CARGO_TARGET_DIR=$cache/core-target python3 -m maturin build --release --locked --out "$cache/core-dist"
  wheel=$(ls -t "$cache"/core-dist/voltllm-*.whl | head -1)
fi
python3 -m zipfile -e "$wheel" .carry/wheel
cp .carry/wheel/voltllm/_core.abi3.so python/voltllm/
rm -rf .carry/wheel

[ "${1:-}" = --no-kernels ] || bash tools/prebuild_kernels.sh
du -sh .carry python/voltllm/_core.abi3.so
