"""The `voltllm` command as a user meets it: help, clear one-line errors, generate, interactive chat."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from voltllm_cli import VOLTLLM


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*VOLTLLM, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [[], ["serve"], ["generate"], ["chat"], ["engine"]])
def test_help_everywhere(command: list[str]) -> None:
    result = run(*command, "--help")
    assert result.returncode == 0
    assert "usage:" in result.stdout


def test_bench_help_reaches_the_load_tester() -> None:
    result = run("bench", "serve", "--help")
    assert result.returncode == 0, result.stderr
    assert "--request-rate" in result.stdout


@pytest.mark.parametrize(
    ("args", "status", "needle"),
    [
        (["serve", "--no-such-flag"], 2, "unrecognized arguments: --no-such-flag"),
        (["serve", "--port", "many"], 2, "invalid int value"),
        (["serve", "/no/such/model/folder"], 1, "does not exist"),
        (["generate", "/no/such/model.gguf", "--prompt", "hi"], 1, "does not exist"),
        (["frobnicate"], 2, "invalid choice"),
    ],
)
def test_bad_usage_is_one_clear_line(args: list[str], status: int, needle: str) -> None:
    result = run(*args, timeout=120)
    assert result.returncode == status
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0]
    assert "Traceback" not in result.stderr


def test_generate_one_shot_on_default_model() -> None:
    result = run("generate", "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "24")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_interactive_chat_in_a_terminal() -> None:
    """Driven like a person would: type a question, see the streamed answer, leave with Ctrl-D."""
    session = f"voltllm-test-{uuid.uuid4().hex[:8]}"
    marker = f"/tmp/{session}.exit"
    command = f"{' '.join(VOLTLLM)} chat --temperature 0 --max-tokens 32; echo EXIT=$? > {marker}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "50", command], check=True)

    def screen() -> str:
        return subprocess.run(
            ["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True
        ).stdout

    def wait_for(predicate, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = screen()
            if predicate(text):
                return text
            time.sleep(0.5)
        raise AssertionError(f"timed out; screen was:\n{screen()}")

    try:
        wait_for(lambda s: "Ctrl-D to leave" in s and s.rstrip().endswith(">"), 300)
        subprocess.run(
            ["tmux", "send-keys", "-t", session, "What is the capital of France?", "Enter"], check=True
        )
        answered = wait_for(lambda s: "Paris" in s and s.rstrip().endswith(">"), 300)
        assert "What is the capital of France?" in answered
        subprocess.run(["tmux", "send-keys", "-t", session, "C-d"], check=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not Path(marker).exists():
            time.sleep(0.5)
        with open(marker) as f:
            assert f.read().strip() == "EXIT=0"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        subprocess.run(["rm", "-f", marker])
