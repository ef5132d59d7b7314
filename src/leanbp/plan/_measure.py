"""Everything a real step holds in this process, for checking the planner's per-rank accounting on
the CPU: weights, gradients, optimizer state and the engines' buffers as well as activations.

``leanbp.memory.track`` measures a step against the parameters and gradients it finds when it
starts, which is what the one-process plan predicts; an engine's rank also holds what the engine
and the optimizer made before the step (DDP's buckets, FSDP2's shards, DeepSpeed's partitions
and buckets, the moments). ``RankMemory`` is entered before the model is built, so every storage
an op creates from then on is counted while it lives, and FSDP2's storage resizes (it frees and
re-allocates a parameter's unsharded storage in place, ``alloc_storage`` / ``free_storage``,
which no op reports) are followed too. ``window()`` gives the peak of the code inside it.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..memory import new_storages

__all__ = ["RankMemory"]


class RankMemory(TorchDispatchMode):
    """Bytes of the storages created inside it, while they live, at their current size."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._size: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._patched = []

    # -- storages --------------------------------------------------------------------------------
    def _died(self, key) -> None:
        with self._lock:
            self.live -= self._final.pop(key, 0)

    def _adopt(self, storage) -> None:
        if storage in self._size:
            return
        nbytes = storage.nbytes()
        self._size[storage] = nbytes
        key = id(storage)
        self._final[key] = nbytes
        weakref.finalize(storage, self._died, key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _resized(self, storage) -> None:
        if storage not in self._size:
            return
        key, now = id(storage), storage.nbytes()
        with self._lock:
            self.live += now - self._final[key]
            self._final[key] = now
            self._size[storage] = now
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for storage in new_storages(out, args, kwargs, self._size):
            self._adopt(storage)
        return out

    # -- FSDP2 frees and re-allocates unsharded parameters by resizing their storage -------------
    def _patch_fsdp2(self) -> None:
        try:
            from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
        except ImportError:  # (no torch.distributed)
            return
        alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

        def alloc_storage(tensor):
            alloc(tensor)
            self._resized(tensor.untyped_storage())

        def free_storage(tensor):
            free(tensor)
            self._resized(tensor.untyped_storage())

        for module in (_fsdp_param, _fsdp_param_group):
            for name, fn in (("alloc_storage", alloc_storage), ("free_storage", free_storage)):
                if hasattr(module, name):
                    self._patched.append((module, name, getattr(module, name)))
                    setattr(module, name, fn)

    def __enter__(self):
        self._final = {}
        self._patch_fsdp2()
        return super().__enter__()

    def __exit__(self, *exc):
        for module, name, fn in reversed(self._patched):
            setattr(module, name, fn)
        self._patched.clear()
        return super().__exit__(*exc)

    @contextmanager
    def window(self):
        """The peak of the code inside (``.peak`` of the yielded object) over what lives when it
        starts (``.start``)."""
        class Window:
            pass

        w = Window()
        w.start = self.live
        self.peak = self.live
        yield w
        w.peak = self.peak
        w.end = self.live
