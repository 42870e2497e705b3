"""Decides, per call, whether an op runs the CUDA kernel or its torch reference."""

from __future__ import annotations

import torch

from voltllm.ops.build import load


def use_kernels(tensor: torch.Tensor) -> bool:
    """True when `tensor` lives on a CUDA device: the kernels are then built (once) and used.

    Tensors on other devices use the torch reference. A CUDA tensor never falls back silently: if the
    kernels cannot be built, `KernelBuildError` says why.
    """
    if not tensor.is_cuda:
        return False
    load()
    return True


def kernel_ops() -> torch._ops._OpNamespace:
    return torch.ops.voltllm_C
