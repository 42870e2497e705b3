"""lm-evaluation-harness against `voltllm serve`: its `local-completions` model (echo + logprobs over
/v1/completions) scores a local 12-item multiple-choice task exactly as its own `hf` model does on the
same model folder, item by item (loglikelihoods within 1e-3) and in accuracy."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from voltllm_cli import serving

from voltllm.loader.default_model import default_model_dir

lm_eval = pytest.importorskip("lm_eval")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The task YAML with its data file named by absolute path (lm-eval reads it relative to cwd)."""
    out = tmp_path_factory.mktemp("lm_eval_task")
    task = yaml.safe_load((FIXTURE / "voltllm_mc.yaml").read_text())
    task["dataset_kwargs"]["data_files"]["test"] = str(FIXTURE / "mc.jsonl")
    (out / "voltllm_mc.yaml").write_text(yaml.safe_dump(task))
    return out


def evaluate(task_dir: Path, model: str, model_args: str) -> tuple[float, list[list[float]]]:
    """lm-eval's accuracy and, per item in document order, each choice's loglikelihood."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["voltllm_mc"],
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        batch_size=1,
    )
    samples = sorted(results["samples"]["voltllm_mc"], key=lambda s: s["doc_id"])
    loglikelihoods = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    return results["results"]["voltllm_mc"]["acc,none"], loglikelihoods


@pytest.mark.slow
def test_local_completions_equals_hf(task_dir: Path) -> None:
    model_dir = default_model_dir()
    hf_acc, hf_ll = evaluate(task_dir, "hf", f"pretrained={model_dir},dtype=float32,device=cpu")
    with serving("--num-kv-blocks", "256") as (_, base):
        name = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        args = (
            f"model={name},base_url={base}/v1/completions,tokenizer={model_dir},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"
        )
        served_acc, served_ll = evaluate(task_dir, "local-completions", args)
    assert len(served_ll) == len(hf_ll) == 12
    for item, (served, hf) in enumerate(zip(served_ll, hf_ll, strict=True)):
        assert served == pytest.approx(hf, abs=1e-3), item
    assert served_acc == hf_acc
    # The task discriminates: all-zero scores (the bug this guards against) give the always-first 1/3.
    assert hf_acc > 1 / 3
