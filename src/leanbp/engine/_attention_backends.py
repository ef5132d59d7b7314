"""Attention kernels for one block of keys, behind one ``(out, lse)`` interface.

The chunk attention (``_attention.py``) splits the keys a chunk may see into blocks, runs each
block through a backend and merges the blocks by their log-sum-exps; backward hands each block
the *merged* output and log-sum-exp, which gives the block's exact share of the gradient. A
backend only has to do, for one block:

    forward(q, k, v, causal, bias, scale) -> out (B, Hq, c, D), lse (B, Hq, c) (float32, or float64)
    backward(dout, q, k, v, out, lse, causal, bias, scale) -> dq, dk, dv

    key_block_rows(q, kv_heads, biased) -> keys per call (None: any number)

with q (B, Hq, c, D), k/v (B, Hkv, k, D) (grouped-query heads: Hq a multiple of Hkv), bias an
additive (B|1, 1, c|1, k) tensor or None, and ``causal`` only for a square block (where top-left
and bottom-right alignment coincide). A row that sees no key of the block may report any lse: the
merge masks it.

* ``CPU_FLASH``: PyTorch's fused CPU flash kernel (grouped heads natively);
* ``CUDA_KERNELS``: PyTorch's CUDA kernels, called below SDPA so that their log-sum-exp comes back,
  chosen per block as SDPA would among the kernels the user left enabled: flash (fp16/bf16 without
  a bias, sm80+, head dim a multiple of 8 up to 256; grouped K/V heads as they are, any number of
  keys), else the memory-efficient kernel (fp32 or a bias; K/V heads repeated, so a block is at
  most ``repeat_block_rows`` keys), else the reference in blocks. Its glue runs in the CPU suite on
  stand-ins of the four CUDA ops that enforce the kernels' preconditions (tests/_cuda_ops.py);
* ``MATH``: plain PyTorch on any device and dtype, the reference the others are tested against.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hkv, k, D) -> (B, heads, k, D): each K/V head serves heads // Hkv query heads."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_heads(dx: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hq, k, D) -> (B, heads, k, D): a repeated K/V head's gradient is its query heads' sum."""
    if dx.shape[1] == heads:
        return dx
    B, Hq, k, D = dx.shape
    return dx.view(B, heads, Hq // heads, k, D).sum(2)


class MathAttention:
    """Scores, softmax and their gradient in plain PyTorch: the reference backend (any device, any
    dtype; float32 at least inside). Memory: it materializes the (B, Hq, c, k) scores."""

    name = "math"

    def key_block_rows(self, q, kv_heads, biased):
        return None  # any number of keys per call (the reference: exactness, not memory)

    @staticmethod
    def _scores(q, k, causal, bias, scale):
        """(B, Hq, c, k) scores in at least float32, -inf where a key is not visible."""
        acc = torch.promote_types(q.dtype, torch.float32)
        s = torch.matmul(q.to(acc), _repeat_heads(k, q.shape[1]).to(acc).transpose(-1, -2)) * scale
        if bias is not None:
            s = s + bias.to(acc)
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return s

    def forward(self, q, k, v, causal, bias, scale):
        s = self._scores(q, k, causal, bias, scale)
        lse = torch.logsumexp(s, dim=-1)  # (B, Hq, c); -inf for a row that sees nothing
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))  # (such rows: 0)
        out = torch.matmul(p, _repeat_heads(v, q.shape[1]).to(p.dtype))
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, causal, bias, scale):
        s = self._scores(q, k, causal, bias, scale)
        p = torch.exp(s - lse.to(s.dtype).unsqueeze(-1))  # the merged lse: this block's share of the softmax
        dout = dout.to(s.dtype)
        heads = k.shape[1]
        dv = _sum_heads(torch.matmul(p.transpose(-1, -2), dout), heads)
        dp = torch.matmul(dout, _repeat_heads(v, q.shape[1]).to(s.dtype).transpose(-1, -2))
        delta = (dout * out.to(s.dtype)).sum(-1, keepdim=True)  # (B, Hq, c, 1): rowsum(dO * O)
        ds = p * (dp - delta) * scale
        dq = torch.matmul(ds, _repeat_heads(k, q.shape[1]).to(s.dtype))
        dk = _sum_heads(torch.matmul(ds.transpose(-1, -2), q.to(s.dtype)), heads)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class CpuFlashAttention:
    """PyTorch's fused CPU flash kernel: no score matrix; grouped heads without repeating K/V.

    Speed: the kernel picks its block of queries by the query length, and a short one costs more
    per row: against 8192 keys (8 query / 4 K/V heads, head dim 64, fp32, 2 cores) 134 us per row
    at 767 rows, 107 us at 768 and more. A chunk's block of prefix keys (no causal mask, no bias)
    is the same attention for every query row, so below ``fold_below_rows`` the query heads that
    share a K/V head go to the kernel as one head of group x c rows, (B, Hq, c, D) as (B, Hkv,
    group * c, D): at 512-row chunks this made the prefix forward 24% and its backward 10-25% faster,
    the same values (forward bit for bit; dK/dV summed over the group in another order)."""

    name = "cpu_flash"
    fold_below_rows = 768

    def key_block_rows(self, q, kv_heads, biased):
        return None  # any number of keys per call, grouped heads natively

    def _folds(self, q, k, causal, bias) -> bool:
        # (a causal block's mask follows each row's position, which the fold would move)
        return not causal and bias is None and q.shape[1] > k.shape[1] and q.shape[2] < self.fold_below_rows

    @staticmethod
    def _fold(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """(B, Hq, c[, D]) -> (B, Hkv, group * c[, D]): query head h serves K/V head h // group."""
        return x.reshape(x.shape[0], kv_heads, -1, *x.shape[3:])

    def _query_side(self, q, k, causal, bias):
        """What the kernel gets in place of each query-side tensor: folded where ``_folds``, else as is."""
        if not self._folds(q, k, causal, bias):
            return lambda x: x
        return lambda x: self._fold(x, k.shape[1])

    def forward(self, q, k, v, causal, bias, scale):
        fold = self._query_side(q, k, causal, bias)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            fold(q), k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out.reshape(q.shape), lse.reshape(q.shape[:3])  # (unfolded: no-op views)

    def backward(self, dout, q, k, v, out, lse, causal, bias, scale):
        fold = self._query_side(q, k, causal, bias)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            fold(dout), fold(q), k, v, fold(out), fold(lse), 0.0, causal, attn_mask=bias, scale=scale)
        return dq.reshape(q.shape), dk, dv


