"""Final norm + LM head + cross-entropy, chunked over the rows that carry a label.

Semantics are transformers' causal-LM loss: row t predicts labels[t + 1], -100 is ignored, the
sum is divided by ``num_items_in_batch`` when given and by the number of labelled rows otherwise.
Logits are upcast to at least fp32 before the softmax (as transformers does) but float64 stays
float64. Full (T, V) logits never exist: at most ``chunk_size`` rows of logits live at a time.

The gradient of each chunk is taken right after its loss (the logits are then freed), so backward
only scales the stored gradients by dL/dloss: the head is computed once, not twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._grads import AutocastState, GradSum

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """labels (B, T) -> targets (B, T): row t is scored against labels[t + 1]; the last row is ignored."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


@dataclass
class HeadRun:
    norm: nn.Module
    lm_head: nn.Module
    targets: torch.Tensor  # (B, T) shifted labels
    denominator: torch.Tensor | float  # num_items_in_batch or the count of labelled rows
    chunk_size: int
    autocast: AutocastState
    # grad mode of the caller: inside Function.forward grad mode is always off
    grad_enabled: bool

    def chunk_loss_sum(self, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of (n, H) final hidden rows against (n,) targets."""
        logits = self.lm_head(self.norm(rows))  # (n, V): the only logits alive at any time
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


class ChunkedHeadLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, run: HeadRun, *params: torch.Tensor) -> torch.Tensor:
        B, T, H = hidden.shape
        flat = hidden.reshape(B * T, H)
        targets = run.targets.reshape(B * T)
        # Only labelled rows need logits: prompt and padding rows are skipped, not computed and masked.
        rows = torch.nonzero(targets != IGNORE_INDEX).squeeze(1)
        need_input = ctx.needs_input_grad[0]
        trainable = [p for p, need in zip(params, ctx.needs_input_grad[2:]) if need]
        want_grad = run.grad_enabled and (need_input or bool(trainable))

        total = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        grads = GradSum(trainable)
        dflat = torch.zeros_like(flat) if (want_grad and need_input) else None
        for s in range(0, rows.numel(), run.chunk_size):
            idx = rows[s : s + run.chunk_size]
            rows_c = flat.index_select(0, idx).detach().requires_grad_(want_grad and need_input)
            with torch.set_grad_enabled(want_grad), run.autocast():
                loss_c = run.chunk_loss_sum(rows_c, targets.index_select(0, idx))
            if want_grad:
                inputs = ([rows_c] if need_input else []) + trainable
                g = list(torch.autograd.grad(loss_c, inputs, allow_unused=True))
                if need_input:
                    dflat.index_add_(0, idx, g.pop(0))
                grads.add(g)
            total += loss_c.detach()
        loss = total / run.denominator

        ctx.denominator = run.denominator
        ctx.param_grads = grads if want_grad else None
        ctx.hidden_shape = hidden.shape
        if dflat is not None:
            ctx.save_for_backward(dflat)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.param_grads is None:
            raise RuntimeError(
                "leanbp's chunked loss was computed with gradients disabled and cannot be backpropagated"
            )
        scale = grad_loss / ctx.denominator
        dinput = None
        if ctx.needs_input_grad[0]:
            (dflat,) = ctx.saved_tensors
            dinput = (dflat * scale.to(dflat.dtype)).view(ctx.hidden_shape)
        it = iter(ctx.param_grads.result(scale))
        return (dinput, None, *[next(it) if need else None for need in ctx.needs_input_grad[2:]])
