"""ReGELU2 / ReSiLU2 (Approx-BP): exact GELU / SiLU forward, 4-level step-function backward.

Backward needs only which of 4 intervals each input fell in, so only a 2-bit code per element is
saved: flag = [x > c0] + [x > c1] + [x > c2] (strict >), packed 4 codes per uint8, element j in
byte j // 4 at bits 2 * (j % 4), least significant first: ceil(N / 4) bytes in all.
dx = dy * level[flag], level = [0, a0, a0 + a1, a0 + a1 + a2].

The constants (REFERENCES.md §2) fit the *function* (three shifted ReLUs), so the gradient is an
approximation: opt in, and say so wherever it is used.

Three layers, as everywhere in leanbp: plain functions (``*_forward`` / ``*_backward``), a thin
autograd Function, and an nn.Module with a functional alias. The plain functions are the oracle of
the kernels (``leanbp.kernels``: Triton for CUDA tensors, fused by ``torch.compile`` on the CPU)
and their fallback.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels


@dataclass(frozen=True)
class StepConstants:
    a: tuple[float, float, float]
    c: tuple[float, float, float]

    @property
    def levels(self) -> tuple[float, float, float, float]:
        a0, a1, a2 = self.a
        return (0.0, a0, a0 + a1, a0 + a1 + a2)


REGELU2 = StepConstants(
    a=(-0.04922261145617846, 1.0979632065417297, -0.048740595085551286),
    c=(-3.1858810036855245, -0.001178821281161997, 3.190832613414926),
)
RESILU2 = StepConstants(
    a=(-0.04060357190528599, 1.080925428529668, -0.040321856624382146),
    c=(-6.3050461001646445, -0.0008684942046214787, 6.325815242089708),
)


# -- 2-bit packing ----------------------------------------------------------------------------
def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in 0..3, any shape -> flat uint8 tensor of ceil(N / 4) bytes."""
    flat = codes.reshape(-1).to(torch.uint8)
    n = flat.numel()
    padded = F.pad(flat, (0, (-n) % 4)).view(-1, 4)  # (ceil(N/4), 4)
    return padded[:, 0] | (padded[:, 1] << 2) | (padded[:, 2] << 4) | (padded[:, 3] << 6)


def unpack_2bit(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_2bit`: the first ``numel`` codes, flat uint8."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & 3).reshape(-1)[:numel]


@functools.cache
def thresholds(consts: StepConstants, dtype: torch.dtype) -> tuple[float, float, float]:
    """The thresholds as values of ``dtype``: each c rounded down onto the dtype's grid, so that for
    every x of that dtype, x > t exactly when x > c. A comparison in the input's dtype against c
    itself would round c to the nearest value first (and miss or add the values between); against
    these, the reference (comparing in x's dtype) and the Triton kernel (comparing in fp32, into
    which every fp16/bf16/fp32 value and these thresholds convert exactly) give the same codes."""
    out = []
    for c in consts.c:
        t = torch.tensor(c, dtype=torch.float64).to(dtype)  # nearest
        if t.double() > c:  # rounded up: the next value below
            t = torch.nextafter(t, torch.tensor(float("-inf"), dtype=dtype))
        out.append(t.item())
    return tuple(out)


def step_codes(x: torch.Tensor, consts: StepConstants) -> torch.Tensor:
    """The 2-bit flag of every element (uint8, x's shape), strict > at each threshold (exactly, in
    x's dtype: ``thresholds``)."""
    c0, c1, c2 = thresholds(consts, x.dtype)
    return (x > c0).to(torch.uint8) + (x > c1).to(torch.uint8) + (x > c2).to(torch.uint8)


# -- plain forward / backward -----------------------------------------------------------------
def _exact(kind: str, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x) if kind == "gelu" else F.silu(x)


def approx_act_forward(kind: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact activation of x, packed 2-bit codes)."""
    consts = REGELU2 if kind == "gelu" else RESILU2
    return _exact(kind, x), pack_2bit(step_codes(x, consts))


def approx_act_backward(kind: str, grad_out: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    consts = REGELU2 if kind == "gelu" else RESILU2
    codes = unpack_2bit(packed, grad_out.numel()).view(grad_out.shape)
    # Memory: the derivative is built in one buffer with masked fills (no int64 index tensor, no
    # gathered copy), in fp32 for low-precision grads so the levels are not rounded first
    deriv = torch.zeros(grad_out.shape, dtype=torch.promote_types(grad_out.dtype, torch.float32),
                        device=grad_out.device)
    for code, level in enumerate(consts.levels[1:], start=1):
        deriv.masked_fill_(codes == code, level)
    del codes
    return deriv.mul_(grad_out).to(grad_out.dtype)


# -- autograd Function ------------------------------------------------------------------------
class _ApproxActFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, kind: str) -> torch.Tensor:
        consts = REGELU2 if kind == "gelu" else RESILU2
        if kernels.use_triton(x):
            y, packed = kernels.approx_act_forward(kind, x, thresholds(consts, x.dtype))
        else:
            packed = kernels.compiled_two_bit_codes(x, thresholds(consts, x.dtype)) if kernels.use_compiled(x) else None
            if packed is None:  # (float64, switched off, or no compiler here: the reference)
                y, packed = approx_act_forward(kind, x)
            else:
                y = _exact(kind, x)
        ctx.kind = kind
        ctx.save_for_backward(packed)  # Memory: 2 bits per element instead of x itself
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (packed,) = ctx.saved_tensors
        consts = REGELU2 if ctx.kind == "gelu" else RESILU2
        if kernels.use_triton(grad_out):
            return kernels.approx_act_backward(grad_out, packed, consts), None
        if kernels.use_compiled(grad_out):
            dx = kernels.compiled_two_bit_backward(grad_out.contiguous(), packed, consts)
            if dx is not None:
                return dx, None
        return approx_act_backward(ctx.kind, grad_out.contiguous(), packed), None


def regelu2(x: torch.Tensor) -> torch.Tensor:
    """GELU (erf form) forward, ReGELU2 step-function backward (approximate)."""
    if not x.requires_grad:
        return F.gelu(x)
    return _ApproxActFunction.apply(x, "gelu")


def resilu2(x: torch.Tensor) -> torch.Tensor:
    """SiLU forward, ReSiLU2 step-function backward (approximate)."""
    if not x.requires_grad:
        return F.silu(x)
    return _ApproxActFunction.apply(x, "silu")


def swiglu2(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with a ReSiLU2 backward. Saved: the 2-bit codes of ``gate`` and what the
    product genuinely needs (``silu(gate)`` for d/dup, ``up`` for d/dgate), never ``gate`` itself."""
    return resilu2(gate) * up


class ReGELU2(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return regelu2(x)


class ReSiLU2(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return resilu2(x)


def saved_bytes(numel: int) -> int:
    """Bytes ReGELU2 / ReSiLU2 save for an input of ``numel`` elements."""
    return math.ceil(numel / 4)