# The kernels' rules that the glue below must meet (PyTorch 2.13; tests/_cuda_ops.py cites the source
# of each and enforces it on CPU):
FLASH_MAX_HEAD_DIM = 256
FLASH_MIN_CAPABILITY = (8, 0)
# flash's backward on sm86/sm89 (consumer Ampere/Ada) takes head dims up to 192 (SDPA:
# check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89); leanbp always trains
FLASH_SMALL_SMEM = ((8, 6), (8, 9))
FLASH_SMALL_SMEM_MAX_HEAD_DIM = 192
# the memory-efficient kernel reads a bias whose pointer and strides (batch, head, row) are multiples
# of 8 elements for fp16/bf16 and 4 for fp32; 16 serves every dtype
BIAS_ALIGNMENT = 16
MATH_BLOCK_ROWS = 1024  # Memory: the reference's (B, Hq, c, k) scores stay (B, Hq, c, 1024) on a GPU


def _sdpa_switches() -> dict[str, bool]:
    """The kernels the user left enabled (``torch.nn.attention.sdpa_kernel``,
    ``torch.backends.cuda.enable_*_sdp``): the aten ops below SDPA do not read them, so the glue does."""
    cuda = torch.backends.cuda
    return {"flash": cuda.flash_sdp_enabled(), "efficient": cuda.mem_efficient_sdp_enabled(),
            "math": cuda.math_sdp_enabled()}


