"""Strict CPU stand-ins for the four CUDA attention ops that ``CudaKernels`` calls.

They compute with leanbp's plain-PyTorch reference (``MATH``) and enforce what the real kernels
demand and return (PyTorch 2.13), so that the CUDA glue runs in the CPU suite exactly as it will on
a GPU, and a precondition it breaks fails here instead of on a user's card. The rules come from the
installed PyTorch (the ops' schemas, ``torch/_meta_registrations.py``, the mem-eff kernel headers
shipped in the wheel under ``torch/include/ATen/native/transformers/cuda/mem_eff_attention``) and,
for the C++ checks a CPU wheel does not ship, from pytorch/pytorch's sources. Abbreviations below:

    FLASH_API  aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp (mha_fwd, mha_bwd)
    ATTN_CU    aten/src/ATen/native/transformers/cuda/attention.cu (_efficient_attention_forward)
    ATTN_BWD   aten/src/ATen/native/transformers/cuda/attention_backward.cu
    KFWD, KBWD mem_eff_attention/kernel_forward.h, kernel_backward.h (in the wheel)
    GKU        mem_eff_attention/gemm_kernel_utils.h (in the wheel)
    META       torch/_meta_registrations.py (in the wheel)

``capability`` is the card the stand-ins pretend to be, ``lse_row_multiple`` 32 for CUDA (the
efficient kernel pads its lse rows) or 1 for ROCm (compact), ``float64`` lets exactness runs use
float64 where the real kernels take fp32 (with fp32's alignment rules).
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from leanbp.engine import MATH, CudaKernels

HALF = (torch.float16, torch.bfloat16)


def _check(condition: bool, message: str) -> None:
    """TORCH_CHECK: a RuntimeError with the kernel's message."""
    if not condition:
        raise RuntimeError(message)


