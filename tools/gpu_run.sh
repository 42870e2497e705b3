#!/bin/bash
# One device call: builds the kernels, runs every GPU test file, then the measurement requests, each
# under its own time limit inside the call's budget, and prints a table of what ran last.
#
#   bash tools/gpu_run.sh [--budget SECONDS] [--no-tests] [--only-on GPU] [REQUEST ...]
#
# `--only-on H200` runs nothing (exit 3, the GPU's name printed) unless the GPU's name contains it: a call
# made for an issue's H200 figures then costs seconds when the device tool lends an H100 instead, and
# `... --only-on H200 A B || bash tools/gpu_run.sh C` spends such a call on other work.
#
# A request is a bash script (default: every tools/gpu_requests/*.sh, in name order) run from the repo
# root; its first line may say `# timeout: N` (seconds). Each gets min(N, what is left of the budget over
# the requests left), so a slow one cannot starve the rest. Its output goes to $OUT/NAME.log (the last
# lines are also printed). The device tool allows 600 s a command: keep the default budget (540 s) under
# it, kernel build (~100 s) and tests (~75 s) included.
#
# `bash tools/gpu_prepare.sh` makes what the call carries: `.carry` (the wheels tools/gpu_wheels.sh
# lists, the prebuilt kernels) and `python/voltllm/_core.abi3.so`
# (anything through `LLM` needs it). A library that tools/prebuild_kernels.sh built here from the same
# sources (.carry/kernels) is loaded instead of built: the build step then takes seconds, not ~100.
set -u
export PYTHONUNBUFFERED=1
budget=540
tests=1
only_on=
requests=()
while [ $# -gt 0 ]; do
  case $1 in
    --budget) budget=$2; shift 2 ;;
    --no-tests) tests=0; shift ;;
    --only-on) only_on=$2; shift 2 ;;
    *) requests+=("$1"); shift ;;
  esac
done
[ ${#requests[@]} -eq 0 ] && requests=(tools/gpu_requests/*.sh)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [ -n "$only_on" ] && [[ "$gpu" != *"$only_on"* ]]; then
  echo "this call's GPU is $gpu, not $only_on: nothing run"
  exit 3
fi
out=${OUT:-/tmp/gpu_run}
mkdir -p "$out"
source "$(dirname "$0")/gpu_wheels.sh"
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/tests/engine
export VOLTLLM_KERNEL_CACHE=$PWD/.carry/kernels  # the prebuilt library, or where this call builds it
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
summary=()
record() {  # record NAME RC SECONDS LOG
  summary+=("$(printf '| %s | %s | %s | %s |' "$1" "$2" "$3" "$(grep -v '^\s*$' "$4" | tail -1 | cut -c1-90)")")
}
# A warm machine has them already: pip's "already exists" warnings are left out.
install_carried_wheels 2>"$out/wheels.log" || { cat "$out/wheels.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$(elapsed)
python -m voltllm.ops >"$out/build.log" 2>&1
record build $? $(( $(elapsed) - start )) "$out/build.log"
if [ "$tests" = 1 ]; then
  start=$(elapsed)
  # Every test file that needs the GPU, found by name so a new one cannot be left out.
  mapfile -t files < <(find tests -name 'test_*cuda*.py' -o -name 'test_*gpu*.py' | sort)
  timeout 150 python -m pytest -q -p no:cacheprovider "${files[@]}" tests/kernels/test_sampling_distribution.py \
    >"$out/gpu_tests.log" 2>&1
  rc=$?
  grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -8
  record "GPU tests (${#files[@]} files)" $rc $(( $(elapsed) - start )) "$out/gpu_tests.log"
fi
left_requests=${#requests[@]}
for request in "${requests[@]}"; do
  name=$(basename "$request" .sh)
  asked=$(sed -n '1s/^# timeout: *\([0-9]*\).*/\1/p' "$request")
  share=$(( (budget - $(elapsed)) / left_requests ))
  limit=$(( ${asked:-$share} < share ? ${asked:-$share} : share ))
  left_requests=$(( left_requests - 1 ))
  if [ "$limit" -lt 1 ]; then
    summary+=("| $name | skipped | 0 | no time left |")
    continue
  fi
  echo "=== $name (limit ${limit} s, at $(elapsed) s)"
  start=$(elapsed)
  timeout "$limit" bash "$request" >"$out/$name.log" 2>&1
  rc=$?
  tail -15 "$out/$name.log"
  record "$name" $rc $(( $(elapsed) - start )) "$out/$name.log"
done
echo
echo "| step | rc | s | last line |"
echo "| --- | --- | --- | --- |"
printf '%s\n' "${summary[@]}"
echo "total $(elapsed) s"
