"""Pipeline parallelism for streamed models on ``torch.distributed.pipelining``: 1F1B and 2BP
(split backward), with streamed layers inside every stage.

    _stage.py      a stage's layers (StageModule) and the stage that announces its backward passes
    _pipeline.py   Pipeline: one process's stage, its schedule, an exact step over micro-batches
"""

from ._pipeline import SCHEDULES, Pipeline
from ._stage import SplitBackwardStage, StageModule, split_layers

__all__ = ["Pipeline", "SCHEDULES", "SplitBackwardStage", "StageModule", "split_layers"]
