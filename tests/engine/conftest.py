"""The engine tests reuse the toy model of tests/worker (a model without `voltllm.models`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))
