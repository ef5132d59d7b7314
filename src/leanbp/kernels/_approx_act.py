"""Triton kernels for ReGELU2 / ReSiLU2: exact activation forward + packed 2-bit codes, and the
step-function backward from the packed codes. Reference: ``leanbp.approx._activations``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements per program; a multiple of 4 so each program writes whole bytes


@triton.jit
def _fwd_kernel(x_ptr, y_ptr, packed_ptr, n, c0, c1, c2, IS_GELU: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if IS_GELU:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:
        y = x / (1.0 + tl.exp(-x))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    code = (x > c0).to(tl.int32) + (x > c1).to(tl.int32) + (x > c2).to(tl.int32)
    code = tl.where(mask, code, 0)
    # 4 codes per byte, element j at bits 2 * (j % 4)
    shift = (tl.arange(0, BLOCK) % 4) * 2
    byte = tl.sum(tl.reshape(code << shift, (BLOCK // 4, 4)), axis=1)
    boffs = pid * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    tl.store(packed_ptr + boffs, byte.to(tl.uint8), mask=boffs < (n + 3) // 4)


@triton.jit
def _bwd_kernel(g_ptr, packed_ptr, dx_ptr, n, l1, l2, l3, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    byte = tl.load(packed_ptr + offs // 4, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((offs % 4) * 2)) & 3
    level = tl.where(code == 1, l1, tl.where(code == 2, l2, tl.where(code == 3, l3, 0.0)))
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + offs, (g * level).to(dx_ptr.dtype.element_ty), mask=mask)


def approx_act_forward(kind: str, x: torch.Tensor, thresholds) -> tuple[torch.Tensor, torch.Tensor]:
    """``thresholds``: the reference's for x's dtype (``approx._activations.thresholds``), values
    that fp32 holds exactly, so the kernel's fp32 comparison gives the reference's codes bit for bit."""
    x = x.contiguous()
    n = x.numel()
    y = torch.empty_like(x)
    packed = torch.empty((n + 3) // 4, dtype=torch.uint8, device=x.device)
    c0, c1, c2 = thresholds
    _fwd_kernel[(triton.cdiv(n, BLOCK),)](x, y, packed, n, c0, c1, c2, IS_GELU=kind == "gelu", BLOCK=BLOCK)
    return y, packed


def approx_act_backward(grad_out: torch.Tensor, packed: torch.Tensor, consts) -> torch.Tensor:
    grad_out = grad_out.contiguous()
    n = grad_out.numel()
    dx = torch.empty_like(grad_out)
    _, l1, l2, l3 = consts.levels
    _bwd_kernel[(triton.cdiv(n, BLOCK),)](grad_out, packed, dx, n, l1, l2, l3, BLOCK=BLOCK)
    return dx
