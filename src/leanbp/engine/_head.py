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

from ._grads import AutocastState, GradSum, accumulation_dtype

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
    # the input is a tensor nothing else will read (the last streamed layer's output): its rows
    # may be overwritten with their gradient once read
    input_is_scratch: bool = False

    @property
    def fused(self) -> bool:
        """A plain nn.Linear head gets the fused path (one (n, V) buffer per chunk); anything else
        (a PEFT-wrapped head, say) goes through autograd."""
        return type(self.lm_head) is nn.Linear


def _autograd_chunk(run: HeadRun, rows, targets, inputs, want_grad):
    """Summed CE of one chunk of final hidden rows (n, H) and its gradients w.r.t. ``inputs``."""
    with torch.set_grad_enabled(want_grad), run.autocast():
        logits = run.lm_head(run.norm(rows))  # (n, V)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    grads = torch.autograd.grad(loss, inputs, allow_unused=True) if want_grad else None
    return loss.detach(), grads


def _fused_chunk(run: HeadRun, rows, targets, inputs, want_grad, head_grads):
    """As ``_autograd_chunk`` for an nn.Linear head, with the CE gradient written in place.

    Memory: the (n, V) logits buffer is reused for the probabilities and then for dL/dlogits,
    and the head's gradients are added straight into the running sums ``head_grads`` (no (V, H)
    temporary unless the sums are kept in a wider dtype than the logits).
    Only the norm in front of the head goes through autograd.
    """
    head = run.lm_head
    with torch.set_grad_enabled(want_grad), run.autocast():
        normed = run.norm(rows)  # (n, H), graph kept for its backward
        with torch.no_grad():
            logits = F.linear(normed, head.weight, head.bias)  # (n, V)
    acc = logits.to(torch.promote_types(logits.dtype, torch.float32))  # no copy unless bf16/fp16
    del logits
    lse = torch.logsumexp(acc, dim=-1)  # (n,)
    picked = acc.gather(1, targets[:, None]).squeeze(1)
    loss = (lse - picked).sum()
    if not want_grad:
        return loss, None
    # d(sum CE)/dlogits = softmax - onehot, computed in the logits buffer itself
    acc.sub_(lse[:, None]).exp_()
    acc[torch.arange(acc.shape[0], device=acc.device), targets] -= 1
    # the backward matmuls run in the weight's dtype: under autocast (fp32 weight, bf16 logits)
    # that avoids a bf16 copy of the (V, H) weight per chunk and is more precise
    grad_dtype = head.weight.dtype
    dlogits = acc.to(grad_dtype)
    del acc
    x = normed.detach().to(grad_dtype)
    if "weight" in head_grads:
        w_grad = head_grads["weight"]
        if w_grad.dtype == grad_dtype:
            w_grad.addmm_(dlogits.T, x)  # (V, H), in place: no temporary
        else:
            w_grad.add_(dlogits.T @ x)  # low-precision weight: a (V, H) temporary summed in fp32
    if "bias" in head_grads:
        head_grads["bias"].add_(dlogits.sum(0))
    dnormed = (dlogits @ head.weight).to(normed.dtype)  # (n, H)
    del dlogits
    norm_inputs = [t for t in inputs if t is not head.weight and t is not head.bias]
    norm_grads = torch.autograd.grad(normed, norm_inputs, dnormed, allow_unused=True) if norm_inputs else []
    it = iter(norm_grads)
    grads = [None if t is head.weight or t is head.bias else next(it) for t in inputs]
    return loss, grads


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
        head_grad = {}
        if want_grad and run.fused:
            # running sums of the head's own gradients, added to in place chunk by chunk
            head = run.lm_head
            head_grad = {name: torch.zeros_like(t, dtype=accumulation_dtype(t.dtype))
                         for name, t in (("weight", head.weight), ("bias", head.bias))
                         if t is not None and any(t is p for p in trainable)}
        dflat = None
        if want_grad and need_input:
            if run.input_is_scratch:
                # Memory: dL/dhidden goes into the input's own buffer. Each labelled row is read
                # (copied out) before its gradient is written back; unlabelled rows are never read.
                dflat = flat.masked_fill_((targets == IGNORE_INDEX)[:, None], 0)
            else:
                dflat = torch.zeros_like(flat)
        for s in range(0, rows.numel(), run.chunk_size):
            idx = rows[s : s + run.chunk_size]
            rows_c = flat.index_select(0, idx).detach().requires_grad_(want_grad and need_input)
            inputs = ([rows_c] if need_input else []) + trainable
            targets_c = targets.index_select(0, idx)
            if run.fused:
                loss_c, g = _fused_chunk(run, rows_c, targets_c, inputs, want_grad, head_grad)
            else:
                loss_c, g = _autograd_chunk(run, rows_c, targets_c, inputs, want_grad)
            if want_grad:
                g = list(g)
                if need_input:
                    dflat.index_copy_(0, idx, g.pop(0))  # each row is in exactly one chunk
                grads.add(g)
            total += loss_c
        if head_grad:
            head = run.lm_head
            grads.add([head_grad.get("weight") if p is head.weight else
                       head_grad.get("bias") if p is head.bias else None for p in trainable], owned=True)
        loss = total / run.denominator

        ctx.denominator = run.denominator
        ctx.param_grads = grads if want_grad else None
        ctx.hidden_shape = hidden.shape
        # kept as a plain attribute, not saved: with a scratch input it is that (modified) input
        ctx.dflat = dflat
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.param_grads is None:
            raise RuntimeError(
                "leanbp's chunked loss was computed with gradients disabled and cannot be backpropagated"
            )
        scale = grad_loss / ctx.denominator
        # Memory: drop ctx's reference so the summed head gradients are handed over, not copied
        param_grads, ctx.param_grads = ctx.param_grads, None
        dinput = None
        if ctx.needs_input_grad[0]:
            dflat, ctx.dflat = ctx.dflat, None
            dinput = dflat.mul_(scale.to(dflat.dtype)).view(ctx.hidden_shape)
        it = iter(param_grads.result(scale))
        return (dinput, None, *[next(it) if need else None for need in ctx.needs_input_grad[2:]])
