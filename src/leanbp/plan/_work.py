"""The work of a training step, counted op by op: the FLOPs of its matrix products and attention
kernels, and the bytes every other op reads and writes (``WorkCounter``), as one more dispatch
mode over the planner's fake step, or over a real step (the same counter, so the two can be
compared on the CPU to the FLOP).

FLOPs: ``torch.utils.flop_counter``'s formulas (the ones ``FlopCounterMode`` uses: mm, addmm,
bmm, baddbmm, the CUDA attention kernels, ...), plus the ops its table lacks: the CPU flash
attention kernel and its backward (what SDPA runs on the CPU, and leanbp's CPU attention blocks)
and ``_grouped_mm`` (mixture-of-experts layers). Attention is counted as the kernels compute it:
forward ``QK^T`` and ``PV`` (4 B H q k D), backward the recomputed scores and four products
(10 B H q k D, as torch's SDPA backward formula), and a causal call only over the (query, key)
pairs it can see, which the flash kernels skip the rest of (torch's own formulas count the full
square: "NB: We aren't accounting for causal attention here").

Bytes: an op that is not a counted product reads its tensor arguments and writes its results (a
result that is an argument, as an in-place op's, is counted once); views (also those that do not
say so, as ``_unsafe_view``), ``empty`` and metadata ops (no tensor result) move nothing. This is the traffic a memory-bound op makes to device memory when its
operands do not stay in a cache between ops.

Two more counts time what a CPU does slower than its bandwidth and a GPU does not:
``transcendental``, the result elements of the ops that evaluate an exponential, logarithm or error
function per element (softmax, log-softmax and their backwards, SiLU, GELU, ...); and ``fresh``,
the bytes of results allocated at ``FRESH_FROM`` bytes or more, which glibc's allocator maps anew
for each allocation, so their pages fault in, zeroed, on first touch (a GPU's caching allocator
reuses its blocks). Both stay in ``bytes`` too.

All are polynomials of degree two in T at whole chunks (attention over T keys, T rows) and
linear in the depth: ``Work`` adds, scales and extends like the memory lines.

``calls`` keeps, for each distinct product and attention call (its op, and its operands' shapes,
strides and dtypes), how many times the step makes it and its FLOPs: a CPU's rate depends on the
shapes (a chunk's 512-row products and a chunk's attention run well below a 2048-cubed product),
so ``time_calls`` times each one there. It extends along the depth (every layer makes the same
calls) but not along T (the shapes change with T): a polynomial in T leaves it None.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..memory import op_tensors

__all__ = ["Operand", "Work", "WorkCounter", "count_work", "is_attention", "quadratic_through"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Work:
    """FLOPs of matrix products / attention, bytes read and written by every other op, and bytes
    this rank sends to the others of its sequence-parallel group (the all-to-alls of ``--sp``)."""

    flops: float = 0.0
    bytes: float = 0.0
    exchange: float = 0.0
    attention: float = 0.0  # the attention kernels' share of ``flops`` (a device runs them at its own rate)
    transcendental: float = 0.0  # elements of exp/log/erf ops (module docstring)
    fresh: float = 0.0  # bytes of results allocated at FRESH_FROM bytes or more
    # {call signature: (times made, FLOPs of one)} of the products and attention kernels (module docstring)
    calls: Mapping | None = field(default=None, compare=False, repr=False)

    def _fields(self) -> tuple:
        return self.flops, self.bytes, self.exchange, self.attention, self.transcendental, self.fresh

    def __add__(self, other: "Work") -> "Work":
        return Work(*(a + b for a, b in zip(self._fields(), other._fields())), calls=_combined(self, other, 1))

    def __sub__(self, other: "Work") -> "Work":
        return Work(*(a - b for a, b in zip(self._fields(), other._fields())), calls=_combined(self, other, -1))

    def __mul__(self, k: float) -> "Work":
        calls = None if self.calls is None else {s: (n * k, f) for s, (n, f) in self.calls.items()}
        return Work(*(a * k for a in self._fields()), calls=calls)

    __rmul__ = __mul__


def _combined(a: Work, b: Work, sign: int) -> dict | None:
    """``a.calls`` plus (or minus) ``b.calls``; None where either is unknown."""
    if a.calls is None or b.calls is None:
        return None
    out = dict(a.calls)
    for s, (n, f) in b.calls.items():
        out[s] = (out.get(s, (0, f))[0] + sign * n, f)
    return out


class Operand(NamedTuple):
    """A tensor argument of a recorded call, by its layout."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype


def _signature(func, args, kwargs) -> tuple:
    """What makes a call's time: the op, its tensors' layouts, its other arguments."""
    def describe(x):
        if isinstance(x, torch.Tensor):
            return Operand(tuple(x.shape), tuple(x.stride()), x.dtype)
        if isinstance(x, (list, tuple)):
            return tuple(describe(y) for y in x)
        return x
    return func, describe(args), tuple(sorted((k, describe(v)) for k, v in kwargs.items()))


def _visible_pairs(q: int, k: int, causal: bool) -> int:
    """(query, key) pairs a call computes: all, or a causal call's (top-left aligned, as SDPA's
    ``is_causal``; square in every call the planner's steps make)."""
    if not causal:
        return q * k
    full = min(q, k)
    return full * (full + 1) // 2 + max(0, q - k) * k


def _cpu_flash_forward(q, k, v, dropout_p=0.0, is_causal=False, *args, **kwargs) -> int:
    B, H, Lq, D = q.shape
    return 2 * B * H * _visible_pairs(Lq, k.shape[-2], is_causal) * (D + v.shape[-1])


