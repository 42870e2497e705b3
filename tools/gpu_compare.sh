#!/bin/bash
# Runs one command in several snapshots (tools/gpu_snapshot.sh) on the same machine, alternating them
# for ROUNDS rounds, so that two versions are compared without the 1-3% that separates two machines.
# Each snapshot builds its kernels into its own cache (XDG_CACHE_HOME); output lines carry its name.
#
#   bash tools/gpu_compare.sh ROUNDS .carry/a .carry/b -- python benches/kernel_bench.py --only decode
set -u
rounds=$1
shift
dirs=()
while [ "$1" != -- ]; do
  dirs+=("$1")
  shift
done
shift
root=$PWD
source "$root/tools/gpu_wheels.sh"
install_carried_wheels 2>/dev/null
export PYTHONUNBUFFERED=1
in_snapshot() {  # in_snapshot DIR COMMAND...: COMMAND in DIR with its own kernel cache and imports
  local dir=$1
  shift
  (cd "$root/$dir" && XDG_CACHE_HOME=/tmp/cache/$(basename "$dir") \
    PYTHONPATH=/tmp/site:$PWD/python:$PWD/tests/engine:$PWD/tests/models "$@")
}
if command -v nvidia-smi >/dev/null; then
  for dir in "${dirs[@]}"; do in_snapshot "$dir" python -m voltllm.ops >/dev/null 2>&1 & done
  wait
fi
for round in $(seq "$rounds"); do
  for dir in "${dirs[@]}"; do
    in_snapshot "$dir" "$@" 2>&1 | grep -v -i warn | sed "s|^|$(basename "$dir") #$round: |"
  done
done
