"""`voltllm serve --tensor-parallel-size 2` on the CPU: the engine process is rank 0 and starts a
worker; the server answers transformers' greedy tokens, and no worker outlives the server."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import torch
from voltllm_cli import descendants, serving

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "models"))
from tiny_models import add_fixture_tokenizer, hf_greedy, save_plain_model  # noqa: E402

PROMPT = [5, 17, 42, 99, 7, 250, 31]
NEW_TOKENS = 8


def test_serve_tensor_parallel_answers_transformers_and_stops_its_worker(tmp_path: Path) -> None:
    model_dir, hf_model = save_plain_model("llama", tmp_path / "llama", num_key_value_heads=1)
    add_fixture_tokenizer(model_dir)
    with torch.inference_mode():
        expected, _ = hf_greedy(hf_model, PROMPT, NEW_TOKENS)
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    args = (str(model_dir), "--tensor-parallel-size", "2", "--num-kv-blocks", "64", "--device", "cpu")
    with serving(*args, "--dtype", "float32") as (server, base):
        workers = [pid for pid, cmd in descendants(server.pid) if b"voltllm.engine.tp_worker" in cmd]
        assert len(workers) == 1
        resp = httpx.post(f"{base}/v1/completions", json={"model": str(model_dir), **body}, timeout=120)
        assert resp.status_code == 200, resp.text
        reference = httpx.post(f"{base}/detokenize", json={"tokens": expected}, timeout=30)
    assert resp.json()["choices"][0]["text"] == reference.json()["prompt"]
    deadline = time.monotonic() + 30
    while Path(f"/proc/{workers[0]}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{workers[0]}").exists(), "the worker outlived the server"
