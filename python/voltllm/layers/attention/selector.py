"""Pick an attention backend by name. Backends register a factory here; "auto" picks the best available."""

from __future__ import annotations

from collections.abc import Callable

import torch

from voltllm.layers.attention.backend import AttentionBackend
from voltllm.layers.attention.torch_ref import TorchAttentionBackend

BackendFactory = Callable[[torch.device], AttentionBackend]

_BACKENDS: dict[str, BackendFactory] = {"torch": lambda device: TorchAttentionBackend()}
# Order "auto" tries, best first; a factory may raise RuntimeError when it cannot run on `device`.
_AUTO_ORDER: list[str] = ["torch"]


def register_attention_backend(name: str, factory: BackendFactory, prefer_for_auto: bool = False) -> None:
    """Make a backend selectable by `name`; with `prefer_for_auto`, "auto" tries it before the others."""
    _BACKENDS[name] = factory
    if prefer_for_auto and name not in _AUTO_ORDER:
        _AUTO_ORDER.insert(0, name)


def available_attention_backends() -> list[str]:
    return ["auto", *_BACKENDS]


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Build the backend called `name` ("auto" = the first of the preferred backends that can run)."""
    device = torch.device(device)
    if name == "auto":
        errors = []
        for candidate in _AUTO_ORDER:
            try:
                return _BACKENDS[candidate](device)
            except RuntimeError as e:  # not usable here (e.g. no GPU); fall through to the next
                errors.append(f"{candidate}: {e}")
        raise RuntimeError(f"no attention backend can run on {device}: {'; '.join(errors)}")
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(available_attention_backends())}"
        )
    return _BACKENDS[name](device)
