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

D_side is fitted, once per function: near y* the inverse has a square-root singularity (f'(x*) =
0, f'(x) ~ sqrt(2 f''(x*) (y - y*))), so each side's f' is taken as a function of u = sqrt(y - y*),
where it is smooth, and fitted by a Chebyshev series of degree 16 in u (least squares on 4000
Chebyshev nodes, in float64: each node inverted by bisection on its side, f' by autograd, so any
pointwise f with one minimum works). The right side is fitted up to the output above which f' is
1 to within 1e-5, and held there. Measured against the exact derivative on every fp32 input of
[-30, 30] at spacing 3e-5 (``derivative_error``): SiLU 1.0e-4, GELU (erf) 1.8e-4, GELU (tanh)
2.5e-4 (SiLU's is the fp32 rounding of y next to the minimum; the GELUs' the left end, x -> -inf,
where f' has a logarithmic singularity in u); the method's paper fitted approximations reach about
2.9e-3 (SiLU) and 1.9e-2 (GELU). With a bf16 output (autocast) the output itself is rounded to 8
bits of mantissa, which bounds any inversion near the minimum (the derivative error there grows to
1.5e-2, in the same region ReSiLU2's steps are off by up to 0.1). A series, not a table: the
evaluation is arithmetic only, which vectorizes; a table lookup is a gather per element, which on
the CPU cost 4x the exact SiLU backward.

Approximate gradients: opt in (``leanbp.approx(model, activations="inverted")``), and say so.

Three layers, as everywhere in leanbp: plain functions (``inverted_forward`` /
``inverted_backward``, the oracle of the kernels and their fallback), a thin autograd Function, and
an nn.Module with a functional alias. The kernels (``leanbp.kernels``): Triton on CUDA, and on the
CPU the same arithmetic fused by ``torch.compile`` into one loop per direction (the reference's
dozen whole-tensor passes cost several times more).

The side bits are packed in planes: with w = ceil(N / 8) bytes, bit k of byte i is element k w + i
(k = 0..7), so a kernel reads each byte once for 8 contiguous runs of elements, where an
element-interleaved layout (element j at bit j % 8 of byte j // 8) costs a shift by a varying
amount per element (on the CPU, as much as the rest of the backward).
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
DEGREE = 16  # of each side's Chebyshev series (the fit error falls geometrically with it)
_NODES = 4000  # Chebyshev nodes per side for the least-squares fit
_FLAT = 1e-5  # the right side is fitted up to the output above which |f' - 1| < _FLAT
_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)  # bit k of a byte: plane k


@dataclass(frozen=True)
class InverseFit:
    """f' as a function of (side, u = sqrt(y - y_min)): on each side a Chebyshev series in
    t = 2 u / u_end - 1 over u in [0, u_end] (u clamped there).

    ``right``: x >= x_min, u up to ``u_right`` (above it f' = 1 to within 1e-5); ``left``: x < x_min,
    u up to ``u_left`` = sqrt(-y_min) (y -> 0 as x -> -inf). Coefficients c_0..c_DEGREE, float64."""

    kind: str
    x_min: float
    y_min: float
    u_right: float
    u_left: float
    right: torch.Tensor  # (DEGREE + 1,) float64
    left: torch.Tensor  # (DEGREE + 1,) float64

    def on(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(right, left) on ``device``: float64 for float64 outputs, else float32."""
        return _placed(self.kind, device, torch.float64 if dtype == torch.float64 else torch.float32)


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


def _chebyshev_basis(t: torch.Tensor, degree: int) -> torch.Tensor:
    """(len(t), degree + 1): T_0(t) .. T_degree(t)."""
    columns = [torch.ones_like(t), t]
    for _ in range(degree - 1):
        columns.append(2 * t * columns[-1] - columns[-2])
    return torch.stack(columns[: degree + 1], 1)


def _fit(f, u_end: float, inverse) -> torch.Tensor:
    """Chebyshev coefficients of f'(inverse(u)) over u in [0, u_end], least squares on Chebyshev nodes."""
    t = torch.cos(math.pi * (torch.arange(_NODES, dtype=torch.float64) + 0.5) / _NODES)
    derivative = _derivative(f, inverse((t + 1) / 2 * u_end))
    return torch.linalg.lstsq(_chebyshev_basis(t, DEGREE), derivative[:, None]).solution[:, 0]


@functools.cache
def inverse_fit(kind: str) -> InverseFit:
    """The fit of ``FUNCTIONS[kind]``, built in float64 (0.15 s here, once per process)."""
    f = FUNCTIONS[kind]
    # the minimum: where f' changes sign (f' < 0 to its left)
    lo, hi = torch.tensor([-10.0], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        negative = _derivative(f, mid) < 0
        lo, hi = torch.where(negative, mid, lo), torch.where(negative, hi, mid)
    x_min = float((lo + hi) / 2)
    y_min = float(f(torch.tensor(x_min, dtype=torch.float64)))
    # where the right side goes flat: the largest x (of a 0.01 grid below 40) with |f' - 1| >= _FLAT
    grid = torch.arange(40.0, 0.0, -0.01, dtype=torch.float64)
    x_flat = grid[int(((_derivative(f, grid) - 1).abs() >= _FLAT).nonzero()[0])]
    u_right = math.sqrt(float(f(x_flat)) - y_min)
    u_left = math.sqrt(-y_min)
    right = _fit(f, u_right, lambda u: _bisect(f, y_min + u * u, x_min, 40.0, increasing=True))
    # left side: y in [y_min, 0), x from x_min down to -inf (y = 0 itself only by rounding: x = -1000)
    left = _fit(f, u_left, lambda u: _bisect(f, (y_min + u * u).clamp(max=-1e-300), -1000.0, x_min,
                                                 increasing=False))
    return InverseFit(kind, x_min, y_min, u_right, u_left, right, left)


@functools.cache
def _placed(kind: str, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    fit = inverse_fit(kind)  # (kept for the process: a few hundred bytes per device and dtype)
    return fit.right.to(device, dtype), fit.left.to(device, dtype)


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
    x_min = inverse_fit(kind).x_min
    t = torch.tensor(x_min, dtype=torch.float64).to(dtype)  # nearest
    if t.double() < x_min:
        t = torch.nextafter(t, torch.tensor(float("inf"), dtype=dtype))
    return t.item()


# -- 1-bit packing, in planes ------------------------------------------------------------------
def _width(numel: int) -> int:
    """Bytes of the packed bits of ``numel`` elements: the length of each of the 8 planes."""
    return (numel + 7) // 8


def _planes(flat: torch.Tensor, lo: int, hi: int, fill: float = 0.0) -> torch.Tensor:
    """(8, hi - lo): elements k w + [lo, hi) of ``flat`` for k = 0..7 (w = _width), the elements
    that bytes [lo, hi) of the packed bits describe; ``fill`` beyond the end. A view where the 8
    planes are whole (N divisible by 8), else a copy of the block."""
    n, w = flat.numel(), _width(flat.numel())
    if n == 8 * w:
        return flat.view(8, w)[:, lo:hi]
    rows = [flat[min(k * w + lo, n): min(k * w + hi, n)] for k in range(8)]
    return torch.stack([F.pad(r, (0, hi - lo - r.numel()), value=fill) for r in rows])


def _pack_planes(bits: torch.Tensor) -> torch.Tensor:
    """(8, m) bool -> (m,) uint8, row k at bit k."""
    weights = torch.tensor(_WEIGHTS, dtype=torch.uint8, device=bits.device)[:, None]
    return (bits.to(torch.uint8) * weights).sum(0, dtype=torch.uint8)


def _unpack_planes(packed: torch.Tensor) -> torch.Tensor:
    """(m,) uint8 -> (8, m) bool, bit k as row k."""
    weights = torch.tensor(_WEIGHTS, dtype=torch.uint8, device=packed.device)[:, None]
    return (packed[None, :] & weights) != 0


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool, any shape -> flat uint8 of w = ceil(N / 8) bytes: bit k of byte i is element k w + i
    (the flat tensor, padded to 8 w, seen as (8, w))."""
    flat = bits.reshape(-1)
    return _pack_planes(_planes(flat, 0, _width(flat.numel()), fill=False))


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the ``numel`` bits, flat uint8 (0 or 1). (The planes laid end
    to end are the elements in order: element k w + i is row k, column i.)"""
    return _unpack_planes(packed).reshape(-1)[:numel].to(torch.uint8)


# -- plain forward / backward -------------------------------------------------------------------
# Memory: the reference works through the packed bytes in blocks, so its temporaries (a float copy
# and the series' terms for 8 planes: about 20 bytes per element) exist for one block at a time,
# not for the whole tensor
BLOCK = 1 << 17  # bytes per block: 8 times as many elements


def _blocks(width: int):
    return ((b0, min(b0 + BLOCK, width)) for b0 in range(0, width, BLOCK))


def inverted_forward(kind: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact f(x), the packed side bits [x < x_min])."""
    flat, threshold = x.reshape(-1), side_threshold(kind, x.dtype)
    packed = torch.empty(_width(flat.numel()), dtype=torch.uint8, device=x.device)
    for lo, hi in _blocks(packed.numel()):
        packed[lo:hi] = _pack_planes(_planes(flat, lo, hi, fill=math.inf) < threshold)
    return FUNCTIONS[kind](x), packed


def inverted_backward(kind: str, grad_out: torch.Tensor, y: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """grad_out * f'(f^-1(y)) on the side each bit says, from the fitted series."""
    fit = inverse_fit(kind)
    right, left = fit.on(y.device, y.dtype)
    y_flat, g_flat = y.reshape(-1), grad_out.reshape(-1)
    w = packed.numel()
    # (the planes of the result: 8 w elements, of which the first N are the gradient)
    out = torch.empty(8 * w, dtype=grad_out.dtype, device=grad_out.device)
    for lo, hi in _blocks(w):
        is_left = _unpack_planes(packed[lo:hi])  # (8, m)
        # y itself is the shared saved output and stays untouched: each step below works in place
        # on the block's own float copy; a NaN output (what a NaN input gives) stays NaN throughout,
        # as the exact backward's derivative would be
        u = _planes(y_flat, lo, hi).to(right.dtype, copy=True).sub_(fit.y_min).clamp_(min=0).sqrt_()
        u_end = torch.where(is_left, fit.u_left, fit.u_right).to(u.dtype)
        t = torch.minimum(u, u_end).div_(u_end).mul_(2).sub_(1)  # t = 2 u / u_end - 1, in [-1, 1]
        del u, u_end
        # Clenshaw: b_k = c_k + 2 t b_(k+1) - b_(k+2); f' = c_0 + t b_1 - b_2
        b1, b2 = torch.where(is_left, left[-1], right[-1]), torch.zeros_like(t)
        for k in range(DEGREE - 1, 0, -1):
            b2.neg_().addcmul_(t, b1, value=2).add_(torch.where(is_left, left[k], right[k]))
            b1, b2 = b2, b1
        derivative = b1.mul_(t).sub_(b2).add_(torch.where(is_left, left[0], right[0]))  # (8, m)
        del b2, t
        out.view(8, w)[:, lo:hi] = derivative.mul_(_planes(g_flat, lo, hi))
    return out[:y.numel()].view(grad_out.shape)


def derivative_error(kind: str, dtype: torch.dtype = torch.float32, low: float = -30.0, high: float = 30.0,
                     samples: int = 2_000_001) -> tuple[float, float]:
    """(max |f'(x) - the fitted f'|, the x where it is) over ``samples`` inputs of ``dtype``
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
            return kernels.inverted_backward(grad_out, y, packed, inverse_fit(ctx.kind)), None
        if kernels.use_compiled(grad_out):
            dx = kernels.compiled_inverted_backward(grad_out, y, packed, inverse_fit(ctx.kind))
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


__all__ = ["FUNCTIONS", "InverseFit", "InvertedActivation", "derivative_error", "inverse_fit",
           "inverted_activation", "inverted_backward", "inverted_forward", "inverted_saved_bytes", "pack_bits",
           "unpack_bits"]
