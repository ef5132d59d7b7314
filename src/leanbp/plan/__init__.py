"""``leanbp plan``: the peak device memory of a training step, the longest sequence that fits and
the time of a step, predicted without the device by running the real step on fake tensors
(``_planner.py``), for one GPU or each rank of several with their engine, optimizer and host memory
(``_setup.py``), on the GPUs of ``_devices.py`` (``_time.py``, from the work ``_work.py`` counts),
with the presets of common open models (``_presets.py``) and the report as a table, CSV, JSON and
plot (``_report.py``)."""

from ._allocator import CachingAllocator, OutOfMemory, Replay, needed_capacity, replay
from ._devices import GPUS, Gpu, measure_cpu, time_calls
from ._measure import RankMemory
from ._planner import PLAN_DTYPES, REPLAY_STEPS, AllocatorFit, Lines, Longest, Peak, Planner, training_step
from ._presets import PRESETS, load_config
from ._report import ALLOCATORS, DEFAULT_SEQ_LENS, CudaReserve, PlanRequest, format_plan, run_plan, write_plan
from ._setup import ENGINES, OPTIMIZERS, RankBytes, Setup, machine_memory
from ._time import StepTime, step_time
from ._work import Work, WorkCounter

__all__ = [
    "ALLOCATORS", "AllocatorFit", "CachingAllocator", "CudaReserve", "DEFAULT_SEQ_LENS", "ENGINES", "format_plan", "Gpu",
    "GPUS", "Lines", "load_config", "Longest", "machine_memory", "measure_cpu", "needed_capacity",
    "OPTIMIZERS", "OutOfMemory", "Peak", "PLAN_DTYPES", "Planner", "PlanRequest", "PRESETS", "RankBytes",
    "RankMemory", "Replay", "replay", "REPLAY_STEPS", "run_plan", "Setup", "step_time", "StepTime",
    "time_calls", "training_step", "Work", "WorkCounter", "write_plan",
]
