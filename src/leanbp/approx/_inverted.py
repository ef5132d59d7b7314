"""Inverted Activations: a pointwise nonlinearity saves its *output*, not its input.

SiLU and GELU have one minimum, at x*, with value y* = f(x*): every output y >= y* comes from
exactly two inputs, one on each side of x*. So the derivative f'(x) that backward needs is a
function of the output and one bit, the side:

    f'(x) = D_side(y),   side = [x < x*]

and y is what the next operation saves anyway: in SwiGLU / GeGLU ``act(gate) * up`` the product
saves ``act(gate)`` for d/dup; in a plain MLP the next linear saves it as its input. Saving the
very same tensor (not a copy: ``ctx.save_for_backward`` of the output) costs no memory, so an
activation keeps 1 bit per element instead of its whole input (ReSiLU2/ReGELU2 keep 2 bits, with
a 4-level step function for f').

D_side is tabulated, not fitted: near y* the inverse has a square-root singularity (f'(x*) = 0,
f'(x) ~ sqrt(2 f''(x*) (y - y*))), so each side's f' is tabulated on the uniform grid of
u = sqrt(y - y*), where it is smooth, and interpolated linearly. The tables are built once per
function in float64 (each grid point inverted by bisection on its side, f' by autograd: any
pointwise f with one minimum works), 4096 points per side. Measured against the exact derivative
on every fp32 input of [-30, 30] at spacing 3e-5 (``derivative_error``): SiLU 1.2e-4, GELU (erf)
2.5e-4, GELU (tanh) 1.1e-4; the method's paper fitted approximations reach about 2.9e-3 (SiLU)
and 1.9e-2 (GELU). With a bf16 output (autocast) the output itself is rounded to 8 bits of
mantissa, which bounds any inversion near the minimum (the derivative error there grows to about
5e-2, in the same region ReSiLU2's steps are off by up to 0.1).

Approximate gradients: opt in (``leanbp.approx(model, activations="inverted")``), and say so.

Three layers, as everywhere in leanbp: plain functions (``inverted_forward`` /
``inverted_backward``, the oracle of the kernels and their fallback), a thin autograd Function, and
an nn.Module with a functional alias. The kernels (``leanbp.kernels``): Triton on CUDA, and on the
CPU the same arithmetic fused by ``torch.compile`` into one loop per direction (the reference's
dozen whole-tensor passes cost 4x more).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels

# the functions with one minimum that have an inverted form, by transformers' activation name
FUNCTIONS = {
    "silu": F.silu,
    "gelu": F.gelu,  # the erf form
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
ALIASES = {"swish": "silu"}
TABLE_POINTS = 4096  # per side; the interpolation error falls as 1 / points^2
_Y_TOP = 20.0  # right side tabulated up to y = 20, where f' = 1 to within 1e-7; above, the last entry
_SHIFTS = (0, 1, 2, 3, 4, 5, 6, 7)  # 8 side bits per byte, element j at bit j % 8


@dataclass(frozen=True)
class InverseTable:
    """f' as a function of (side, u = sqrt(y - y_min)) on a uniform grid of ``step``.

    ``values``: (2, points) f' on the right (x >= x_min) and left (x < x_min) side; ``slopes``:
    the difference to the next entry (so that interpolation is one fused multiply-add)."""

    kind: str
    x_min: float
    y_min: float
    step: float
    values: torch.Tensor  # (2 * points,) float64, right side first
    slopes: torch.Tensor  # (2 * points,) float64

    @property
    def points(self) -> int:
        return self.values.numel() // 2

    def on(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, slopes) on ``device``: float64 for float64 outputs, else float32."""
        return _placed(self.kind, self.points, device, torch.float64 if dtype == torch.float64 else torch.float32)


