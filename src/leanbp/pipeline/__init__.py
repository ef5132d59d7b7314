"""Pipeline parallelism for streamed models on ``torch.distributed.pipelining``: 1F1B and 2BP
(split backward), with streamed layers inside every stage.

    _stage.py      a stage's layers (StageModule) and the stage that announces its backward passes
    _pipeline.py   Pipeline: one process's stage, its schedule, an exact step over micro-batches
    _idle.py       a schedule's idle fraction, simulated from torch's order of its actions
"""

from ._idle import Costs, Timeline, idle_fraction, one_f_one_b_order, simulate, zero_bubble_order
from ._pipeline import SCHEDULES, Pipeline
from ._stage import SplitBackwardStage, StageModule, split_layers

__all__ = ["Costs", "Pipeline", "SCHEDULES", "SplitBackwardStage", "StageModule", "Timeline", "idle_fraction",
           "one_f_one_b_order", "simulate", "split_layers", "zero_bubble_order"]
