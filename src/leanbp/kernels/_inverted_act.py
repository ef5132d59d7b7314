"""Triton kernels for Inverted Activations: exact activation forward + packed side bits, and the
backward from the saved output, the bits and the derivative table. Reference:
``leanbp.approx._inverted``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements per program; a multiple of 8 so each program writes whole bytes
KINDS = {"silu": 0, "gelu": 1, "gelu_pytorch_tanh": 2}


@triton.jit
def _fwd_kernel(x_ptr, y_ptr, packed_ptr, n, x_min, KIND: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if KIND == 0:
        y = x / (1.0 + tl.exp(-x))
    elif KIND == 1:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:  # tanh(z) = 2 / (1 + exp(-2z)) - 1
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = 0.5 * x * (2.0 / (1.0 + tl.exp(-2.0 * z)))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    side = tl.where(mask & (x < x_min), 1, 0)
    # 8 bits per byte, element j at bit j % 8
    byte = tl.sum(tl.reshape(side << (tl.arange(0, BLOCK) % 8), (BLOCK // 8, 8)), axis=1)
    boffs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    tl.store(packed_ptr + boffs, byte.to(tl.uint8), mask=boffs < (n + 7) // 8)


@triton.jit
def _bwd_kernel(g_ptr, y_ptr, packed_ptr, values_ptr, slopes_ptr, dx_ptr, n, y_min, inv_step, points,
                BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    byte = tl.load(packed_ptr + offs // 8, mask=mask, other=0).to(tl.int32)
    side = (byte >> (offs % 8)) & 1
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pos = tl.sqrt(tl.maximum(y - y_min, 0.0)) * inv_step
    below = tl.minimum(tl.maximum(pos.to(tl.int32), 0), points - 2)  # (NaN, inf: in range, the result stays NaN)
    frac = pos - below.to(tl.float32)
    index = below + side * points
    d = tl.load(values_ptr + index, mask=mask, other=0.0) + frac * tl.load(slopes_ptr + index, mask=mask, other=0.0)
    d = tl.where(y == y, d, y)  # a NaN output keeps a NaN derivative, as in the exact backward
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + offs, (g * d).to(dx_ptr.dtype.element_ty), mask=mask)


def inverted_forward(kind: str, x: torch.Tensor, x_min: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_min``: the reference's threshold for x's dtype (``approx._inverted.side_threshold``), a
    value fp32 holds exactly, so the kernel's fp32 comparison gives the reference's bits."""
    x = x.contiguous()
    n = x.numel()
    y = torch.empty_like(x)
    packed = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    _fwd_kernel[(triton.cdiv(n, BLOCK),)](x, y, packed, n, x_min, KIND=KINDS[kind], BLOCK=BLOCK)
    return y, packed


def inverted_backward(grad_out: torch.Tensor, y: torch.Tensor, packed: torch.Tensor, table) -> torch.Tensor:
    """``table``: the reference's ``InverseTable`` (its float32 entries are what the kernel reads)."""
    grad_out, y = grad_out.contiguous(), y.contiguous()
    n = grad_out.numel()
    dx = torch.empty_like(grad_out)
    values, slopes = table.on(y.device, torch.float32)
    _bwd_kernel[(triton.cdiv(n, BLOCK),)](grad_out, y, packed, values, slopes, dx, n, table.y_min, 1.0 / table.step,
                                         table.points, BLOCK=BLOCK)
    return dx
