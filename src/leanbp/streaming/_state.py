"""What a streamed model carries: its ``StreamConfig``, its family adapter, and what it reports."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field

from torch import nn

from ..engine import SequenceGroup
from ..models import FamilyAdapter
from ._config import StreamConfig, StreamWarning

ATTRIBUTE = "_leanbp_stream"  # the instance attribute of the causal LM and its backbone


@dataclass
class StreamState:
    config: StreamConfig
    adapter: FamilyAdapter
    warned: set = field(default_factory=set)
    # the rows per chunk of the last call that streamed its layers: a report for the user
    # (``chunk_size_used``); each call takes what it chose from the engine's return value
    last_chunk_rows: int | None = None
    # sequence parallelism: the processes that share each sequence (None: this process holds it whole)
    sequence: SequenceGroup | None = None
    # under sequence parallelism, calls that pass whole sequences (a trainer that knows nothing of
    # the split: ``stream_trainer(trainer, sequence_parallel=...)``): leanbp takes this rank's rows
    # and returns the whole sequence's loss and per-token results on every rank; each rank's share
    # of the gradient is multiplied by P, as the engines under a trainer average the ranks' gradients
    whole_sequences: bool = False
    # a trainer whose data loader hands each rank its slice of every sequence, labels shifted before
    # slicing (DeepSpeed's Ulysses loader, under accelerate's ParallelismConfig(sp_size=P)): training
    # calls stream over DeepSpeed's group (``sequence``, found at the first one: accelerate makes it in
    # ``prepare``) and return the slice's loss and per-token results, which the trainer weighs and
    # sums itself; evaluation calls get whole sequences (DeepSpeed's default) and run without the group
    presliced: bool = False

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, StreamWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The stacklevel of the first frame outside leanbp and torch.nn (the user's call)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("leanbp.", "torch.nn.")):
        frame, level = frame.f_back, level + 1
    return level


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside PEFT, DDP, DeepSpeed or accelerate wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):  # PEFT
            model = model.get_base_model()
        elif not hasattr(getattr(model, "config", None), "model_type") and isinstance(
                getattr(model, "module", None), nn.Module):  # DDP, DeepSpeedEngine (its .config is its own)
            model = model.module
    return model


def state_of(module: nn.Module) -> StreamState | None:
    """The stream state installed on ``module`` itself (None: not streamed)."""
    return vars(module).get(ATTRIBUTE)
