"""``leanbp plan``: the peak device memory of a training step, and the longest sequence that fits,
predicted without the device by running the real step on fake tensors (``_planner.py``), with the
presets of common open models and the report as a table, CSV, JSON and plot (``_report.py``)."""

from ._planner import (OPTIMIZER_BYTES_PER_PARAM, PLAN_DTYPES, PRESETS, Lines, Peak, Planner, load_config,
                       training_step)
from ._report import DEFAULT_SEQ_LENS, CudaReserve, PlanRequest, format_plan, run_plan, write_plan

__all__ = ["CudaReserve", "DEFAULT_SEQ_LENS", "Lines", "OPTIMIZER_BYTES_PER_PARAM", "PLAN_DTYPES", "PRESETS", "Peak",
           "PlanRequest", "Planner", "format_plan", "load_config", "run_plan", "training_step", "write_plan"]
