"""What a training loop does with a sequence-parallel model (``stream(model, sequence_parallel=group)``):
hand each rank its rows, sum a per-sequence quantity over the group, sum the gradients once a step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..engine import IGNORE_INDEX, SequenceGroup, reduce_gradients, sum_over_group
from ._state import causal_lm_of, state_of


def _group(model: nn.Module) -> SequenceGroup:
    state = state_of(causal_lm_of(model))
    if state is None or state.sequence is None:
        raise ValueError("the model is not sequence-parallel: call leanbp.stream(model, sequence_parallel=group)")
    return state.sequence


def sequence_rows(model: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """This rank's rows (dim 1) of a whole-sequence tensor: rank r takes rows [r T/P, (r+1) T/P).
    T must be a multiple of the group's size P (``sequence_batch`` pads a batch to one)."""
    return _rows(_group(model), t)


def _rows(sp: SequenceGroup, t: torch.Tensor) -> torch.Tensor:
    T = t.shape[1]
    if T % sp.size:
        raise ValueError(f"a sequence of {T} rows does not split over {sp.size} ranks: pad it to a multiple of "
                         f"{sp.size} (labels -100, attention mask 0), as leanbp.sequence_batch does")
    n = T // sp.size
    return t[:, sp.offset(n): sp.offset(n) + n]


# how ``sequence_batch`` fills the rows it appends: no label, masked out, a token id that exists
_FILL = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0}
_PADDED = {*_FILL, "position_ids"}  # (positions continue instead)


def sequence_batch(model: nn.Module, **batch: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """This rank's rows of every (B, T) tensor of a batch (``input_ids``, ``labels``,
    ``attention_mask``, ``position_ids``; None stays None), after padding T on the right to a
    multiple of the group's size P: the appended rows carry no label (-100), are masked out and
    continue the positions. Exact for a causal model: a row appended at the end changes no
    earlier row, and a row without a label adds nothing to any loss or count."""
    return rows_of(_group(model), batch)


def rows_of(sp: SequenceGroup, batch: dict) -> dict[str, torch.Tensor | None]:
    """``sequence_batch`` for the group ``sp``."""
    given = {k: v for k, v in batch.items() if v is not None}
    unknown = set(given) - _PADDED
    if unknown:
        raise ValueError(f"sequence_batch pads {sorted(_PADDED)}; it does not know how to pad "
                         f"{sorted(unknown)}: pad those to a multiple of {sp.size} rows and use sequence_rows")
    lengths = {v.shape[1] for v in given.values()}
    if len(lengths) > 1:
        raise ValueError(f"the batch's tensors have different lengths {sorted(lengths)}")
    pad = -lengths.pop() % sp.size if lengths else 0
    out = {}
    for name, t in batch.items():
        if t is not None and pad:
            if name == "position_ids":  # (continuing the last position: no new document starts)
                t = torch.cat([t, t[:, -1:] + torch.arange(1, pad + 1, device=t.device, dtype=t.dtype)], dim=1)
            else:
                t = F.pad(t, (0, pad), value=_FILL[name])
        out[name] = None if t is None else _rows(sp, t)
    return out


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
