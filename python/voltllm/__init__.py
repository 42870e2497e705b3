"""voltllm: an OpenAI-compatible LLM inference server for NVIDIA Volta and newer GPUs.

`from voltllm import LLM, SamplingParams` is the offline API. Names are imported lazily so that the CLI
and the text layer (`voltllm._core`) start without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

if TYPE_CHECKING:
    from voltllm.entrypoints.llm import LLM
    from voltllm.outputs import CompletionOutput, RequestOutput
    from voltllm.sampling_params import SamplingParams

_LAZY = {
    "LLM": "voltllm.entrypoints.llm",
    "SamplingParams": "voltllm.sampling_params",
    "RequestOutput": "voltllm.outputs",
    "CompletionOutput": "voltllm.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'voltllm' has no attribute {name!r}")
