"""Measuring peak memory of a training step (``track``) and reporting it (``MemoryReport``)."""

from ._tracker import MemoryReport, track

__all__ = ["MemoryReport", "track"]
