"""bitsandbytes' 4-bit (nf4) linear layers, as the planner's fake steps run them.

bitsandbytes' ``Params4bit`` is a tensor subclass that cannot wrap a fake tensor, so a planned
QLoRA model gets this stand-in for each ``Linear4bit``, with the same bytes and the same lifetimes
(bitsandbytes 0.50, ``nn/modules.py`` and ``autograd/_functions.py``):

* resident: the packed weight, two 4-bit codes a byte (``Params4bit``'s uint8 (n/2, 1) storage),
  and the quantization statistics: an absmax per block of 64 weights, fp32, or with double
  quantization a uint8 code per block plus an fp32 absmax per 256 blocks;
* each call (``MatMul4Bit``): the weight dequantized to the compute dtype, used and dropped; the
  forward saves nothing for the backward but the packed weight (frozen: no weight gradient, so no
  input is kept), and the backward dequantizes again for the input's gradient.

A subclass of ``nn.Linear`` (as ``Linear4bit`` is), so PEFT's LoRA wraps it like any linear layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

NF4_BLOCK = 64  # weights per absmax (bitsandbytes' default 4-bit blocksize)
NESTED_BLOCK = 256  # absmax codes per fp32 absmax under double quantization


class _Nf4Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, out_features: int, in_features: int):
        ctx.save_for_backward(packed)  # (resident already: the only thing kept)
        ctx.shape = (out_features, in_features)
        return nn.functional.linear(x, _dequantized(packed, ctx.shape, x.dtype))

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        return grad @ _dequantized(packed, ctx.shape, grad.dtype), None, None, None


def _dequantized(packed: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight as bitsandbytes allocates it (one (out, in) tensor in the compute
    dtype). The planner's tensors are fake: only its size and lifetime are measured, so nothing is
    decoded."""
    return torch.empty(shape, dtype=dtype, device=packed.device)


class PlannedNf4Linear(nn.Linear):
    """A planned ``bitsandbytes.nn.Linear4bit`` (see the module's docstring) in place of ``linear``."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype, double_quant: bool = True):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype
        n = self.in_features * self.out_features
        blocks = math.ceil(n / NF4_BLOCK)
        frozen = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        device = linear.weight.device
        self.weight = frozen(torch.empty(math.ceil(n / 2), 1, dtype=torch.uint8, device=device))
        self.absmax = frozen(torch.empty(blocks, dtype=torch.uint8 if double_quant else torch.float32, device=device))
        if double_quant:
            self.nested_absmax = frozen(torch.empty(math.ceil(blocks / NESTED_BLOCK), dtype=torch.float32,
                                                    device=device))
        self.bias = None if linear.bias is None else frozen(linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        out = _Nf4Matmul.apply(x.to(self.compute_dtype), self.weight, self.out_features, self.in_features)
        if self.bias is not None:
            out = out + self.bias.to(self.compute_dtype)
        return out.to(dtype)


def planned_nf4(model: nn.Module, compute_dtype: torch.dtype, double_quant: bool = True) -> nn.Module:
    """``model`` with every linear layer of its decoder in 4 bits, as ``from_pretrained`` with a
    ``BitsAndBytesConfig(load_in_4bit=True)`` loads it (the head and the embeddings stay as they are)."""
    from ..models import adapter_for

    for layer in adapter_for(model).layers():
        for name, module in list(layer.named_modules()):
            if type(module) is nn.Linear:
                parent_name, _, child = name.rpartition(".")
                parent = layer.get_submodule(parent_name) if parent_name else layer
                setattr(parent, child, PlannedNf4Linear(module, compute_dtype, double_quant))
    return model


__all__ = ["PlannedNf4Linear", "planned_nf4"]
