"""The engine tests reuse the toy model of tests/worker (a model without `voltllm.models`) and the tiny
Hugging Face checkpoints of tests/models."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "worker"))
sys.path.insert(0, str(TESTS / "models"))
