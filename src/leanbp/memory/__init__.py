"""Measuring the peak memory of a training step: ``track`` and its ``MemoryReport`` (live tensor
bytes on CPU and on fake tensors, allocator peaks on CUDA, host memory apart), the phase labels the
engine puts on its work, and memory sizes as people write them. (Predicting a device one does not
have is ``leanbp.plan``.)"""

from ._sizes import GiB, MiB, parse_bytes
from ._tracker import (MemoryReport, count_host_storage, host_allocations, in_phase, new_storages, op_tensors,
                       phase, track)

__all__ = ["GiB", "MemoryReport", "MiB", "count_host_storage", "host_allocations", "in_phase", "new_storages",
           "op_tensors", "parse_bytes", "phase", "track"]
