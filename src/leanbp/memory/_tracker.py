"""Peak memory of one training step: live tensor bytes on CPU, allocator peaks on CUDA.

On CPU a TorchDispatchMode sees every tensor an op returns; each new storage is counted while it is
alive (a weak reference tells when it dies). Unlike torch's MemTracker this does not care how
often a module is called, so chunked and recomputing engines are measured like any other code.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MiB = 2**20


@dataclass(frozen=True)
class MemoryReport:
    """Bytes. ``activations`` is the step's peak minus parameters and gradients."""

    peak: int
    params: int
    grads: int

    @property
    def activations(self) -> int:
        return self.peak - self.params - self.grads

    def as_mib(self) -> dict[str, float]:
        return {k: v / MiB for k, v in
                {"peak": self.peak, "params": self.params, "grads": self.grads,
                 "activations": self.activations}.items()}


class _LiveStorageBytes(TorchDispatchMode):
    """Counts bytes of storages created inside the mode while they are alive."""

    def __init__(self, baseline: int, existing=()):
        super().__init__()
        self.live = baseline
        self.peak = baseline
        self._seen: "weakref.WeakSet" = weakref.WeakSet()
        for t in existing:  # already counted in the baseline
            self._seen.add(t.untyped_storage())

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result shares an input's storage: nothing new was allocated (this
        # matters for views of tensors that existed before tracking began, e.g. weight.t())
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage not in self._seen and (storage.data_ptr() not in inputs or storage.nbytes() == 0):
                    self._seen.add(storage)
                    nbytes = storage.nbytes()
                    self.live += nbytes
                    weakref.finalize(storage, self._freed, nbytes)
        if self.live > self.peak:
            self.peak = self.live
        return out


def _tensor_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class track:
    """Measure the peak memory of the code in the ``with`` block.

    >>> with leanbp.memory.track(model) as mem:
    ...     model(**batch).loss.backward()
    >>> mem.report.activations
    """

    def __init__(self, model: nn.Module, device: torch.device | str | None = None):
        self.model = model
        if device is None:  # a module without parameters is measured on the CPU
            first = next(model.parameters(), None)
            device = first.device if first is not None else "cpu"
        self.device = torch.device(device)
        self.report: MemoryReport | None = None

    def _params(self):
        return list(self.model.parameters())

    def _grads(self):
        return [p.grad for p in self._params() if p.grad is not None]

    def _watch_grads(self) -> None:
        """Gradients freed before the block ends (zero_grad inside it) still count as gradients:
        each parameter's largest gradient seen, not the ones left at exit."""
        self._grad_bytes = {id(p): p.grad.untyped_storage().nbytes() for p in self._params() if p.grad is not None}

        def seen(p):
            self._grad_bytes[id(p)] = max(self._grad_bytes.get(id(p), 0), p.grad.untyped_storage().nbytes())

        self._hooks = [p.register_post_accumulate_grad_hook(seen) for p in self._params() if p.requires_grad]

    def __enter__(self):
        params = _tensor_bytes(self._params())
        grads_before = _tensor_bytes(self._grads())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._mode = None
        else:
            self._mode = _LiveStorageBytes(params + grads_before, self._params() + self._grads())
            self._mode.__enter__()
        self._params_bytes = params
        self._watch_grads()
        return self

    def __exit__(self, *exc):
        if self._mode is not None:
            self._mode.__exit__(*exc)
            peak = self._mode.peak
        else:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        for hook in self._hooks:
            hook.remove()
        at_exit = {id(p): p.grad.untyped_storage().nbytes() for p in self._params() if p.grad is not None}
        grads = sum(max(self._grad_bytes.get(k, 0), at_exit.get(k, 0)) for k in set(self._grad_bytes) | set(at_exit))
        self.report = MemoryReport(peak=peak, params=self._params_bytes, grads=grads)
        return False
