"""A streamed causal LM as a pipeline over processes, on ``torch.distributed.pipelining``.

Each process holds one stage (``_stage.py``) and runs one of torch's schedules over the batch's
micro-batches:

* ``1f1b``: one forward, one backward, in steady state (``Schedule1F1B``);
* ``2bp``: the same with every backward split into its input pass, sent upstream at once, and its
  weight pass, deferred to fill the idle slots (2BP; torch's ``ScheduleInterleavedZeroBubble``
  with one stage per process, the zero-bubble paper's ZB-H1). torch splits plain autograd graphs by
  itself; the streamed Functions are told the pass (``leanbp.engine`` ``_split.py``).

Exact: each micro-batch's loss is its labelled rows' summed cross-entropy over the *whole batch's*
label count, and torch does not rescale the gradients, so the micro-batches add up to the batch's
mean loss and its gradient, as one process computes them.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleavedZeroBubble

from ..engine import IGNORE_INDEX, shift_labels
from ..models import adapter_for
from ..streaming import causal_lm_of, stage_loss, state_of
from ._stage import SplitBackwardStage, StageModule, plain_loss, split_layers

SCHEDULES = ("1f1b", "2bp")


class Pipeline:
    """This process's stage of ``model`` in a pipeline over ``group`` (default: the world; stage i
    is the group's rank i), run by ``schedule`` over ``microbatches`` micro-batches per step.
    ``parameters()`` are the stage's: give them to the optimizer. A streamed model's stages run
    streamed layers and leanbp's chunked head; an unstreamed one's run transformers' layers and
    full logits (the baseline; causal rows without a padding mask).

        pipe = leanbp.pipeline.Pipeline(leanbp.stream(model), schedule="1f1b", microbatches=4)
        opt = torch.optim.AdamW(pipe.parameters())
        loss = pipe.step(input_ids, labels)  # every rank passes the same whole batch
        opt.step(); opt.zero_grad()
    """

    def __init__(self, model: nn.Module, *, schedule: str = "1f1b", microbatches: int,
                 group: dist.ProcessGroup | None = None, device: torch.device | str | None = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if microbatches < 1:
            raise ValueError(f"microbatches must be at least 1, got {microbatches}")
        if not dist.is_initialized():
            raise RuntimeError("a pipeline needs torch.distributed initialized (torchrun, or init_process_group)")
        lm = causal_lm_of(model)
        state = state_of(lm)
        if state is not None and not state.config.layers:
            raise ValueError("a pipeline streams the decoder layers: leanbp.stream(model) without layers=False")
        if state is not None and (state.sequence is not None or state.config.offload):
            raise NotImplementedError("a pipeline with sequence parallelism or offload is not supported yet")
        self.group = group
        self.stages = dist.get_world_size(group)
        self.stage_index = dist.get_rank(group)
        adapter = state.adapter if state is not None else adapter_for(lm)
        if self.stages > 1 and adapter.embed_tokens().weight is adapter.lm_head().weight:
            raise NotImplementedError(
                "a pipeline of several stages cannot train tied input and output embeddings (the first stage "
                "owns one, the last the other); build the model with tie_word_embeddings=False")
        self.layers = split_layers(len(adapter.layers()), self.stages)[self.stage_index]
        self.module = StageModule(model, self.layers)
        device = torch.device(device) if device is not None else next(self.module.parameters()).device
        self.model = model
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.stage = SplitBackwardStage(self.module, self.stage_index, self.stages, device, group=group)
        # (torch scales nothing: the loss of a micro-batch is already its share of the batch's mean)
        if schedule == "1f1b":
            self.schedule = Schedule1F1B(self.stage, microbatches, loss_fn=self._loss, scale_grads=False)
        else:
            self.schedule = ScheduleInterleavedZeroBubble([self.stage], microbatches, loss_fn=self._loss,
                                                          scale_grads=False)
        self._denominator: torch.Tensor | None = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.stages - 1

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not self.module.streamed:
            return plain_loss(self.module, hidden, labels, self._denominator)
        # (2BP: the head's weight gradients wait for the weight pass, not as one (V, H) sum per
        # micro-batch in flight)
        return stage_loss(self.model, hidden, labels, self._denominator,
                          defer_param_grads=self.schedule_name == "2bp")

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None, num_items: torch.Tensor | int | None = None) -> torch.Tensor:
        """Forward and backward of the whole batch (every stage passes the same batch); the
        gradients of this stage's parameters are accumulated into their ``.grad``. Returns the
        batch's loss on every stage (one broadcast from the last): the labelled rows' summed
        cross-entropy over ``num_items`` (default: their count, the batch's mean)."""
        B = input_ids.shape[0]
        if B % self.microbatches:
            raise ValueError(f"the batch's {B} rows do not split into {self.microbatches} equal micro-batches")
        if tuple(labels.shape) != tuple(input_ids.shape):
            raise ValueError(f"labels must have shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        device = self.stage.device
        extras = {name: t.to(device) for name, t in (("attention_mask", attention_mask), ("position_ids", position_ids))
                  if t is not None}
        if "position_ids" in extras and extras["position_ids"].shape[0] != B:
            extras["position_ids"] = extras["position_ids"].expand(B, -1)  # (split per micro-batch like the rows)
        # the whole batch's labelled rows: every micro-batch's loss is its share of the batch's mean
        self._denominator = torch.as_tensor((shift_labels(labels) != IGNORE_INDEX).sum() if num_items is None
                                            else num_items).to(device)
        args = (input_ids.to(device),) if self.is_first else ()
        losses: list[torch.Tensor] = []
        keywords = dict(target=labels.to(device), losses=losses) if self.is_last else {}
        if "return_outputs" in inspect.signature(self.schedule.step).parameters:
            keywords["return_outputs"] = False  # (the last stage's outputs are not needed: no (B, T, H) merge)
        self.schedule.step(*args, **keywords, **extras)
        dtype = torch.promote_types(next(self.module.parameters()).dtype, torch.float32)
        loss = torch.stack(losses).detach().sum().to(dtype) if self.is_last else torch.zeros((), dtype=dtype, device=device)
        dist.broadcast(loss, src=dist.get_global_rank(self.group, self.stages - 1) if self.group is not None
                       else self.stages - 1, group=self.group)
        return loss
