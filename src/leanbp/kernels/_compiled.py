"""Fused CPU kernels of the approximate activations (inverted, and ReSiLU2/ReGELU2's 2-bit codes),
written as PyTorch and compiled by ``torch.compile`` (inductor turns each into one C++ loop over
the elements).

The PyTorch reference in ``leanbp.approx._inverted`` runs a dozen whole-tensor passes per backward
(copy, sqrt, int conversion, unpacking, two gathers, ...), each of which reads and writes every
element: on 11M elements here, 284 ms against 33 ms for the exact SiLU backward. The same
arithmetic fused into one loop takes 72 ms; the forward's side bits likewise (three passes and a
reduction in the reference). The reference stays the oracle (the tests compare the
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

def side_bits(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """[x < threshold] packed 8 per byte, element j at bit j % 8 (the activation itself stays
    PyTorch's own kernel, so the forward is bit for bit the exact one). Written as a sum of int32
    bit weights: inductor fuses that into one loop (24 ms on 11M elements), where shifting uint8
    bits and summing them compiled to a loop 30x slower."""
    flat = x.reshape(-1)
    bits = F.pad(flat < threshold, (0, (-flat.numel()) % 8)).view(-1, 8).to(torch.int32)  # (ceil(N/8), 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32, device=x.device)
    return (bits * weights).sum(1).to(torch.uint8)


def inverted_backward(grad_out: torch.Tensor, y: torch.Tensor, packed: torch.Tensor, values: torch.Tensor,
                      slopes: torch.Tensor, y_min: float, inv_step: float, points: int) -> torch.Tensor:
    """grad_out * f'(f^-1(y)), f' interpolated in the table (``approx._inverted.InverseTable``)."""
    j = torch.arange(y.numel(), device=y.device)  # (N,) element indices: which bit of which byte
    side = (packed[j // 8].to(torch.int32) >> (j % 8).to(torch.int32)) & 1
    pos = (y.reshape(-1).float() - y_min).clamp(min=0).sqrt() * inv_step
    below = pos.to(torch.int32).clamp(0, points - 2)  # (NaN lands in range; its result stays NaN)
    frac = pos - below
    index = below + side * points
    deriv = values[index] + frac * slopes[index]
    return (deriv.view(y.shape) * grad_out.float()).to(grad_out.dtype)


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
