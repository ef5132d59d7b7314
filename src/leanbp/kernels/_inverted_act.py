"""Triton kernels for Inverted Activations: exact activation forward + side bits packed in planes,
and the backward from the saved output, the bits and each side's Chebyshev series. Reference:
``leanbp.approx._inverted``.

The bits' layout (``approx._inverted.pack_bits``): with w = ceil(N / 8), bit k of byte i is element
k w + i. A program owns BYTES consecutive bytes, so it reads and writes an (8, BYTES) tile: eight
contiguous runs of elements, one per plane."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BYTES = 128  # bytes per program: 8 x 128 elements
KINDS = {"silu": 0, "gelu": 1, "gelu_pytorch_tanh": 2}


@triton.jit
def _fwd_kernel(x_ptr, y_ptr, packed_ptr, n, width, x_min, KIND: tl.constexpr, BYTES: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BYTES + tl.arange(0, BYTES)  # (BYTES,) the bytes
    planes = tl.arange(0, 8)
    offs = planes[:, None] * width + cols[None, :]  # (8, BYTES) their elements
    mask = (cols[None, :] < width) & (offs < n)
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
    byte = tl.sum(side << planes[:, None], axis=0)  # plane k at bit k
    tl.store(packed_ptr + cols, byte.to(tl.uint8), mask=cols < width)


@triton.jit
def _bwd_kernel(g_ptr, y_ptr, packed_ptr, right_ptr, left_ptr, dx_ptr, n, width, y_min, u_right, u_left,
                DEGREE: tl.constexpr, BYTES: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BYTES + tl.arange(0, BYTES)
    planes = tl.arange(0, 8)
    offs = planes[:, None] * width + cols[None, :]
    mask = (cols[None, :] < width) & (offs < n)
    byte = tl.load(packed_ptr + cols, mask=cols < width, other=0).to(tl.int32)
    is_left = ((byte[None, :] >> planes[:, None]) & 1) == 1  # (8, BYTES)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u_end = tl.where(is_left, u_left, u_right)
    t = tl.minimum(tl.sqrt(tl.maximum(y - y_min, 0.0)), u_end) / u_end * 2.0 - 1.0
    # Clenshaw: b_k = c_k + 2 t b_(k+1) - b_(k+2); f' = c_0 + t b_1 - b_2
    b1 = tl.where(is_left, tl.load(left_ptr + DEGREE), tl.load(right_ptr + DEGREE))
    b2 = tl.zeros_like(t)
    for j in tl.static_range(1, DEGREE):
        k = DEGREE - j
        b1, b2 = 2.0 * t * b1 - b2 + tl.where(is_left, tl.load(left_ptr + k), tl.load(right_ptr + k)), b1
    d = t * b1 - b2 + tl.where(is_left, tl.load(left_ptr), tl.load(right_ptr))
    d = tl.where(y == y, d, y)  # a NaN output keeps a NaN derivative, as in the exact backward
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + offs, (g * d).to(dx_ptr.dtype.element_ty), mask=mask)


def _width(n: int) -> int:
    return (n + 7) // 8


def inverted_forward(kind: str, x: torch.Tensor, x_min: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_min``: the reference's threshold for x's dtype (``approx._inverted.side_threshold``), a
    value fp32 holds exactly, so the kernel's fp32 comparison gives the reference's bits."""
    x = x.contiguous()
    n, width = x.numel(), _width(x.numel())
    y = torch.empty_like(x)
    packed = torch.empty(width, dtype=torch.uint8, device=x.device)
    _fwd_kernel[(triton.cdiv(width, BYTES),)](x, y, packed, n, width, x_min, KIND=KINDS[kind], BYTES=BYTES)
    return y, packed


def inverted_backward(grad_out: torch.Tensor, y: torch.Tensor, packed: torch.Tensor, fit) -> torch.Tensor:
    """``fit``: the reference's ``InverseFit`` (its float32 coefficients are what the kernel reads)."""
    grad_out, y = grad_out.contiguous(), y.contiguous()
    n, width = grad_out.numel(), packed.numel()
    dx = torch.empty_like(grad_out)
    right, left = fit.on(y.device, torch.float32)
    _bwd_kernel[(triton.cdiv(width, BYTES),)](grad_out, y, packed, right, left, dx, n, width, fit.y_min,
                                             fit.u_right, fit.u_left, DEGREE=right.numel() - 1, BYTES=BYTES)
    return dx
