"""One decoder layer as an autograd Function that keeps only its input.

Forward (no graph): K/V of all rows once, then attention + MLP chunk by chunk.
Backward: K/V of all rows recomputed once (with a graph), then for each chunk the layer is
recomputed for that chunk's rows and backpropagated with that chunk's slice of dL/dH_out; dK/dV
for the visible rows accumulate, and finally flow back through the K/V projections once. The
parameters are explicit inputs of the Function and their chunk gradients are summed before being
returned, so each parameter's gradient reaches autograd (and DDP/FSDP hooks) once per backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._attention import chunk_mask, key_start
from ._grads import AutocastState, GradSum


@dataclass
class LayerRun:
    """Everything one call of a streamed layer needs besides its input and parameters."""

    adapter: object
    layer: nn.Module
    window: int | None
    cos: torch.Tensor  # (1 or B, T, D)
    sin: torch.Tensor
    key_keep: torch.Tensor | None  # (B, T) bool, None when nothing is padded
    chunk_size: int
    autocast: AutocastState

    def chunks(self, length: int) -> list[tuple[int, int]]:
        return [(s, min(s + self.chunk_size, length)) for s in range(0, length, self.chunk_size)]

    def key_begin(self, start: int) -> int:
        return key_start(start, self.window)

    def chunk_out(self, hidden_c, key_vis, value_vis, start, end):
        """Layer output for rows [start, end); key_vis/value_vis are the visible K/V rows
        [key_begin(start), end), each (B, Hkv, end - key_begin, D)."""
        mask = chunk_mask(start, end, self.key_begin(start), self.window, self.key_keep, hidden_c.device)
        return self.adapter.chunk_forward(
            self.layer, hidden_c, key_vis, value_vis, self.cos[:, start:end], self.sin[:, start:end], mask
        )


class StreamedLayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, run: LayerRun, *params: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            key, value = run.adapter.key_value(run.layer, hidden, run.cos, run.sin)
            out = torch.empty_like(hidden)
            for s, e in run.chunks(hidden.shape[1]):
                kb = run.key_begin(s)
                out[:, s:e] = run.chunk_out(hidden[:, s:e], key[:, :, kb:e], value[:, :, kb:e], s, e)
        # Memory: the layer input is the only activation kept until backward.
        ctx.save_for_backward(hidden, *params)
        ctx.run = run
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, *params = ctx.saved_tensors
        run: LayerRun = ctx.run
        need_input = ctx.needs_input_grad[0]
        trainable = [p for p, need in zip(params, ctx.needs_input_grad[2:]) if need]
        grads = GradSum(([hidden] if need_input else []) + trainable)
        grad_out = grad_out.contiguous()

        # K/V of all rows, once, with a graph kept until every chunk has added its dK/dV.
        with torch.enable_grad(), run.autocast():
            full = hidden.detach().requires_grad_(need_input)
            key, value = run.adapter.key_value(run.layer, full, run.cos, run.sin)
        kv_out = [t for t in (key, value) if t.requires_grad]
        key_d, value_d = key.detach(), value.detach()
        dkey = torch.zeros_like(key_d) if key.requires_grad else None
        dvalue = torch.zeros_like(value_d) if value.requires_grad else None
        dhidden = torch.zeros_like(hidden) if need_input else None

        for s, e in reversed(run.chunks(hidden.shape[1])):
            kb = run.key_begin(s)
            hidden_c = hidden[:, s:e].detach().requires_grad_(need_input)
            # K/V rows visible to this chunk as leaves: their grads are (B, Hkv, e-kb, D), not T rows
            key_c = key_d[:, :, kb:e].detach().requires_grad_(dkey is not None)
            value_c = value_d[:, :, kb:e].detach().requires_grad_(dvalue is not None)
            with torch.enable_grad(), run.autocast():
                out_c = run.chunk_out(hidden_c, key_c, value_c, s, e)
            inputs = [t for t in (hidden_c, key_c, value_c) if t.requires_grad] + trainable
            g = torch.autograd.grad(out_c, inputs, grad_out[:, s:e], allow_unused=True)
            g = list(g)
            if need_input:
                dhidden[:, s:e] += g.pop(0)
            if dkey is not None:
                _add(dkey[:, :, kb:e], g.pop(0))
            if dvalue is not None:
                _add(dvalue[:, :, kb:e], g.pop(0))
            grads.add(([None] if need_input else []) + g)
            del out_c, g

        if kv_out:
            kv_grads = [d for d in (dkey, dvalue) if d is not None]
            inputs = ([full] if need_input else []) + trainable
            g = torch.autograd.grad(kv_out, inputs, kv_grads, allow_unused=True)
            grads.add(g)
        result = grads.result()
        dinput = None
        if need_input:
            dinput = dhidden + result.pop(0) if result[0] is not None else dhidden
        it = iter(result)
        return (dinput, None, *[next(it) if need else None for need in ctx.needs_input_grad[2:]])


def _add(buffer: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is not None:
        buffer += grad