class StrictCudaOps:
    """The four ops as fields of one object, counting their calls."""

    def __init__(self, capability=(9, 0), lse_row_multiple: int = 32, float64: bool = False):
        self.capability = capability
        self.lse_row_multiple = lse_row_multiple
        self.float64 = float64
        self.calls = Counter()

    def backend(self, **fields) -> CudaKernels:
        """``CudaKernels`` on these ops, answering the device probes as this card would."""
        return CudaKernels(self.flash_fwd, self.flash_bwd, self.efficient_fwd, self.efficient_bwd,
                           float64=self.float64, capability=lambda device: self.capability,
                           flash_built=lambda: True, lse_row_multiple=self.lse_row_multiple, **fields)

    # -- shared checks -----------------------------------------------------------------------
    def _dtypes(self, *tensors) -> torch.dtype:
        dtype = tensors[0].dtype
        # FLASH_API mha_fwd: "query and key must have the same dtype" (and value)
        _check(all(t.dtype == dtype for t in tensors), "query, key and value must have the same dtype")
        return dtype

    def _square_causal(self, causal: bool, q, k) -> None:
        # the glue asks for is_causal only on a square block, where flash's bottom-right and the
        # efficient kernel's top-left alignment coincide (SDPA's selector refuses the non-square
        # case for flash: sdp_utils.cpp check_flash_causal_non_square_seqlens)
        _check(not causal or q.shape[2] == k.shape[2], "is_causal on a non-square block")

    # -- flash -------------------------------------------------------------------------------
    def _flash_checks(self, q, k, v, direction: str) -> None:
        # FLASH_API: TORCH_CHECK(is_sm80_or_newer, ...)
        _check(self.capability >= (8, 0), "FlashAttention only supports Ampere GPUs or newer.")
        dtype = self._dtypes(q, k, v)
        # FLASH_API: q_dtype == at::kHalf || q_dtype == at::kBFloat16
        _check(dtype in HALF or (self.float64 and dtype == torch.float64),
               "FlashAttention only support fp16 and bf16 data type")
        # FLASH_API: "Input tensor must have contiguous last dimension" (q, k, v)
        _check(all(t.stride(-1) == 1 for t in (q, k, v)), "Input tensor must have contiguous last dimension")
        head_dim = q.shape[-1]
        _check(k.shape[-1] == head_dim and v.shape[-1] == head_dim, "q, k, v must have the same head dim")
        # FLASH_API: "head_size must be a multiple of 8, this is ensured by padding!" (SDPA pads; the op does not)
        _check(head_dim % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!")
        # FLASH_API: head_size_og <= 256 (forward), head_size <= 256 (backward)
        _check(head_dim <= 256, f"FlashAttention {direction} only supports head dimension at most 256")
        # sdp_utils.cpp check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89: the backward on
        # sm86/sm89 lacks the shared memory for head dims over 192 (SDPA refuses flash for training there)
        _check(direction == "forward" or self.capability not in ((8, 6), (8, 9)) or head_dim <= 192,
               "FlashAttention backward for head dim > 192 requires A100/H100 or newer (sm80, sm90)")
        # FLASH_API: grouped-query heads are taken as they are
        _check(q.shape[1] % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query")
        _check(k.shape == v.shape, "key and value must have the same shape")

    def flash_fwd(self, q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
        self._flash_checks(q, k, v, "forward")
        _check(dropout_p == 0.0 and not return_debug_mask, "the glue asks for no dropout and no debug mask")
        self._square_causal(is_causal, q, k)
        self.calls["flash_fwd"] += 1
        ref_out, ref_lse = MATH.forward(q, k, v, is_causal, None, scale)
        # FLASH_API mha_fwd: out = at::empty_like(q_padded) on the (B, M, H, K) view: out's memory
        # follows query's (META: attention = torch.empty_like(query))
        out = torch.empty_like(q).copy_(ref_out)
        # FLASH_API: softmax_lse (B, H, M) float32, no padding; a row that sees no key: +inf
        # (flash_attn/softmax.h: lse = INFINITY where the row's sum is 0)
        lse = ref_lse.masked_fill(torch.isneginf(ref_lse), float("inf"))
        rng_state = torch.zeros(2, dtype=torch.uint64)  # "[Note] BC breaking change to flash seed/offset"
        unused = torch.zeros((), dtype=torch.uint64)
        return out, lse, None, None, q.shape[2], k.shape[2], rng_state, unused, torch.empty(0, dtype=q.dtype)

    def flash_bwd(self, grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                  philox_seed, philox_offset, *, scale):
        self._flash_checks(q, k, v, "backward")
        # FLASH_API mha_bwd: "out tensor must have contiguous last dimension", likewise dout
        _check(out.stride(-1) == 1, "out tensor must have contiguous last dimension")
        _check(grad_out.stride(-1) == 1, "dout tensor must have contiguous last dimension")
        _check(out.shape == q.shape and grad_out.shape == q.shape, "out and dout have query's shape")
        # FLASH_API: CHECK_SHAPE(softmax_lse, batch_size, num_heads, seqlen_q), float32
        _check(tuple(lse.shape) == tuple(q.shape[:3]), f"softmax_lse must be (B, H, M) = {tuple(q.shape[:3])}, "
                                                       f"got {tuple(lse.shape)}")
        _check(lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32), "softmax_lse is float32")
        # FLASH_API: softmax_lse is read as a packed (B, H, M) array, without its strides
        _check(lse.is_contiguous(), "softmax_lse must be contiguous")
        # ATTN_BWD: dense attention has no cumulative sequence lengths; max_q / max_k are the lengths
        _check(cum_seq_q is None and cum_seq_k is None, "dense flash attention takes no cum_seq tensors")
        _check((max_q, max_k) == (q.shape[2], k.shape[2]), "max_q / max_k must be the sequence lengths")
        # META / FLASH_API: philox seed / offset as the forward returns them (uint64 (2,) and ())
        _check(philox_seed.dtype == torch.uint64 and philox_offset.dtype == torch.uint64, "philox tensors are uint64")
        _check(dropout_p == 0.0, "no dropout")
        self._square_causal(is_causal, q, k)
        self.calls["flash_bwd"] += 1
        return MATH.backward(grad_out, q, k, v, out, lse, is_causal, None, scale)

    # -- memory-efficient --------------------------------------------------------------------
    def _alignment(self, dtype: torch.dtype, direction: str) -> int:
        if direction == "backward":
            return 4  # KBWD check_supported: kMinimumAlignment (4 on sm80) for pointers and strides
        # KFWD: kAlignmentQ = DefaultConfig::kAlignmentA = 128 bits / element bits on tensor cores
        # (sm80+ has only these "aligned" kernels: cutlassF.h); fp32 (and float64 here) 4
        return 8 if dtype in HALF else 4

    def _efficient_checks(self, q, k, v, bias, direction: str) -> None:
        # GKU: "Your device is too old. We require compute capability >= 50"
        _check(self.capability >= (5, 0), "Your device is too old. We require compute capability >= 50")
        dtype = self._dtypes(q, k, v)
        allowed = {torch.float16, torch.float32} | ({torch.bfloat16} if self.capability >= (8, 0) else set())
        # cutlassF.h: bf16 kernels only for cc 80+; f16 / f32 from sm50
        _check(dtype in allowed or (self.float64 and dtype == torch.float64),
               f"cutlassF: no kernel found to launch! ({dtype} on sm{self.capability[0]}{self.capability[1]})")
        # ATTN_CU: TORCH_CHECK(query.size(2) == key.size(2)) in (B, M, H, K): no grouped-query heads
        _check(q.shape[1] == k.shape[1] == v.shape[1], "the efficient kernel takes as many K/V heads as query heads")
        _check(q.shape[-1] == k.shape[-1], "query and key must have the same head dim")
        # GKU CHECK_NOSPARSE_LASTCONTIGUOUS_CUDA: "query: last dimension must be contiguous"
        for name, t in (("query", q), ("key", k), ("value", v)):
            _check(t.stride(-1) == 1, f"{name}: last dimension must be contiguous")
        align = self._alignment(dtype, direction)
        # the launcher takes the first kernel whose strides (B, M, H of the (B, M, H, K) view) are
        # multiples of its alignment; on sm80+ only aligned kernels exist
        for name, t in (("query", q), ("key", k), ("value", v)):
            _check(all(stride % align == 0 for size, stride in zip(t.shape[:3], t.stride()[:3]) if size > 1)
                   and t.storage_offset() % align == 0,
                   f"cutlassF: no kernel found to launch! ({name} strides {t.stride()} not multiples of {align})")
        if bias is None:
            return
        # ATTN_CU: "invalid dtype for bias - should match query's dtype", "Bias expected in BMHK format"
        _check(bias.dtype == dtype, "invalid dtype for bias - should match query's dtype")
        _check(bias.dim() == 4, "Bias expected in BMHK format")
        want = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        for dim, what in enumerate(("batch", "head", "seqlenQ", "seqlenKV")):
            _check(bias.shape[dim] == want[dim], f"attn_bias: wrong shape ({what} dimension)")
        _check(bias.stride(3) == 1, "attn_bias: wrong alignment (last dimension must be contiguous)")
        # GKU CHECK_ALIGNED_PTR(p.attn_bias_ptr, kAlignmentQ) (a fresh storage is aligned; its offset must be)
        _check(bias.storage_offset() % align == 0, "p.attn_bias_ptr is not correctly aligned")
        # KFWD / KBWD: p.num_batches <= 1 || p.bias_strideB % kAlignmentQ == 0, likewise H and M
        for dim, name in ((0, "strideB"), (1, "strideH"), (2, "strideM")):
            _check(bias.shape[dim] <= 1 or bias.stride(dim) % align == 0,
                   f"attn_bias is not correctly aligned ({name}). attn_bias.stride({dim}) = {bias.stride(dim)}, "
                   f"and should be a multiple of {align}.")

    def efficient_fwd(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale):
        self._efficient_checks(q, k, v, attn_bias, "forward")
        _check(compute_log_sumexp and dropout_p == 0.0, "the glue asks for the lse and no dropout")
        self._square_causal(is_causal, q, k)
        self.calls["efficient_fwd"] += 1
        ref_out, ref_lse = MATH.forward(q, k, v, is_causal, attn_bias, scale)
        B, H, M, _ = q.shape
        # ATTN_CU: res = at::empty({B, M, num_heads, Kv}): the output is (B, M, H, K) in memory
        out = torch.empty(B, M, H, v.shape[-1], dtype=q.dtype).transpose(1, 2).copy_(ref_out)
        # KFWD: a fully masked row gets lse 0 and output 0 ("We set fully masked out rows to 0")
        seen = torch.isfinite(ref_lse)
        out = out.masked_fill_(~seen[..., None], 0.0)
        # KFWD: lse (B, H, ceil(M / kAlignLSE) * kAlignLSE), kAlignLSE = 32, the pad filled with +inf;
        # ROCm (AOTriton): compact, kAlignLSE = 1 (META: logsumexp_dim = M under torch.version.hip).
        # Natural log, as the reference's (KFWD: mi / kLog2e + log(s_prime))
        width = math.ceil(M / self.lse_row_multiple) * self.lse_row_multiple
        lse = torch.full((B, H, width), float("inf"), dtype=ref_lse.dtype)
        lse[..., :M] = torch.where(seen, ref_lse, 0.0)
        seed = torch.zeros((), dtype=torch.long)  # ATTN_CU: int64 0-dim seed / offset
        return out, lse, seed, seed.clone()

    def efficient_bwd(self, grad_out, q, k, v, attn_bias, out, lse, philox_seed, philox_offset, dropout_p,
                      grad_input_mask, is_causal, *, scale):
        self._efficient_checks(q, k, v, attn_bias, "backward")
        B, H, M, _ = q.shape
        # KBWD: o_strideM() returns head_dim_value * num_heads: out's row stride is assumed, not read,
        # so out must have the forward's (B, M, H, K) rows (read in-kernel for fp16/bf16; enforced for
        # every dtype here, so that the exact float64 runs see it too)
        _check(out.shape == (B, H, M, v.shape[-1]) and out.stride(-1) == 1 and
               (M <= 1 or out.stride(2) == H * v.shape[-1]),
               f"out must have the (B, M, H, K) rows the kernel assumes (o_strideM = head_dim * num_heads = "
               f"{H * v.shape[-1]}), got strides {out.stride()}")
        width = math.ceil(M / self.lse_row_multiple) * self.lse_row_multiple
        _check(lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32), "logsumexp is float32")
        # KBWD: the kernel reads ceil(M / 32) * 32 entries per (B, H) (mma_from_smem.h) and requires
        # lse_strideB / lse_strideH % 8 == 0 ("LSE is not correctly aligned (strideH)"); ROCm views
        # it as (B * H, M) (compact)
        _check(tuple(lse.shape) == (B, H, width), f"logsumexp must be (B, H, {width}) as the forward returned it, "
                                                  f"got {tuple(lse.shape)}")
        if self.lse_row_multiple == 1:
            _check(lse.is_contiguous(), "ROCm views logsumexp as (B * H, M): it must be compact")
        else:
            _check(lse.stride(0) % 8 == 0 and lse.stride(1) % 8 == 0, "LSE is not correctly aligned (strideH)")
        # the pad rows as the forward wrote them (+inf: "To make the backward easier, we pad logsumexp with inf")
        _check(bool(torch.isposinf(lse[..., M:]).all()), "the logsumexp pad rows must be +inf, as the forward wrote them")
        _check(philox_seed.dtype == torch.long and philox_offset.dtype == torch.long, "int64 philox seed / offset")
        _check(dropout_p == 0.0 and list(grad_input_mask)[:3] == [True, True, True], "no dropout, q/k/v gradients")
        self._square_causal(is_causal, q, k)
        self.calls["efficient_bwd"] += 1
        # ATTN_BWD: grad_out = grad_out_.contiguous(): any layout is taken
        dq, dk, dv = MATH.backward(grad_out, q, k, v, out, lse[..., :M], is_causal, attn_bias, scale)
        return dq, dk, dv, None