def _cpu_flash_backward(grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *args, **kwargs) -> int:
    B, H, Lq, D = q.shape
    pairs = _visible_pairs(Lq, k.shape[-2], is_causal)
    # scores recomputed (q.k), dO.V^T (v), P^T.dO (v), dS.K (q.k), dS^T.Q (q.k)
    return 2 * B * H * pairs * (3 * D + 2 * v.shape[-1])


def _grouped_mm(a, b, *args, **kwargs) -> int:
    """``out = a @ b`` in groups: every element of ``out`` is one dot product over the contraction
    (a's last dimension for a 2-D x 3-D product; the grouped rows for 2-D x 2-D, a weight gradient)."""
    if a.dim() == 2 and b.dim() == 3:  # (M, K) x (E, K, N): each row meets one expert
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:  # (K, M) x (M, N) grouped over M -> (E, K, N)
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.dim() == 3 and b.dim() == 2:  # (E, M, K) x (K, N)?
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[1]
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]  # batched (E, M, K) x (E, K, N)


_EXTRA = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
          aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward}
if hasattr(aten, "_grouped_mm"):
    _EXTRA[aten._grouped_mm] = _grouped_mm

# the attention kernels (CPU and CUDA, forward and backward) whose FLOPs ``Work.attention`` holds
_ATTENTION = {getattr(aten, name) for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward") if hasattr(aten, name)}

# ops whose every result element takes an exp, log, tanh or erf (the backwards of softmax and
# log-softmax take exp of their saved result; SiLU's and GELU's backwards re-evaluate the function)
_TRANSCENDENTAL = {getattr(aten, name) for name in (
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "silu", "silu_",
    "silu_backward", "gelu", "gelu_", "gelu_backward", "sigmoid", "sigmoid_", "tanh", "tanh_", "exp", "exp_",
    "log", "log_", "erf", "erf_", "logsumexp", "softplus", "softplus_backward") if hasattr(aten, name)}

# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, 4 * 1024 * 1024 * sizeof(long)):
# an allocation this large is always a fresh mapping, whose pages fault in on first touch
FRESH_FROM = 32 * 2**20

_NO_DATA = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided,
            aten.detach, aten.alias, aten.lift_fresh, aten.set_, aten.resize_}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class WorkCounter(TorchDispatchMode):
    """Counts ``Work`` of the ops run inside it (on real or fake tensors)."""

    def __init__(self):
        super().__init__()
        self.flops = 0
        self.bytes = 0
        self.attention = 0
        self.transcendental = 0
        self.fresh = 0
        self.calls: dict = {}

    @property
    def work(self) -> Work:
        return Work(float(self.flops), float(self.bytes), attention=float(self.attention),
                    transcendental=float(self.transcendental), fresh=float(self.fresh), calls=dict(self.calls))

    def _count_fresh(self, outputs, inputs) -> None:
        seen = {t.untyped_storage()._cdata for t in inputs}
        for storage in {t.untyped_storage()._cdata: t.untyped_storage() for t in outputs
                        if t.untyped_storage()._cdata not in seen}.values():
            if storage.nbytes() >= FRESH_FROM:
                self.fresh += storage.nbytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if func.is_view:
            return out
        if packet in _NO_DATA:  # (moves nothing; an empty's pages fault in where it is written)
            if packet in (aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided):
                self._count_fresh(list(op_tensors(out, meta=True)), ())
            return out
        if packet in _EXTRA or packet in flop_registry:
            flops = (_EXTRA[packet](*args, **kwargs) if packet in _EXTRA
                     else flop_registry[packet](*args, **kwargs, out_val=out))
            self.flops += flops
            if packet in _ATTENTION:
                self.attention += flops
            signature = _signature(func, args, kwargs)
            self.calls[signature] = (self.calls.get(signature, (0, flops))[0] + 1, flops)
            self._count_fresh(list(op_tensors(out, meta=True)),
                              list(op_tensors(args, meta=True)) + list(op_tensors(kwargs, meta=True)))
        else:
            outputs = list(op_tensors(out, meta=True))
            if not outputs:  # (metadata: prim.device, sym_size, ...)
                return out
            inputs = list(op_tensors(args, meta=True)) + list(op_tensors(kwargs, meta=True))
            seen = {t.untyped_storage()._cdata for t in inputs}
            fresh = [t for t in outputs if t.untyped_storage()._cdata not in seen]
            if not fresh and not func._schema.is_mutable:  # a view by another name (_unsafe_view, ...)
                return out
            self.bytes += sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in fresh)
            if packet in _TRANSCENDENTAL:
                self.transcendental += sum(t.numel() for t in outputs)
            self._count_fresh(fresh, ())
        return out


def count_work(fn, *args, **kwargs) -> tuple[object, Work]:
    """Run ``fn`` under a ``WorkCounter``; its result and the work counted."""
    with WorkCounter() as counter:
        result = fn(*args, **kwargs)
    return result, counter.work


def quadratic_through(points: list[tuple[int, Work]]):
    """The degree-two polynomial in T through three (T, work) points, as a function of T (exact
    where the work is: attention over T keys at whole chunks)."""
    (t0, w0), (t1, w1), (t2, w2) = points[-3:]

    def at(T: int) -> Work:
        l0 = (T - t1) * (T - t2) / ((t0 - t1) * (t0 - t2))
        l1 = (T - t0) * (T - t2) / ((t1 - t0) * (t1 - t2))
        l2 = (T - t0) * (T - t1) / ((t2 - t0) * (t2 - t1))
        return replace(w0 * l0 + w1 * l1 + w2 * l2, calls=None)  # (other shapes at other T)

    return at


def is_attention(signature: tuple) -> bool:
    """Whether a recorded call is an attention kernel's (``Work.calls``)."""
    return signature[0]._overloadpacket in _ATTENTION
