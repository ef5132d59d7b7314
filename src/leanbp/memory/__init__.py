"""Measuring peak memory of a training step (``track``, ``MemoryReport``) and predicting it for a
device one does not have (``Planner``, ``leanbp plan``)."""

from ._tracker import MemoryReport, count_host_storage, host_allocations, in_phase, phase, track

__all__ = ["MemoryReport", "count_host_storage", "host_allocations", "in_phase", "phase", "track"]
