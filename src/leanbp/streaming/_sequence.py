"""What a training loop does with a sequence-parallel model (``stream(model, sequence_parallel=group)``):
hand each rank its rows, sum a per-sequence quantity over the group, sum the gradients once a step."""

from __future__ import annotations

import torch
from torch import nn

from ..engine import SequenceGroup, reduce_gradients, sum_over_group
from ._state import causal_lm_of, state_of


def _group(model: nn.Module) -> SequenceGroup:
    state = state_of(causal_lm_of(model))
    if state is None or state.sequence is None:
        raise ValueError("the model is not sequence-parallel: call leanbp.stream(model, sequence_parallel=group)")
    return state.sequence


def sequence_rows(model: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """This rank's rows (dim 1) of a whole-sequence tensor: rank r takes rows [r T/P, (r+1) T/P).
    T must be a multiple of the group's size P (pad with labels -100 and attention mask 0)."""
    sp = _group(model)
    T = t.shape[1]
    if T % sp.size:
        raise ValueError(f"a sequence of {T} rows does not split over {sp.size} ranks: pad it to a multiple of "
                         f"{sp.size} (labels -100, attention mask 0)")
    n = T // sp.size
    return t[:, sp.offset(n): sp.offset(n) + n]


def sequence_sum(model: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a rank's partial sum, e.g. its rows' share of a sequence's log-prob) summed over the
    group: the whole sequence's value on every rank, with the gradient of this rank's share (DPO's
    and GRPO's per-sequence sums go through it, and stay exact)."""
    return sum_over_group(t, _group(model))


def reduce_sequence_gradients(model: nn.Module) -> None:
    """Sum the trainable parameters' gradients over the group (each rank holds its rows' share): once
    per optimizer step, after the last backward of the step."""
    sp = _group(model)
    reduce_gradients((p for p in model.parameters() if p.requires_grad), sp.group)
