"""Memory-sharing LayerNorm / RMSNorm (MS-BP): no affine, save the output and one rstd per row.

The output y is what the following linear layer saves for its weight gradient anyway; if the norm
saves *that very tensor* its own activation memory is one fp32 rstd per row. The affine (gamma,
beta) is folded into the following linear layers (see ``_patch.py``). Under autocast the output is
produced directly in the autocast dtype, because a cast in front of the linear would make the
linear save a copy and silently lose the sharing.

LN:  y = (x - mean) * rstd,  dx = rstd * (g - mean(g) - y * mean(g * y))
RMS: y = x * rstd,           dx = rstd * (g - y * mean(g * y))

The plain functions are the CPU path and the oracle of the Triton kernels
(``leanbp.kernels``) used for CUDA tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def ms_norm_forward(x: torch.Tensor, eps: float, center: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y in the output dtype, rstd (..., 1) in fp32 (fp64 for fp64 input)."""
    xc = x.to(_compute_dtype(x.dtype))
    if center:
        xc = xc - xc.mean(-1, keepdim=True)
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return (xc * rstd).to(_output_dtype(x)), rstd


def ms_norm_backward(grad_y: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, center: bool,
                     input_dtype: torch.dtype) -> torch.Tensor:
    g = grad_y.to(rstd.dtype)
    yc = y.to(rstd.dtype)
    dx = g - yc * (g * yc).mean(-1, keepdim=True)
    if center:
        dx = dx - g.mean(-1, keepdim=True)
    return (dx * rstd).to(input_dtype)


class _MSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float, center: bool) -> torch.Tensor:
        if kernels.use_triton(x):
            y, rstd = kernels.ms_norm_forward(x, eps, center, _output_dtype(x))
        else:
            y, rstd = ms_norm_forward(x, eps, center)
        # Memory: the output (shared with the next linear) and one rstd per row, never x
        ctx.save_for_backward(y, rstd)
        ctx.center, ctx.input_dtype = center, x.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        y, rstd = ctx.saved_tensors
        if kernels.use_triton(grad_y):
            return kernels.ms_norm_backward(grad_y, y, rstd, ctx.center, ctx.input_dtype), None, None
        return ms_norm_backward(grad_y, y, rstd, ctx.center, ctx.input_dtype), None, None


def ms_layer_norm(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return _MSNormFunction.apply(x, eps, True)


def ms_rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return _MSNormFunction.apply(x, eps, False)


class _MSNorm(nn.Module):
    center: bool

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MSNormFunction.apply(x, self.eps, self.center)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


class MSLayerNorm(_MSNorm):
    """LayerNorm without affine whose backward needs only its output and a per-row rstd."""

    center = True

    def __init__(self, eps: float = 1e-5):
        super().__init__(eps)


class MSRMSNorm(_MSNorm):
    """RMSNorm without affine whose backward needs only its output and a per-row rstd."""

    center = False

    def __init__(self, eps: float = 1e-6):
        super().__init__(eps)