def _derivative(f, x: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        x = x.detach().clone().requires_grad_()
        (g,) = torch.autograd.grad(f(x).sum(), x)
    return g


def _bisect(f, y: torch.Tensor, lo: float, hi: float, increasing: bool) -> torch.Tensor:
    """x in [lo, hi] with f(x) = y, f monotone there (float64, to the last bit)."""
    lo_t, hi_t = torch.full_like(y, lo), torch.full_like(y, hi)
    for _ in range(200):
        mid = (lo_t + hi_t) / 2
        right = f(mid) < y if increasing else f(mid) > y
        lo_t, hi_t = torch.where(right, mid, lo_t), torch.where(right, hi_t, mid)
    return (lo_t + hi_t) / 2


@functools.cache
def inverse_table(kind: str, points: int = TABLE_POINTS) -> InverseTable:
    """The table of ``FUNCTIONS[kind]``, built in float64 (a few hundred ms, once per process)."""
    f = FUNCTIONS[kind]
    # the minimum: where f' changes sign (f' < 0 to its left)
    lo, hi = torch.tensor([-10.0], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        negative = _derivative(f, mid) < 0
        lo, hi = torch.where(negative, mid, lo), torch.where(negative, hi, mid)
    x_min = float((lo + hi) / 2)
    y_min = float(f(torch.tensor(x_min, dtype=torch.float64)))
    step = math.sqrt(_Y_TOP - y_min) / (points - 1)
    u = torch.arange(points, dtype=torch.float64) * step
    right = _derivative(f, _bisect(f, y_min + u * u, x_min, _Y_TOP + 1.0, increasing=True))
    # left side: y in [y_min, 0), x from x_min down to -inf; beyond u = sqrt(-y_min) (y >= 0, only
    # by rounding) f' is that of x = -inf: 0
    left_y = y_min + u * u
    inside = left_y < 0
    left = torch.zeros(points, dtype=torch.float64)
    left[inside] = _derivative(f, _bisect(f, left_y[inside], -1000.0, x_min, increasing=False))
    values = torch.cat([right, left])  # (2 * points,)
    slopes = torch.cat([right[1:] - right[:-1], right.new_zeros(1), left[1:] - left[:-1], left.new_zeros(1)])
    return InverseTable(kind, x_min, y_min, step, values, slopes)


@functools.cache
def _placed(kind: str, points: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    table = inverse_table(kind, points)  # (kept for the process: 64 KiB per device and dtype)
    return table.values.to(device, dtype), table.slopes.to(device, dtype)


def canonical(kind: str) -> str:
    kind = ALIASES.get(kind, kind)
    if kind not in FUNCTIONS:
        raise NotImplementedError(f"the activation {kind!r} has no inverted form; these do: "
                                  f"{', '.join([*FUNCTIONS, *ALIASES])}")
    return kind


@functools.cache
def side_threshold(kind: str, dtype: torch.dtype) -> float:
    """x_min rounded *up* onto ``dtype``'s grid: for every x of that dtype, x < t exactly when
    x < x_min (no value of the dtype lies in [x_min, t)). Compared in x's dtype (the reference) or in
    fp32 (the Triton kernel, which every fp16/bf16/fp32 value and t convert into exactly), both give
    the same bits."""
    x_min = inverse_table(kind).x_min
    t = torch.tensor(x_min, dtype=torch.float64).to(dtype)  # nearest
    if t.double() < x_min:
        t = torch.nextafter(t, torch.tensor(float("inf"), dtype=dtype))
    return t.item()


# -- 1-bit packing ------------------------------------------------------------------------------
def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool, any shape -> flat uint8 of ceil(N / 8) bytes, element j at bit j % 8 of byte j // 8."""
    flat = bits.reshape(-1).to(torch.uint8)
    padded = F.pad(flat, (0, (-flat.numel()) % 8)).view(-1, 8)  # (ceil(N/8), 8)
    shifts = torch.tensor(_SHIFTS, dtype=torch.uint8, device=bits.device)
    return (padded << shifts).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` bits, flat uint8 (0 or 1)."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & 1).view(-1)[:numel]


# -- plain forward / backward -------------------------------------------------------------------
# Memory: the reference works through the elements in blocks, so its temporaries (a float copy, an
# int32 index, the unpacked bits: about 13 bytes per element) exist for one block at a time, not
# for the whole tensor; a multiple of 8, so every block packs whole bytes
BLOCK = 1 << 20


def _blocks(numel: int):
    return ((b0, min(b0 + BLOCK, numel)) for b0 in range(0, numel, BLOCK))


def inverted_forward(kind: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact f(x), the packed side bits [x < x_min])."""
    flat, threshold = x.reshape(-1), side_threshold(kind, x.dtype)
    packed = torch.empty((flat.numel() + 7) // 8, dtype=torch.uint8, device=x.device)
    for b0, b1 in _blocks(flat.numel()):
        packed[b0 // 8: (b1 + 7) // 8] = pack_bits(flat[b0:b1] < threshold)
    return FUNCTIONS[kind](x), packed


def inverted_backward(kind: str, grad_out: torch.Tensor, y: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """grad_out * f'(f^-1(y)) on the side each bit says, interpolated in the table."""
    table = inverse_table(kind)
    values, slopes = table.on(y.device, y.dtype)
    y_flat, g_flat = y.reshape(-1), grad_out.reshape(-1)
    out = torch.empty(y.numel(), dtype=grad_out.dtype, device=grad_out.device)
    for b0, b1 in _blocks(y.numel()):
        # y itself is the shared saved output and stays untouched: each step below works in place
        # on the block's own float copy
        pos = y_flat[b0:b1].to(values.dtype, copy=True)  # (n,)
        pos.sub_(table.y_min).clamp_(min=0).sqrt_().mul_(1.0 / table.step)  # position on the u grid
        # (n,) the entry below (floor: pos >= 0); a NaN or inf output (what a NaN input gives) lands
        # in range and leaves its derivative NaN, as the exact backward would
        index = pos.to(torch.int32).clamp_(0, table.points - 2)
        pos.sub_(index)  # the fraction between it and the next
        index.add_(unpack_bits(packed[b0 // 8: (b1 + 7) // 8], b1 - b0), alpha=table.points)  # left: 2nd half
        deriv = values.index_select(0, index).addcmul_(pos, slopes.index_select(0, index))  # (n,) f'
        out[b0:b1] = deriv.mul_(g_flat[b0:b1])
    return out.view(grad_out.shape)


def derivative_error(kind: str, dtype: torch.dtype = torch.float32, low: float = -30.0, high: float = 30.0,
                     samples: int = 2_000_001) -> tuple[float, float]:
    """(max |f'(x) - interpolated f'|, the x where it is) over ``samples`` inputs of ``dtype``
    in [low, high], the exact f' in float64."""
    kind = canonical(kind)
    x = torch.linspace(low, high, samples, dtype=torch.float64).to(dtype)
    y, packed = inverted_forward(kind, x)
    approx = inverted_backward(kind, torch.ones_like(y, dtype=torch.float64), y, packed)
    error = (approx - _derivative(FUNCTIONS[kind], x.double())).abs()
    worst = int(error.argmax())
    return float(error[worst]), float(x[worst])


# -- autograd Function ------------------------------------------------------------------------
class _InvertedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, kind: str) -> torch.Tensor:
        if kernels.use_triton(x):
            y, packed = kernels.inverted_forward(kind, x, side_threshold(kind, x.dtype))
        else:
            packed = kernels.compiled_side_bits(x, side_threshold(kind, x.dtype)) if kernels.use_compiled(x) else None
            if packed is None:  # (float64, switched off, or no compiler here: the reference)
                y, packed = inverted_forward(kind, x)
            else:
                y = FUNCTIONS[kind](x)
        ctx.kind = kind
        # Memory: the output (the tensor the next op saves too: one storage) and 1 bit per element
        ctx.save_for_backward(y, packed)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        y, packed = ctx.saved_tensors
        if kernels.use_triton(grad_out):
            return kernels.inverted_backward(grad_out, y, packed, inverse_table(ctx.kind)), None
        if kernels.use_compiled(grad_out):
            dx = kernels.compiled_inverted_backward(grad_out, y, packed, inverse_table(ctx.kind))
            if dx is not None:
                return dx, None
        return inverted_backward(ctx.kind, grad_out, y, packed), None


def inverted_activation(x: torch.Tensor, kind: str = "silu") -> torch.Tensor:
    """``kind`` (silu, gelu, gelu_pytorch_tanh) forward, exact; backward from the saved output and
    one bit per element (approximate: ``derivative_error``)."""
    kind = canonical(kind)
    if not x.requires_grad:
        return FUNCTIONS[kind](x)
    return _InvertedFunction.apply(x, kind)


class InvertedActivation(nn.Module):
    def __init__(self, kind: str = "silu"):
        super().__init__()
        self.kind = canonical(kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return inverted_activation(x, self.kind)

    def extra_repr(self) -> str:
        return self.kind


def inverted_saved_bytes(numel: int) -> int:
    """Bytes an inverted activation saves beyond the output it shares: 1 bit per element."""
    return math.ceil(numel / 8)


__all__ = ["FUNCTIONS", "InverseTable", "InvertedActivation", "derivative_error", "inverse_table",
           "inverted_activation", "inverted_backward", "inverted_forward", "inverted_saved_bytes", "pack_bits",
           "unpack_bits"]
