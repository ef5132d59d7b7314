"""TRL's fused LM head, as leanbp answers it.

TRL's trainers (SFT, DPO, GRPO, KTO, RLOO) call ``trl.trainer.utils.add_fused_lm_head(model, ...)``,
which replaces ``model.forward`` with a closure: a call with ``fused_lm_head=True`` runs the backbone
and computes per-token log-probs (and entropy, ...) in tiles, returning a ``FusedCausalLMOutput``.
When such a forward sits under leanbp's, leanbp answers those calls itself with the same settings,
which it reads from the closure (checked against the names TRL 1.16 uses; anything else is left to
TRL). Importing this module does not import TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine import LogitTransform

_SETTINGS = ("temperature", "outputs", "cast_lm_head_to_fp32", "final_logit_softcapping", "logit_scale")


@dataclass(frozen=True)
class FusedHeadSpec:
    outputs: tuple[str, ...]
    transform: LogitTransform
    fp32_head: bool


def fused_head_spec(forward) -> FusedHeadSpec | None:
    """The settings of TRL's fused-head forward ``forward`` (a bound method), or None when it is not one."""
    fn = getattr(forward, "__func__", None)
    code = getattr(fn, "__code__", None)
    # functools.wraps gave the closure the model's forward's name and module; its code keeps TRL's
    if code is None or code.co_name != "_fused_forward" or "trl" not in code.co_filename:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    if not set(_SETTINGS) <= cells.keys():
        return None
    return FusedHeadSpec(
        outputs=tuple(cells["outputs"]),
        transform=LogitTransform(scale=float(cells["logit_scale"]), softcap=cells["final_logit_softcapping"],
                                 temperature=float(cells["temperature"])),
        fp32_head=bool(cells["cast_lm_head_to_fp32"]),
    )


def fused_output(stats: dict[str, torch.Tensor], mask: torch.Tensor, num_items_in_batch=None, aux=None):
    """TRL's ``FusedCausalLMOutput`` from leanbp's per-token statistics (zero where ``mask`` is False);
    ``aux``: (load-balancing loss, its weight in the loss), as TRL adds it for MoE models."""
    from trl.trainer.utils import FusedCausalLMOutput

    log_probs = stats["log_probs"]
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / count
    aux_loss = None
    if aux is not None:
        aux_loss, coef = aux
        loss = loss + coef * aux_loss
    return FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=aux_loss, **stats)
