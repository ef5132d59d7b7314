"""The dtypes by the names the command line and the configs use for them."""

from __future__ import annotations

import torch

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# how frozen base weights may be stored: in their dtype, or in bitsandbytes' 4-bit NormalFloat with
# double quantization (QLoRA: LoRA trains on top); ``leanbp bench`` and ``leanbp plan --quantize``
QUANTIZE = ("none", "nf4")


def dtype_named(name: str, allowed=tuple(DTYPES)) -> torch.dtype:
    """The dtype called ``name``, one of ``allowed`` (else a ValueError that lists them)."""
    if name not in allowed:
        raise ValueError(f"dtype must be one of {list(allowed)}, got {name!r}")
    return DTYPES[name]