class SdpaSwitches:
    """The SDPA kernel switches active in forward, replayed around the recomputation in backward:
    a user's ``with sdpa_kernel(...): loss = model(x)`` chooses the kernels of the whole step, as it
    does for SDPA, even though leanbp's backward (outside that block) recomputes the attention."""

    _SETTERS = {"flash": "enable_flash_sdp", "efficient": "enable_mem_efficient_sdp", "math": "enable_math_sdp"}

    def __init__(self):
        self.switches = _sdpa_switches()

    @contextlib.contextmanager
    def __call__(self):
        before = _sdpa_switches()
        if before == self.switches:
            yield
            return
        for name, on in self.switches.items():
            getattr(torch.backends.cuda, self._SETTERS[name])(on)
        try:
            yield
        finally:
            for name, on in before.items():
                getattr(torch.backends.cuda, self._SETTERS[name])(on)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_capability(device: torch.device) -> tuple[int, int]:
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def _aligned(t: torch.Tensor, alignment: int) -> bool:
    """Whether the pointer and every stride of a dimension longer than 1 are multiples of
    ``alignment`` elements (a fresh allocation's base is aligned far beyond that)."""
    return t.stride(-1) == 1 and t.storage_offset() % alignment == 0 and all(
        size == 1 or stride % alignment == 0 for size, stride in zip(t.shape[:-1], t.stride()[:-1]))


