"""Summing per-chunk gradients before autograd sees them.

Every streamed Function (a layer, the chunked final norm, the chunked head) computes its
parameters' gradients chunk by chunk and returns each one once, summed: autograd, and the hooks of
DDP, FSDP2 and ZeRO on it, then see one gradient per parameter per backward, as in plain training,
whatever the number of chunks (see ``leanbp.distributed``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch._subclasses.fake_tensor import is_fake


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Chunk sums of low-precision gradients are kept in fp32, so summing D chunk terms adds no
    more rounding than one big matmul would; fp32 and fp64 gradients are summed in their own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class GradSum:
    """Running sums of gradients for a fixed list of parameters.

    Memory: a sum starts in the parameter's own gradient when that holds only zeros (a loop that
    zeroes in place, ``zero_grad(set_to_none=False)``, keeps every gradient resident): summing
    into a second tensor would hold both while the Function runs (12 MiB per layer of the bench
    model, 62.5 MiB for its head). ``param.grad`` is None meanwhile, and the Function's return
    hands the sum back through autograd, which adopts the tensor (nothing else holds it) and runs
    every gradient hook as usual. Exact for any upstream gradient: the sum started from zero,
    so it holds this Function's part alone. Other sums are created on first use."""

    def __init__(self, params: list[torch.Tensor]):
        # shape, dtype and device as they are now, while the Function runs: an engine that shards
        # parameters (ZeRO-3) may have taken a parameter's data away by the time the sums are read
        self._like = [(t.shape, t.dtype, t.device) for t in params]
        self._sums: list[torch.Tensor | None] = _take_zero_grads(params)

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

    def sum_of(self, i: int) -> torch.Tensor:
        """The running sum of parameter ``i``, for a caller that adds into it in place (zeros if
        nothing was added yet)."""
        if self._sums[i] is None:
            shape, dtype, device = self._like[i]
            self._sums[i] = torch.zeros(shape, dtype=accumulation_dtype(dtype), device=device)
        return self._sums[i]

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


def _take_zero_grads(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """For each parameter, its gradient if it holds only zeros (and is then set to None), else None.

    Only a plain gradient that owns its memory, in the dtype its sum is kept in, qualifies: a view
    into an engine's buffer (DDP's gradient_as_bucket_view, ZeRO's) is that engine's to write. A
    fake gradient (``leanbp plan``) has no values and stands for a loop's zeroed one. One check
    for all of them (one device sync)."""
    candidates = [i for i, p in enumerate(params)
                  if (g := p.grad) is not None and g._base is None and g.shape == p.shape and g.is_contiguous()
                  and g.dtype == accumulation_dtype(p.dtype) and g.device.type != "meta"
                  and (type(g) is torch.Tensor or is_fake(g))]
    taken: list[torch.Tensor | None] = [None] * len(params)
    if not candidates:
        return taken
    # (fake gradients are read too, so that the planner's work counter sees the real step's reads)
    flags = [params[i].grad.any() for i in candidates]
    if len({f.device for f in flags}) > 1:
        nonzero = [bool(f) for f in flags]
    else:
        stacked = torch.stack(flags)
        nonzero = [False] * len(flags) if is_fake(stacked) else stacked.tolist()
    for i, skip in zip(candidates, nonzero):
        if not skip:
            taken[i], params[i].grad = params[i].grad, None
    return taken


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
