"""Pick an attention backend by name.

"torch" is the plain-torch reference (any device); "sm70" runs voltllm's CUDA kernels (CUDA only).
"auto" takes sm70 on CUDA and torch elsewhere; on CUDA it falls back to torch, with a warning, when the
kernels cannot be built here or have no variant for the model's head size. Further backends register a
factory with `register_attention_backend`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from voltllm.layers.attention.backend import AttentionBackend
from voltllm.layers.attention.torch_ref import TorchAttentionBackend
from voltllm.ops.variants import HEAD_SIZES as KERNEL_HEAD_SIZES

logger = logging.getLogger(__name__)

# A factory raises RuntimeError when its backend cannot run on the given device.
BackendFactory = Callable[[torch.device], AttentionBackend]


def _torch_backend(device: torch.device) -> AttentionBackend:
    return TorchAttentionBackend()


def _sm70_backend(device: torch.device) -> AttentionBackend:
    # Imported lazily: it pulls in the kernel build machinery, which CPU-only runs never need.
    from voltllm.layers.attention.sm70 import SM70AttentionBackend

    return SM70AttentionBackend(device)


_BACKENDS: dict[str, BackendFactory] = {"torch": _torch_backend, "sm70": _sm70_backend}


def register_attention_backend(name: str, factory: BackendFactory) -> None:
    """Make a backend selectable by `name` (replacing any backend of that name)."""
    if name == "auto":
        raise ValueError('"auto" is reserved for automatic selection')
    _BACKENDS[name] = factory


def available_attention_backends() -> list[str]:
    return ["auto", *_BACKENDS]


def get_attention_backend(
    name: str, device: torch.device | str, head_size: int | None = None
) -> AttentionBackend:
    """Build the backend called `name` for `device`; `head_size` (the model's, when known) lets "auto"
    pass over kernels that have no variant for it.

    Raises ValueError for an unknown name and RuntimeError when the named backend cannot run there.
    """
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            return _torch_backend(device)
        if head_size is not None and head_size not in KERNEL_HEAD_SIZES:
            logger.warning(
                "the CUDA attention kernels have no head size %d (they have %s); using the torch reference "
                "backend",
                head_size,
                ", ".join(map(str, KERNEL_HEAD_SIZES)),
            )
            return _torch_backend(device)
        try:
            return _sm70_backend(device)
        except RuntimeError as e:
            logger.warning("CUDA attention kernels unavailable (%s); using the torch reference backend", e)
            return _torch_backend(device)
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(available_attention_backends())}"
        )
    return _BACKENDS[name](device)
