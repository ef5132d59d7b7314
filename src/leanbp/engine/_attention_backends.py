"""Attention kernels for one block of keys, behind one ``(out, lse)`` interface.

The chunk attention (``_attention.py``) splits the keys a chunk may see into blocks, runs each
block through a backend and merges the blocks by their log-sum-exps; backward hands each block
the *merged* output and log-sum-exp, which gives the block's exact share of the gradient. A
backend only has to do, for one block:

    forward(q, k, v, causal, bias, scale) -> out (B, Hq, c, D), lse (B, Hq, c) (float32, or float64)
    backward(dout, q, k, v, out, lse, causal, bias, scale) -> dq, dk, dv

with q (B, Hq, c, D), k/v (B, Hkv, k, D) (grouped-query heads: Hq a multiple of Hkv), bias an
additive (B|1, 1, c|1, k) tensor or None, and ``causal`` only for a square block (where top-left
and bottom-right alignment coincide). A row that sees no key of the block may report any lse: the
merge masks it.

* ``CPU_FLASH``: PyTorch's fused CPU flash kernel (grouped heads natively);
* ``CUDA_KERNELS``: PyTorch's CUDA flash kernel (fp16/bf16, no bias; grouped heads natively) or
  its memory-efficient kernel (fp32 or a bias; K/V heads repeated per block, so a block is at most
  ``block_rows`` keys); float64 (exactness checks) runs the reference. Untimed and unrun on a GPU
  so far: its glue is tested on CPU with stand-in kernels that follow the CUDA kernels' contracts
  (lse padded to 32 rows, and so on);
* ``MATH``: plain PyTorch on any device and dtype, the reference the others are tested against.
"""

from __future__ import annotations

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
    block_rows = None  # any number of keys per call

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
    """PyTorch's fused CPU flash kernel: no score matrix; grouped heads without repeating K/V."""

    name = "cpu_flash"
    block_rows = None

    def forward(self, q, k, v, causal, bias, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, bias, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)


@dataclass
class CudaKernels:
    """PyTorch's CUDA kernels, called below SDPA so that their log-sum-exp comes back.

    flash (fp16/bf16 without a bias) takes grouped K/V heads as they are; the memory-efficient
    kernel (fp32, or any block with a padding / window / document bias) needs as many K/V heads as
    query heads, so K/V are repeated per block (the caller keeps blocks to ``block_rows`` keys), and
    its lse comes back padded to a multiple of 32 rows. The ops are fields so that the CPU tests can
    run this glue with stand-ins that follow the same contracts."""

    flash_fwd: Callable = None
    flash_bwd: Callable = None
    efficient_fwd: Callable = None
    efficient_bwd: Callable = None
    name: str = "cuda"
    block_rows: int = 8192  # Memory: keys per call, bounding the repeated K/V heads of the efficient kernel
    float64: bool = False  # the ops take float64 (only the CPU tests' stand-ins do; else the reference runs)

    def __post_init__(self):
        ops = torch.ops.aten
        self.flash_fwd = self.flash_fwd or ops._scaled_dot_product_flash_attention
        self.flash_bwd = self.flash_bwd or ops._scaled_dot_product_flash_attention_backward
        self.efficient_fwd = self.efficient_fwd or ops._scaled_dot_product_efficient_attention
        self.efficient_bwd = self.efficient_bwd or ops._scaled_dot_product_efficient_attention_backward

    @staticmethod
    def _uses_flash(q, bias) -> bool:
        return bias is None and q.dtype in (torch.float16, torch.bfloat16)

    @staticmethod
    def _full_bias(bias, q, k):
        """(B|1, 1, c|1, k) -> (B, Hq, c, k) without copying rows: the efficient kernel reads a
        bias whose row stride is a multiple of 16 elements, so the key dim is padded first."""
        if bias is None:
            return None
        keys = k.shape[2]
        pad = -keys % 16
        if pad:
            bias = F.pad(bias, (0, pad))[..., :keys]
        return bias.expand(q.shape[0], q.shape[1], q.shape[2], keys)

    def forward(self, q, k, v, causal, bias, scale):
        if q.dtype == torch.float64 and not self.float64:  # (neither CUDA kernel takes float64)
            return MATH.forward(q, k, v, causal, bias, scale)
        if self._uses_flash(q, bias):
            out, lse, *_ = self.flash_fwd(q, k, v, 0.0, causal, False, scale=scale)
            return out, lse
        heads = q.shape[1]
        out, lse, *_ = self.efficient_fwd(q, _repeat_heads(k, heads), _repeat_heads(v, heads),
                                          self._full_bias(bias, q, k), True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]]  # (the kernel pads its lse to a multiple of 32 rows)

    def backward(self, dout, q, k, v, out, lse, causal, bias, scale):
        if q.dtype == torch.float64 and not self.float64:
            return MATH.backward(dout, q, k, v, out, lse, causal, bias, scale)
        if self._uses_flash(q, bias):
            rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: never read
            unused = torch.zeros((), dtype=torch.uint64, device=q.device)
            return self.flash_bwd(dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
                                  rng, unused, scale=scale)[:3]
        heads, kv_heads = q.shape[1], k.shape[1]
        rows = q.shape[2]
        lse = F.pad(lse, (0, -rows % 32))  # back to the kernel's layout (the pad rows are not read)
        seed = torch.zeros((), dtype=torch.long, device=q.device)
        dq, dk, dv, _ = self.efficient_bwd(
            dout, q, _repeat_heads(k, heads), _repeat_heads(v, heads), self._full_bias(bias, q, k), out, lse,
            seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, _sum_heads(dk, kv_heads), _sum_heads(dv, kv_heads)


MATH = MathAttention()
CPU_FLASH = CpuFlashAttention()
CUDA_KERNELS = CudaKernels()


FUSED_DEVICES = {"cpu": CPU_FLASH, "cuda": CUDA_KERNELS}


def backend_for(device: torch.device):
    """The kernels for chunk attention on ``device``: the fused flash kernel on CPU, PyTorch's
    flash / memory-efficient kernels on CUDA, plain PyTorch elsewhere."""
    return FUSED_DEVICES.get(device.type, MATH)
