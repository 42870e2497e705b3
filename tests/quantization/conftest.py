"""The quantization tests reuse the tiny Hugging Face checkpoints of tests/models, the `voltllm serve`
helpers of tests/entrypoints and the benchmarks' model shapes (benches/model_shapes.py)."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "models"))
sys.path.insert(0, str(TESTS / "entrypoints"))
sys.path.insert(0, str(TESTS.parent / "benches"))


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread: on a shared 2-core machine a second thread waits for a descheduled core on
    every op (the tiny models here run 3-10x slower with two)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
