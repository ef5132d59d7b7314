"""Fused CPU kernels of the approximate activations (inverted, and ReSiLU2/ReGELU2's 2-bit codes),
written as PyTorch and compiled by ``torch.compile`` (inductor turns each into one C++ loop over
the elements).

The PyTorch reference in ``leanbp.approx._inverted`` runs dozens of whole-block passes per backward
(a copy, the square root, the unpacking, each step of the series), each of which reads and writes
every element. Fused into one loop, the backward of 11.3M bf16 elements takes about 12 ms here (AMD
EPYC, 2 cores) against 4.3 ms for the exact SiLU backward, and the side bits 1.3 ms beside the
SiLU's 4-9 ms. The reference stays the oracle (the tests compare the
two) and the fallback: where no C++ compiler is found, or ``LEANBP_COMPILE=0``, or for float64
(exactness checks keep the reference), the reference runs. The first call in a process compiles
(seconds; inductor caches the code on disk for later processes).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

_PLANE_WEIGHTS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)  # bit k of a byte: plane k


def side_bits(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """[x < threshold] packed in planes (``approx._inverted.pack_bits``: bit k of byte i is element
    k N/8 + i; N divisible by 8, which the caller checks). The activation itself stays PyTorch's own
    kernel, so the forward is bit for bit the exact one. The bytes are a float sum of 0/1 times the
    bit weights: inductor vectorizes that over i (uint8 or int32 shifts compiled to loops several
    times slower)."""
    weights = torch.tensor(_PLANE_WEIGHTS, device=x.device).view(8, 1)
    return ((x.reshape(8, -1) < threshold).float() * weights).sum(0).to(torch.uint8)


def inverted_backward(grad_out: torch.Tensor, y: torch.Tensor, packed: torch.Tensor, right: torch.Tensor,
                      left: torch.Tensor, y_min: float, u_right: float, u_left: float) -> torch.Tensor:
    """grad_out * f'(f^-1(y)), f' from each side's Chebyshev series (``approx._inverted.InverseFit``)
    in u = sqrt(y - y_min); the bits in planes, N divisible by 8. Returns the gradient as (8, N/8)."""
    # bit k of each byte, floor(p / 2^k) mod 2, in fp32 (exact for bytes; see side_bits for why float)
    q = packed.float() / torch.tensor(_PLANE_WEIGHTS, device=y.device).view(8, 1)  # (8, N/8)
    is_left = (q.floor() - 2 * (q * 0.5).floor()) > 0.5
    u = (y.reshape(8, -1).float() - y_min).clamp(min=0).sqrt()  # (a NaN output stays NaN to the end)
    u_end = torch.where(is_left, u_left, u_right)
    t = torch.minimum(u, u_end) / u_end * 2 - 1
    # Clenshaw: b_k = c_k + 2 t b_(k+1) - b_(k+2); f' = c_0 + t b_1 - b_2
    degree = right.numel() - 1
    b1, b2 = torch.where(is_left, left[degree], right[degree]), torch.zeros_like(t)
    for k in range(degree - 1, 0, -1):
        b1, b2 = 2 * t * b1 - b2 + torch.where(is_left, left[k], right[k]), b1
    deriv = t * b1 - b2 + torch.where(is_left, left[0], right[0])
    # (8, N/8): the caller views it as grad_out's shape (inside, inductor cannot prove that 8 (N // 8)
    # is N, and the view compiled to a second pass with a modulo per element)
    return (deriv * grad_out.reshape(8, -1).float()).to(grad_out.dtype)


def two_bit_codes(x: torch.Tensor, c0: float, c1: float, c2: float) -> torch.Tensor:
    """ReSiLU2/ReGELU2's codes [x > c0] + [x > c1] + [x > c2], packed 4 per byte, element j at bits
    2 * (j % 4) (the thresholds: the reference's, on x's grid)."""
    flat = x.reshape(-1)
    codes = (flat > c0).to(torch.int32) + (flat > c1).to(torch.int32) + (flat > c2).to(torch.int32)
    codes = F.pad(codes, (0, (-flat.numel()) % 4)).view(-1, 4)  # (ceil(N/4), 4)
    weights = torch.tensor([1, 4, 16, 64], dtype=torch.int32, device=x.device)
    return (codes * weights).sum(1).to(torch.uint8)


def two_bit_backward(grad_out: torch.Tensor, packed: torch.Tensor, l1: float, l2: float, l3: float) -> torch.Tensor:
    """grad_out * level[code], the level of each element's 2-bit code (0, l1, l2, l3)."""
    j = torch.arange(grad_out.numel(), device=grad_out.device)
    code = (packed[j // 4].to(torch.int32) >> ((j % 4) * 2).to(torch.int32)) & 3
    level = torch.where(code == 1, l1, torch.where(code == 2, l2, torch.where(code == 3, l3, 0.0)))
    return (level.view(grad_out.shape) * grad_out.float()).to(grad_out.dtype)


@functools.cache
def _switched_off() -> bool:
    """``LEANBP_COMPILE=0``: the PyTorch references on the CPU (read once per process)."""
    return os.environ.get("LEANBP_COMPILE", "1") == "0"


_failed: list[str] = []  # why compiling failed, once: every later call takes the reference


def use_compiled(x: torch.Tensor) -> bool:
    """CPU tensors other than float64, unless switched off, or compiling has failed here before,
    or a dispatch mode watches the ops (leanbp's memory tracker, FakeTensorMode): under one,
    compiled code runs its graph op by op with every intermediate materialized (215 MiB for a
    10.8 MiB result, measured), and fake tensors cannot run it at all, so the reference runs there,
    whose temporaries are bounded by its blocks."""
    return (x.device.type == "cpu" and x.dtype != torch.float64 and not _switched_off() and not _failed
            and _get_current_dispatch_mode() is None)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def run(fn, *args, **kwargs):
    """``fn`` compiled (once per process), or None if it cannot be compiled here (warned once);
    the caller then runs its reference."""
    try:
        with torch.no_grad():
            return _compiled(fn)(*args, **kwargs)
    except Exception as e:  # (a missing or broken C++ compiler surfaces as many exception types)
        _failed.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        warnings.warn(f"leanbp: torch.compile of the fused CPU kernel {fn.__name__} failed ({_failed[0]}); "
                      "using the PyTorch reference (slower, same results). LEANBP_COMPILE=0 skips the attempt.",
                      stacklevel=2)
        return None


__all__ = ["inverted_backward", "run", "side_bits", "two_bit_backward", "two_bit_codes", "use_compiled"]
