"""Measuring peak memory of a training step (``track``, ``MemoryReport``) and predicting it for a
device one does not have (``Planner``, behind ``leanbp plan``)."""

from ._planner import PRESETS, Planner, training_step
from ._tracker import MemoryReport, count_host_storage, host_allocations, in_phase, phase, track

__all__ = ["MemoryReport", "PRESETS", "Planner", "count_host_storage", "host_allocations", "in_phase", "phase", "track",
           "training_step"]
