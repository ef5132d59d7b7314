"""One process's stage of a streamed causal LM: its layers, and the split of its backward.

The model is cut into contiguous layer ranges; the first stage also embeds the tokens and the last
also owns the final norm and the LM head (the loss runs in ``_pipeline.py``, through leanbp's
chunked head). Each stage's layers are the engine's streamed Functions, so a stage keeps only its
layers' inputs per micro-batch, as a single-process streamed step does.

``SplitBackwardStage`` is torch's ``PipelineStage`` with one addition: every backward it runs is
announced to the engine as the pass it is (full, input or weight; ``leanbp.engine`` ``_split.py``),
so that a streamed Function computes only what that pass asks for.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage

from ..engine import IGNORE_INDEX, backward_pass, shift_labels
from ..models import adapter_for
from ..streaming import causal_lm_of, stage_hidden, state_of


def split_layers(n_layers: int, stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, as even as they can be (earlier stages take the
    extra layers: the last stage also runs the head)."""
    if stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {stages}")
    if n_layers < stages:
        raise ValueError(f"a pipeline of {stages} stages needs at least {stages} decoder layers; the model has {n_layers}")
    base, extra = divmod(n_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


class StageModule(nn.Module):
    """The part of a streamed causal LM that one stage runs: decoder layers ``layers`` (global
    indices), the embedding when they start at layer 0, the final norm and LM head when they end
    at the last layer (used by the loss, not by ``forward``).

    forward: input_ids (B, T) on the first stage, else the previous stage's output (B, T, H)
    -> the output of the stage's last layer (B, T, H), before the final norm."""

    def __init__(self, model: nn.Module, layers: range):
        super().__init__()
        lm = causal_lm_of(model)
        state = state_of(lm)
        self.streamed = state is not None
        adapter = state.adapter if self.streamed else adapter_for(lm)
        n_layers = len(adapter.layers())
        self.layer_range = layers
        self.first, self.last = layers.start == 0, layers.stop == n_layers
        # registered submodules: the parameters this stage trains (and an optimizer of this stage sees)
        self.layers = nn.ModuleList(adapter.layers()[i] for i in layers)
        self.embed_tokens = adapter.embed_tokens() if self.first else None
        self.norm = adapter.final_norm() if self.last else None
        self.lm_head = adapter.lm_head() if self.last else None
        self.rotary = adapter.backbone().rotary_emb
        # the whole model, not registered: the other stages' parts are not this stage's parameters
        object.__setattr__(self, "model", model)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if not self.streamed:
            return self._plain(x, attention_mask, position_ids)
        rows = dict(input_ids=x) if self.first else dict(inputs_embeds=x)
        # (the last stage's output goes to the chunked head, whose gradient is fresh: the last layer may
        # overwrite it; any other stage's comes from its receive buffer)
        return stage_hidden(self.model, self.layer_range, **rows, attention_mask=attention_mask,
                            position_ids=position_ids, owns_grad_out=self.last)

    def _plain(self, x, attention_mask, position_ids) -> torch.Tensor:
        """The stage's layers as transformers runs them (plain autograd, every activation kept): the
        baseline a streamed stage is measured against. Causal rows only: SDPA's own causal mask."""
        if attention_mask is not None:
            raise NotImplementedError("a stage of an unstreamed model takes no attention_mask (stream the model)")
        hidden = self.embed_tokens(x) if self.first else x  # (B, T, H)
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rope = self.rotary(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=rope)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        return hidden


class SplitBackwardStage(PipelineStage):
    """``PipelineStage`` whose backwards tell the streamed Functions which pass they are (and
    counts them: ``passes``, per pass name)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes: Counter = Counter()

    def backward_maybe_with_nosync(self, backward_type, *args, **kwargs):
        self.passes[backward_type] += 1
        with backward_pass(backward_type):
            return super().backward_maybe_with_nosync(backward_type, *args, **kwargs)


def plain_loss(stage: StageModule, hidden: torch.Tensor, labels: torch.Tensor, denominator) -> torch.Tensor:
    """The last stage's loss of an unstreamed model: full logits of the micro-batch (B, T, V)."""
    logits = stage.lm_head(stage.norm(hidden))
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    targets = shift_labels(labels)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum") / denominator
