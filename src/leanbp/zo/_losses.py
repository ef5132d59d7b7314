"""Per-example losses of a causal LM without autograd: what a zeroth-order step compares.

    loss_b = - (1 / n_b) sum_{t labelled} log p(labels[b, t + 1] | tokens[b, :t + 1])     (B,)

the mean next-token cross-entropy over row b's labelled tokens (n_b of them; a row with none has
loss 0). For a classification example (a prompt, then one label token) that is the cross-entropy
of the label token under the LM head. Each row's loss depends on that row alone (attention is
masked per row; no layer mixes the rows of a batch), which is what lets a private step bound one
example's influence by clipping its own loss difference.

A model streamed by ``leanbp.stream`` answers with ``token_log_probs``: its decoder runs chunk by
chunk and its head scores ``head_chunk_size`` rows at a time, so no (B, T, V) logits exist. Any
other model runs its own forward and scores its logits (a (B, T, V) tensor: fine for small
models; stream a large one).

The forwards run in evaluation mode: the two forwards of a step must compute the same function,
so nothing may draw random numbers (dropout, router jitter); the mode is restored afterwards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..engine import IGNORE_INDEX, shift_labels
from ..streaming import is_streamed, token_log_probs


@torch.no_grad()
def example_losses(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) float64: each row's mean next-token cross-entropy over its labelled tokens (labels -100
    are not scored; row t is scored against labels[:, t + 1], as in transformers' loss)."""
    if labels.shape != input_ids.shape[:2]:
        raise ValueError(f"labels must have shape {tuple(input_ids.shape[:2])}, got {tuple(labels.shape)}")
    targets = shift_labels(labels)  # (B, T)
    scored = targets != IGNORE_INDEX  # (B, T)
    was_training = model.training
    model.eval()
    try:
        if is_streamed(model):
            log_probs = token_log_probs(model, labels, input_ids=input_ids, attention_mask=attention_mask)["log_probs"]
        else:
            log_probs = _log_probs_from_logits(model, input_ids, attention_mask, targets, scored)
    finally:
        model.train(was_training)
    # (B, T) -> (B,): sums in float64, so that the small difference of two such losses keeps its digits
    total = -(log_probs.double() * scored.to(log_probs.device)).sum(dim=1)
    count = scored.sum(dim=1).to(total.device)
    return total / count.clamp(min=1)


def _log_probs_from_logits(model, input_ids, attention_mask, targets, scored) -> torch.Tensor:
    """(B, T) log-probabilities of ``targets`` from the model's own (B, T, V) logits."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # (B, T, V)
    safe = targets.masked_fill(~scored, 0).to(logits.device)  # (B, T)
    # at least float32 (a float64 model keeps float64). Memory: one more (B, T, V) tensor, the log-softmax
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    log_probs = F.log_softmax(logits, dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return log_probs.masked_fill(~scored.to(log_probs.device), 0.0)
