"""When to run a Triton kernel instead of the PyTorch reference."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """CUDA tensors with triton installed (LEANBP_TRITON=0 turns it off), except float64: the
    kernels compute in fp32, so float64 (exactness checks) keeps the reference."""
    return x.is_cuda and x.dtype != torch.float64 and triton_available() and os.environ.get("LEANBP_TRITON", "1") != "0"
