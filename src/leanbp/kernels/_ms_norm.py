"""Triton kernels for MS-LayerNorm / MS-RMSNorm: one program per row. Reference:
``leanbp.approx._norms`` (same math, fp32 inside)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fwd_kernel(x_ptr, y_ptr, rstd_ptr, n_cols, eps, CENTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if CENTER:
        x = tl.where(mask, x - tl.sum(x, axis=0) / n_cols, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(y_ptr + row * n_cols + cols, (x * rstd).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _bwd_kernel(g_ptr, y_ptr, rstd_ptr, dx_ptr, n_cols, CENTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    dx = g - y * (tl.sum(g * y, axis=0) / n_cols)
    if CENTER:
        dx = dx - tl.sum(g, axis=0) / n_cols
    tl.store(dx_ptr + row * n_cols + cols, (dx * rstd).to(dx_ptr.dtype.element_ty), mask=mask)


def ms_norm_forward(x: torch.Tensor, eps: float, center: bool, out_dtype: torch.dtype):
    """(y (x's shape, out_dtype), rstd (..., 1) fp32)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    rows, cols = x2.shape
    y = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
    rstd = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    _fwd_kernel[(rows,)](x2, y, rstd, cols, eps, CENTER=center, BLOCK=triton.next_power_of_2(cols))
    return y.view(x.shape), rstd.view(*x.shape[:-1], 1)


def ms_norm_backward(grad_y: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, center: bool,
                     input_dtype: torch.dtype) -> torch.Tensor:
    g2 = grad_y.reshape(-1, grad_y.shape[-1]).contiguous()
    y2 = y.reshape(-1, y.shape[-1]).contiguous()
    rows, cols = g2.shape
    dx = torch.empty((rows, cols), dtype=input_dtype, device=g2.device)
    _bwd_kernel[(rows,)](g2, y2, rstd.reshape(-1).contiguous(), dx, cols, CENTER=center,
                         BLOCK=triton.next_power_of_2(cols))
    return dx.view(grad_y.shape)
