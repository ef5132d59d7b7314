"""Summing per-chunk gradients before autograd sees them.

Every streamed Function (a layer, the chunked final norm, the chunked head) computes its
parameters' gradients chunk by chunk and returns each one once, summed: autograd, and the hooks of
DDP, FSDP2 and ZeRO on it, then see one gradient per parameter per backward, as in plain training,
whatever the number of chunks (see ``leanbp.distributed``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Chunk sums of low-precision gradients are kept in fp32, so summing D chunk terms adds no
    more rounding than one big matmul would; fp32 and fp64 gradients are summed in their own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class GradSum:
    """Running sums of gradients for a fixed list of tensors, created lazily on first use."""

    def __init__(self, like: list[torch.Tensor]):
        # shape, dtype and device as they are now, while the Function runs: an engine that shards
        # parameters (ZeRO-3) may have taken a parameter's data away by the time the sums are read
        self._like = [(t.shape, t.dtype, t.device) for t in like]
        self._sums: list[torch.Tensor | None] = [None] * len(like)

    def add(self, grads, owned: bool = False) -> None:
        """Add one chunk's gradients. Unless ``owned``, the first one is copied: autograd may hand
        back a view of its grad_outputs (a residual path does), which must not be added into."""
        for i, g in enumerate(grads):
            if g is None:
                continue
            if self._sums[i] is None:
                dtype = accumulation_dtype(g.dtype)
                self._sums[i] = g if owned and g.dtype == dtype else g.to(dtype, copy=True)
            else:
                self._sums[i].add_(g)

    def result(self, scale: torch.Tensor | float | None = None, zeros_for_missing: bool = False
               ) -> list[torch.Tensor | None]:
        """The sums (scaled in place, then cast to each tensor's dtype). Call once: the sums are
        handed over, not copied. A tensor that got no gradient gets None, or zeros when asked
        (a chunked loss over no labelled row still owes every parameter its zero gradient)."""
        out = []
        for (shape, dtype, device), s in zip(self._like, self._sums):
            if s is None:
                out.append(torch.zeros(shape, dtype=dtype, device=device) if zeros_for_missing else None)
                continue
            if scale is not None:
                s.mul_(scale)
            out.append(s.to(dtype))
        self._sums = [None] * len(self._like)
        return out


class AutocastState:
    """The autocast setting active in forward, replayed around recomputation in backward."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.enabled = torch.is_autocast_enabled(device_type)
        self.dtype = torch.get_autocast_dtype(device_type) if self.enabled else None

    def __call__(self):
        if not self.enabled:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)
