"""Peak memory of one training step: live tensor bytes on CPU, allocator peaks on CUDA.

On CPU a TorchDispatchMode sees every tensor an op returns; each new storage is counted while it is
alive (a weak reference tells when it dies). Unlike torch's MemTracker this does not care how
often a module is called, so chunked and recomputing engines are measured like any other code.
The same mode counts a step run on fake tensors (``FakeTensorMode``, no values, no memory), which is
how ``leanbp plan`` predicts a device it does not have.

Host memory (the layer boundaries a streamed model with ``offload=True`` keeps off the device) is
counted apart: storages made inside ``host_allocations()`` go to the host count, also on CPU where
"device" and "host" are the same RAM, so the device side can be compared with and without offload.
"""

from __future__ import annotations

import functools
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ._sizes import MiB


class _HostBytes:
    """Bytes of host-store storages alive now and their peak since the last reset. Process-wide:
    a CUDA backward runs on autograd's device thread, not the thread that entered ``track``."""

    def __init__(self):
        self.inside = 0  # > 0 inside host_allocations()
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def freed(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes


_HOST = _HostBytes()


_PHASES: list[str] = []


@contextmanager
def phase(name: str):
    """Label the memory peak of the code inside (``MemoryReport.phase_peaks``): the engine marks its
    layer forward, layer backward and head, so that ``leanbp plan`` can follow each phase's peak
    along T (the step's peak is their maximum). Unlabelled code is "forward" or "backward"."""
    _PHASES.append(name)
    try:
        yield
    finally:
        _PHASES.pop()


def in_phase(name: str):
    """Decorator: the function runs inside ``phase(name)`` (for autograd Functions' forward/backward)."""
    def wrap(fn):
        @functools.wraps(fn)
        def labelled(*args, **kwargs):
            with phase(name):
                return fn(*args, **kwargs)
        return labelled
    return wrap


def current_phase() -> str:
    if _PHASES:
        return _PHASES[-1]
    return "backward" if torch._C._current_autograd_node() is not None else "forward"


@contextmanager
def host_allocations():
    """Storages made inside are host memory (a host store's copies): the tracker leaves them to
    the store, which counts them with ``count_host_storage``."""
    _HOST.inside += 1
    try:
        yield
    finally:
        _HOST.inside -= 1


def count_host_storage(t: torch.Tensor) -> None:
    """Count ``t``'s storage as host memory until it dies (host stores call it for what they
    allocate, on every device)."""
    storage = t.untyped_storage()
    _HOST.add(storage.nbytes())
    weakref.finalize(storage, _HOST.freed, storage.nbytes())


@dataclass(frozen=True)
class MemoryReport:
    """Bytes. ``activations`` is the step's peak minus parameters and gradients (device side);
    ``host`` is the peak of host memory held for the step (``stream(offload=True)``: the layer boundaries)."""

    peak: int
    params: int
    grads: int
    host: int = 0
    # the peak while each phase ran (CPU and fake-tensor runs; see ``phase``)
    phase_peaks: dict = field(default_factory=dict, compare=False)
    # the gradients alive at each phase's peak (part of it): all of them when they were resident
    # before the block, fewer when the block made them (a loop that frees them between steps)
    phase_grads: dict = field(default_factory=dict, compare=False)

    @property
    def activations(self) -> int:
        return self.peak - self.params - self.grads

    def as_mib(self) -> dict[str, float]:
        return {k: v / MiB for k, v in
                {"peak": self.peak, "params": self.params, "grads": self.grads,
                 "activations": self.activations, "host": self.host}.items()}


class _LiveStorageBytes(TorchDispatchMode):
    """Counts bytes of storages created inside the mode while they are alive."""

    def __init__(self, baseline: int, existing=(), grads: int = 0, trace: list | None = None):
        super().__init__()
        self._made = 0  # storages made so far (a storage's key in the trace)
        self.trace = trace  # (key, +bytes) when a storage is made, (key, -bytes) when it dies (see ``track``)
        self.live = baseline
        self.peak = baseline
        self.phase_peaks: dict[str, int] = {}  # the peak while each phase ran (see ``phase``)
        self.grads = grads  # gradient bytes alive now (``track`` adds each new gradient)
        self.phase_grads: dict[str, int] = {}  # ``grads`` at each phase's peak
        self._seen: "weakref.WeakSet" = weakref.WeakSet()
        for t in existing:  # already counted in the baseline
            self._seen.add(t.untyped_storage())

    def _freed(self, nbytes: int, key: int) -> None:
        self.live -= nbytes
        if self.trace is not None:
            self.trace.append((key, -nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # (a view of a tensor that existed before tracking began, e.g. weight.t(), allocates nothing)
        for storage in new_storages(out, args, kwargs, self._seen):
            self._seen.add(storage)
            if not _HOST.inside:  # (host memory is counted by its store)
                nbytes = storage.nbytes()
                self.live += nbytes
                key = self._made = self._made + 1
                if self.trace is not None:
                    self.trace.append((key, nbytes))
                weakref.finalize(storage, self._freed, nbytes, key)
        if self.live > self.peak:
            self.peak = self.live
        name = current_phase()
        if self.live > self.phase_peaks.get(name, 0):
            self.phase_peaks[name] = self.live
            self.phase_grads[name] = self.grads
        return out


def op_tensors(value, meta: bool = False):
    """The tensors of an op's arguments or result (meta tensors only when ``meta``): a tensor, or
    tensors in (nested) lists, tuples and dicts (what aten ops take and return; cheaper than a
    pytree walk on every op)."""
    if isinstance(value, torch.Tensor):
        if meta or value.device.type != "meta":
            yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from op_tensors(v, meta)
    elif isinstance(value, dict):
        for v in value.values():
            yield from op_tensors(v, meta)


def new_storages(out, args, kwargs, known):
    """The storages of an op's result that the op allocated: not in ``known``, and not an input's
    (a view or an in-place result shares it; an input's empty storage that the op grew, as
    ``resize_`` does, counts as new). Storages are told apart by their implementation (_cdata):
    fake ones all have address 0. A caller that adds each yielded storage to ``known`` sees a
    storage twice in one result once."""
    inputs = None
    for t in op_tensors(out):
        storage = t.untyped_storage()
        if storage in known:
            continue
        if inputs is None:  # (read only when the result has a storage not known yet)
            inputs = {x.untyped_storage()._cdata for x in op_tensors(args)} | \
                {x.untyped_storage()._cdata for x in op_tensors(kwargs or {})}
        if storage._cdata in inputs and storage.nbytes():
            continue
        yield storage


def _tensor_bytes(tensors) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}  # (fake: all at 0)
    return sum(storages.values())


class track:
    """Measure the peak memory of the code in the ``with`` block.

    >>> with leanbp.memory.track(model) as mem:
    ...     model(**batch).loss.backward()
    >>> mem.report.activations

    ``trace``: a list that gets each storage the block makes and frees, in order, as (key, bytes) and
    (key, -bytes) (CPU and fake tensors; ``leanbp.plan``'s allocator model replays it). A storage
    that outlives the block has no free in it.
    """

    def __init__(self, model: nn.Module, device: torch.device | str | None = None, trace: list | None = None):
        self.model = model
        self.trace = trace
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
            before, now = self._grad_bytes.get(id(p), 0), p.grad.untyped_storage().nbytes()
            if self._mode is not None and now > before:  # (a gradient made inside the block)
                self._mode.grads += now - before
            self._grad_bytes[id(p)] = max(before, now)

        self._hooks = [p.register_post_accumulate_grad_hook(seen) for p in self._params() if p.requires_grad]

    def __enter__(self):
        params = _tensor_bytes(self._params())
        grads_before = _tensor_bytes(self._grads())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._mode = None
        else:
            self._mode = _LiveStorageBytes(params + grads_before, self._params() + self._grads(), grads_before,
                                           self.trace)
            self._mode.__enter__()
        self._params_bytes = params
        self._host_start = _HOST.peak = _HOST.live  # (what a host store held before: not this block's)
        self._watch_grads()
        return self

    def __exit__(self, *exc):
        phase_peaks, phase_grads = {}, {}
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode.trace = None  # (what dies after the block is not the block's)
            peak, phase_peaks, phase_grads = self._mode.peak, self._mode.phase_peaks, self._mode.phase_grads
        else:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        for hook in self._hooks:
            hook.remove()
        at_exit = {id(p): p.grad.untyped_storage().nbytes() for p in self._params() if p.grad is not None}
        grads = sum(max(self._grad_bytes.get(k, 0), at_exit.get(k, 0)) for k in set(self._grad_bytes) | set(at_exit))
        self.report = MemoryReport(peak=peak, params=self._params_bytes, grads=grads,
                                   host=_HOST.peak - self._host_start, phase_peaks=phase_peaks,
                                   phase_grads=phase_grads)
        return False