def _bmhk_rows(out: torch.Tensor) -> torch.Tensor:
    """(B, H, c, D) with the memory of a contiguous (B, c, H, D): the layout the efficient kernel's
    backward assumes for ``out`` (it reads the row stride as H * D instead of from the tensor).
    No copy when ``out`` already has it (the efficient forward's output, and merges of it)."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


@dataclass
class CudaKernels:
    """PyTorch's CUDA attention kernels for one block of keys (see the module docstring).

    The four ops and the device facts are fields so that the CPU tests can run this glue with
    stand-ins that enforce the same rules and answer the probes both ways."""

    flash_fwd: Callable = None
    flash_bwd: Callable = None
    efficient_fwd: Callable = None
    efficient_bwd: Callable = None
    name: str = "cuda"
    # Memory: keys per efficient-kernel call when it needs the K/V heads repeated to the query heads
    repeat_block_rows: int = 8192
    float64: bool = False  # the ops take float64 (only the CPU tests' stand-ins do; else the reference runs)
    capability: Callable = None  # device -> (major, minor)
    flash_built: Callable = None  # () -> whether this PyTorch has the flash kernel
    # the efficient kernel's lse rows come padded to a multiple of 32 on CUDA; ROCm's are compact,
    # and its backward views them as (B * H, rows)
    lse_row_multiple: int = None

    def __post_init__(self):
        ops = torch.ops.aten
        self.flash_fwd = self.flash_fwd or ops._scaled_dot_product_flash_attention
        self.flash_bwd = self.flash_bwd or ops._scaled_dot_product_flash_attention_backward
        self.efficient_fwd = self.efficient_fwd or ops._scaled_dot_product_efficient_attention
        self.efficient_bwd = self.efficient_bwd or ops._scaled_dot_product_efficient_attention_backward
        self.capability = self.capability or _device_capability
        self.flash_built = self.flash_built or torch.backends.cuda.is_flash_attention_available
        if self.lse_row_multiple is None:
            self.lse_row_multiple = 1 if torch.version.hip else 32

    def kernel(self, q: torch.Tensor, biased: bool) -> str:
        """"flash", "efficient" or "math" for a block of queries ``q`` (B, Hq, c, D): the first
        of SDPA's order that the user left enabled and that takes the block."""
        if q.dtype == torch.float64 and not self.float64:  # (neither CUDA kernel takes float64)
            return "math"
        switches = _sdpa_switches()
        head_dim = q.shape[-1]
        half = q.dtype in (torch.float16, torch.bfloat16)
        capability = self.capability(q.device)
        max_head_dim = FLASH_SMALL_SMEM_MAX_HEAD_DIM if tuple(capability) in FLASH_SMALL_SMEM else FLASH_MAX_HEAD_DIM
        if (switches["flash"] and not biased and half and capability >= FLASH_MIN_CAPABILITY and self.flash_built()
                and head_dim % 8 == 0 and head_dim <= max_head_dim):
            return "flash"
        efficient_dtypes = {torch.float16, torch.float32} | ({torch.bfloat16} if capability >= (8, 0) else set()) | \
            ({torch.float64} if self.float64 else set())
        if switches["efficient"] and q.dtype in efficient_dtypes and head_dim % (8 if half else 4) == 0:
            return "efficient"
        if switches["math"]:
            return "math"
        raise RuntimeError(
            f"no enabled attention kernel takes this chunk ({q.dtype}, head dim {head_dim}, "
            f"{'with' if biased else 'without'} a padding/window/document mask, sm{capability[0]}{capability[1]}): "
            f"the enabled ones are {[k for k, on in switches.items() if on]}; enable the memory-efficient or math "
            "kernel (torch.nn.attention.sdpa_kernel)")

    def key_block_rows(self, q: torch.Tensor, kv_heads: int, biased: bool) -> int | None:
        """Keys per call for blocks of queries ``q`` against ``kv_heads`` K/V heads (None: any)."""
        kernel = self.kernel(q, biased)
        if kernel == "flash":
            return None  # grouped heads natively, tiles of its own: the whole prefix in one call
        if kernel == "efficient":
            return self.repeat_block_rows if q.shape[1] != kv_heads else None
        return MATH_BLOCK_ROWS

    def _full_bias(self, bias, q, k):
        """(B|1, 1, c|1, k) -> (B, Hq, c, k), expanded without copying rows, in memory the efficient
        kernel reads: a bias block sliced from a wider one (a prefix split into key blocks, a window)
        keeps its parent's row stride, so it is copied into rows padded to the alignment first."""
        if bias is None:
            return None
        keys = k.shape[2]
        if not _aligned(bias, BIAS_ALIGNMENT):
            # Memory: one block's bias rows, (B|1, 1, c|1, keys rounded up to 16)
            padded = bias.new_empty((*bias.shape[:-1], keys + (-keys % BIAS_ALIGNMENT)))
            padded[..., :keys] = bias
            bias = padded[..., :keys]
        return bias.expand(q.shape[0], q.shape[1], q.shape[2], keys)

    def forward(self, q, k, v, causal, bias, scale):
        kernel = self.kernel(q, bias is not None)
        if kernel == "math":
            return MATH.forward(q, k, v, causal, bias, scale)
        if kernel == "flash":
            out, lse, *_ = self.flash_fwd(q, k, v, 0.0, causal, False, scale=scale)
            return out, lse
        heads = q.shape[1]
        out, lse, *_ = self.efficient_fwd(q, _repeat_heads(k, heads), _repeat_heads(v, heads),
                                          self._full_bias(bias, q, k), True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]]  # (CUDA pads its lse rows to a multiple of 32)

    def backward(self, dout, q, k, v, out, lse, causal, bias, scale):
        kernel = self.kernel(q, bias is not None)
        if kernel == "math":
            return MATH.backward(dout, q, k, v, out, lse, causal, bias, scale)
        if kernel == "flash":
            rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: never read
            unused = torch.zeros((), dtype=torch.uint64, device=q.device)
            return self.flash_bwd(dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
                                  rng, unused, scale=scale)[:3]
        heads, kv_heads = q.shape[1], k.shape[1]
        rows = q.shape[2]
        # back to the width the forward returned (its pad rows +inf, as the kernel writes them)
        lse = F.pad(lse, (0, -rows % self.lse_row_multiple), value=float("inf"))
        seed = torch.zeros((), dtype=torch.long, device=q.device)
        dq, dk, dv, _ = self.efficient_bwd(
            dout, q, _repeat_heads(k, heads), _repeat_heads(v, heads), self._full_bias(bias, q, k), _bmhk_rows(out),
            lse, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, _sum_heads(dk, kv_heads), _sum_heads(dv, kv_heads)


MATH = MathAttention()
CPU_FLASH = CpuFlashAttention()
CUDA_KERNELS = CudaKernels()


FUSED_DEVICES = {"cpu": CPU_FLASH, "cuda": CUDA_KERNELS}


def backend_for(device: torch.device):
    """The kernels for chunk attention on ``device``: the fused flash kernel on CPU, PyTorch's
    flash / memory-efficient kernels on CUDA, plain PyTorch elsewhere."""
    return FUSED_DEVICES.get(device.type, MATH)
