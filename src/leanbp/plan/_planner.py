"""``leanbp plan``: the peak device memory of a training step, and the longest sequence that fits,
predicted without the device, for one GPU or for each rank of several, with the time of the step.

Every number comes from running the real training step (``model(input_ids, labels=...)`` and
``loss.backward()``, through transformers, its gradient checkpointing, or ``leanbp.stream``) on fake
tensors (``FakeTensorMode``: shapes and dtypes, no values, no memory), measured by the same live-bytes
tracker as ``leanbp.memory.track`` and counted by a ``WorkCounter`` (``_work.py``: the FLOPs of its
products and attention, the bytes of its other ops). So the plan follows the code: change the
engine and the plan changes with it. Two regularities of a decoder stack make it fast (both checked
in ``tests/plan/test_plan.py``, the length one on every run):

* Depth: a stack of identical layers adds the same bytes per layer (its weights, gradients and what
  each method keeps per layer), so the step is run at two small depths (2 and 3 layers, or 2 and 3
  repeats of a pattern of layers followed by the model's remainder of it: the first layer can
  differ, e.g. when a frozen embedding gives it an input without gradient) and the peak, weights,
  gradients, host bytes and work are extended to the model's depth along that line.
* Length: at a fixed chunk size every buffer a step keeps grows linearly in T, so the peak of each
  phase of the step (the engine labels its layer forward, layer backward, head and final norm;
  the rest is "forward" or "backward", see ``memory.phase``) is affine in T, and the step's peak is
  the largest of them. Probes double T until three in a row put every phase on one line (to the
  byte); the lines give the peak at every T beyond, and which phase holds it. The work is a
  polynomial of degree two in T (attention) through the same three probes. The longest T under
  the budget is checked by a fake step at that T when that step is affordable (``verify_limit``
  layer chunks).

A rank of a data-parallel engine runs the same step on its own batch: its activations are the
fake step's, its weights, gradients, optimizer state and the engine's buffers are its share
(``_setup.py``, with the engines' and optimizers' sources), added to each phase's line as the
constants they are. The host holds what offload and a host optimizer keep there; the longest T
honours the device budget and the host budget (all ranks of the machine together).

What the lines do not model: allocator fragmentation and caching, the CUDA context, kernel
workspaces (cuBLAS, flash attention) and NCCL's own buffers; ``leanbp plan --reserve`` holds them
back from the budget. ``allocator`` and ``longest_allocated`` model the first: two steps of a fake
step at full depth played through the model of PyTorch's caching allocator (``_allocator.py``).
The attention kernels are the CPU ones (SDPA's flash kernel for transformers, leanbp's two-block
(out, lse) attention), which keep what the CUDA flash kernels keep.
"""

from __future__ import annotations

import copy
import functools
import math
from contextlib import contextmanager
from dataclasses import InitVar, dataclass, field, replace

import torch

from .._dtypes import QUANTIZE, dtype_named
from ..engine import SequenceGroup, has_values
from ..memory import MemoryReport, track
from ..streaming import PLANNED, StreamConfig, apply_method, old_chunk_sizes
from ..streaming import method as method_named
from ._allocator import needed_capacity, replay
from ._nf4 import planned_nf4
from ._presets import PRESETS, load_config  # noqa: F401  (re-exported: leanbp.plan.PRESETS)
from ._setup import RankBytes, Setup, parameter_tensors, rank_bytes
from ._time import StepTime, step_time
from ._work import Work, WorkCounter, quadratic_through

# the dtypes of the weights and gradients a plan is made for
PLAN_DTYPES = ("bf16", "fp16", "fp32")

OPTIMIZER_STEP = "optimizer step"  # the phase of the optimizer's own step (after backward)
SEQUENCE_METHODS = ("leanbp", "leanbp_offload")  # the planned methods that split a sequence (sp > 1)
# steps of a run the allocator's model plays: the second starts with what the first left cached
REPLAY_STEPS = 2


@dataclass(frozen=True)
class PlannedSequenceGroup(SequenceGroup):
    """Rank 0 of a sequence-parallel group of ``size`` ranks, for a fake step: each collective
    allocates its result as the real one does and moves nothing (fake tensors have no values);
    ``sent`` counts the bytes the rank would send in its all-to-alls."""

    group: object = None
    rank: int = 0
    size: int = 1
    sent: list = field(default_factory=lambda: [0], compare=False)

    def check_same_rows(self, batch: int, rows: int) -> None:
        pass  # (every rank of a plan holds the same rows)

    def all_gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        local = local.contiguous()
        return torch.cat([torch.empty_like(local) for _ in range(self.size)], dim=1)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t  # (in place)

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        send = send.contiguous()
        self.sent[0] += send.numel() * send.element_size()
        return torch.empty_like(send)


@dataclass(frozen=True)
class Peak:
    """Bytes of one rank's step at one T. ``optimizer`` is 0 for backprop only; ``buffers``: the
    engine's (DDP's buckets, ZeRO's bucket and gathered parameters, FSDP2's unsharded layers in the
    phase that holds the peak); ``host``: what offload and a host optimizer keep in host memory for
    this rank (not part of ``total``); ``time``: the step-time model at this T."""

    method: str
    seq_len: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    host: int = 0
    probed: bool = False  # a fake step at this T (else read from the phases' lines)
    phase: str = ""  # the phase of the step that holds the peak
    buffers: int = 0
    time: StepTime | None = None

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.buffers + self.activations


@dataclass(frozen=True)
class Longest:
    """The longest T of a method under both budgets: ``seq_len``; ``checked``: a fake step at that T
    confirmed it; ``bound``: "device" or "host", the budget that stops it (``device_seq_len`` and
    ``host_seq_len``: each budget's own longest T; None: that budget bounds nothing)."""

    seq_len: int
    checked: bool
    bound: str
    device_seq_len: int
    host_seq_len: int | None


@dataclass(frozen=True)
class AllocatorFit:
    """A step at T played through the model of PyTorch's CUDA caching allocator (``_allocator.py``,
    ``Planner.replay_steps`` steps, with the rank's resident bytes and the optimizer's state): the
    peak of allocated bytes (the tensors, each rounded as the allocator rounds it), ``needed``, the
    device memory the steps run in as a bisection finds it, and ``reserved``, what the allocator
    holds at its peak when nothing limits it (``torch.cuda.max_memory_reserved`` of such a run).
    Bytes. (Whether the steps run in a given memory is ``Planner.fits``: the allocator is not
    monotone in the memory, a run can fit in c bytes and not in c + 2 MiB.)"""

    seq_len: int
    allocated: int
    needed: int
    reserved: int

    @property
    def fragmentation(self) -> int:
        """What the allocator needs beyond the tensors: segments cached or split when the next
        request comes."""
        return self.needed - self.allocated


def _affine(points: list[tuple[int, int]]) -> tuple[float, float] | None:
    """(intercept, slope) when the (T, bytes) points lie on one line, to the byte; else None."""
    (t0, y0), (t1, y1) = points[0], points[-1]
    slope = (y1 - y0) / (t1 - t0)
    if any(abs(y - (y0 + slope * (t - t0))) > 0.5 for t, y in points):
        return None
    return y0 - slope * t0, slope


@dataclass(frozen=True)
class Lines:
    """Each phase's peak as intercept + slope * T (bytes, weights and gradients included), for
    T >= ``valid_from``; the step's peak is their maximum. The host store's peak likewise."""

    phases: dict  # phase name -> (intercept, slope)
    host: tuple[float, float]
    valid_from: int
    # phase name -> (intercept, slope) of the gradient bytes alive at that phase's peak (part of it)
    grads: dict = field(default_factory=dict)

    def at(self, T: int) -> tuple[int, int, str]:
        """(peak bytes, host bytes, the phase that holds the peak) at T."""
        name, (a, b) = max(self.phases.items(), key=lambda kv: kv[1][0] + kv[1][1] * T)
        return round(a + b * T), round(self.host[0] + self.host[1] * T), name

    def longest(self, budget: float) -> int:
        """The largest T with every phase's line within ``budget`` (0 when none; the phase lines that
        do not grow bound nothing but must fit)."""
        T = float("inf")
        for a, b in self.phases.values():
            if b > 0:
                T = min(T, (budget - a) / b)
            elif a > budget:
                return 0
        if T == float("inf"):
            raise RuntimeError("no phase of the step grows with T; the sequence length is not bounded by memory")
        return max(0, int(T))

    def host_longest(self, budget: float) -> int | None:
        """The largest T whose host bytes fit ``budget`` (None: the host line does not grow)."""
        a, b = self.host
        if b <= 0:
            return None if a <= budget else 0
        return max(0, int((budget - a) / b))

    def shifted(self, extra: dict, host: float = 0.0) -> "Lines":
        """These lines with constant bytes added: ``extra[phase]`` to a phase (a phase missing from
        the lines is a constant line of its own), ``host`` to the host line."""
        phases = {name: (a + extra.get(name, 0), b) for name, (a, b) in self.phases.items()}
        for name, value in extra.items():
            phases.setdefault(name, (value, 0.0))
        return Lines(phases, (self.host[0] + host, self.host[1]), self.valid_from, self.grads)


@dataclass
class Planner:
    """Fake training steps of one model configuration (see the module docstring).

    dtype: parameters and gradients (``PLAN_DTYPES``); batch: sequences per step (per rank);
    stream: leanbp's settings (a fixed chunk size: with "auto" the chunk grows with T and the phases'
    peaks are not lines); hold_outputs: the loop keeps the model's outputs until backward (see
    ``training_step``); free_grads: the loop frees the gradients between steps (``zero_grad()``,
    whose ``set_to_none=True`` is PyTorch's default and transformers' ``Trainer``'s), so a step
    starts without them and its backward makes them; else they stay resident through the step, as
    in the micro-steps of gradient accumulation after the first (one engine, or DDP: the sharded
    engines keep their gradient shares through the step); lora_rank: train LoRA adapters of this rank on every linear layer but the
    head (PEFT's "all-linear"), the base frozen; quantize: "nf4" keeps that base in bitsandbytes' 4-bit
    NormalFloat with double quantization, computing in ``dtype`` (QLoRA; needs lora_rank); setup: the
    GPUs, engine, optimizer and host memory
    (``Setup``; default one GPU, AdamW); replay_steps: steps of a run the caching allocator's model
    plays (``allocator``); verify_limit: a fake step to check the longest T is run when
    it has at most this many layer chunks."""

    config: object
    dtype: str = "bf16"
    batch: int = 1
    stream: StreamConfig = field(default_factory=StreamConfig)
    hold_outputs: bool = True
    free_grads: bool = False
    lora_rank: int | None = None
    quantize: str = "none"  # leanbp._dtypes.QUANTIZE (nf4: the stand-in layers of ``_nf4``)
    verify_limit: int = 64
    setup: Setup = field(default_factory=Setup)
    replay_steps: int = REPLAY_STEPS  # steps the allocator's model plays (``allocator``)
    _models: dict = field(default_factory=dict, repr=False)
    _lines: dict = field(default_factory=dict, repr=False)
    _probes: dict = field(default_factory=dict, repr=False)  # method -> the T of its lines' last three probes
    _steps: dict = field(default_factory=dict, repr=False)  # (method, T) -> the fake step's report
    _work: dict = field(default_factory=dict, repr=False)  # (method, T) -> the fake step's work
    _trainable: int | None = field(default=None, repr=False)
    _rank: RankBytes | None = field(default=None, repr=False)
    _fits: dict = field(default_factory=dict, repr=False)  # (method, T, optimizer, steps) -> AllocatorFit
    _traces: dict = field(default_factory=dict, repr=False)  # the same key -> its replay at any capacity (the last one)
    _mode: object = field(default=None, repr=False)
    # deprecated: the chunk sizes before ``stream`` carried them
    chunk_size: InitVar[int | None] = None
    head_chunk_size: InitVar[int | None] = None

    def __post_init__(self, chunk_size, head_chunk_size):
        self.stream = old_chunk_sizes(self, self.stream, chunk_size, head_chunk_size)
        dtype_named(self.dtype, PLAN_DTYPES)
        for name in ("batch", "lora_rank"):
            value = getattr(self, name)
            if name == "lora_rank" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.stream.chunk_size, int):
            raise ValueError(f"leanbp plan needs a fixed chunk size (rows), got {self.stream.chunk_size!r}: with "
                             '"auto" the chunk grows with T, which the plan\'s lines in T do not follow')
        if not isinstance(self.setup, Setup):
            raise ValueError(f"setup must be a leanbp.plan.Setup, got {type(self.setup).__name__}")
        _check_free_grads(self.free_grads, self.setup)
        _check_quantize(self.quantize, self.lora_rank, self.setup)
        from torch._subclasses.fake_tensor import FakeTensorMode

        self._mode = FakeTensorMode()
        self.layers = self.config.num_hidden_layers
        # two depths whose difference is one repeat of the layer pattern, each followed by the
        # model's own remainder of it (or the whole model when its layers are not alike, or when it
        # is that shallow). Not from one repeat: the first layer differs from the others when its
        # input needs no gradient (a frozen embedding, LoRA)
        period = _layer_period(self.config)
        rest = self.layers % period if period else 0
        self.depths = (2 * period + rest, 3 * period + rest) if period and 3 * period + rest < self.layers \
            else (self.layers,)

    # -- one fake step ---------------------------------------------------------------------------
    def _model(self, depth: int):
        if depth not in self._models:
            import transformers

            config = copy.deepcopy(self.config)
            config.num_hidden_layers = depth
            if getattr(config, "layer_types", None) is not None:
                config.layer_types = list(config.layer_types)[:depth]
            config.max_position_embeddings = max(getattr(config, "max_position_embeddings", 0) or 0, 1 << 24)
            config._attn_implementation = "sdpa"
            config.use_cache = False
            with self._mode, torch.device("cpu"):
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype_named(self.dtype)).train()
                if self.quantize == "nf4":
                    model = planned_nf4(model, dtype_named(self.dtype))
                if self.lora_rank:
                    model = _fake_lora(model, self.lora_rank)
            self._models[depth] = model
        model = self._models[depth]
        with self._mode:  # the gradients a step starts with: resident (zeroed) or none (see free_grads)
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = None if self.free_grads else p.grad if p.grad is not None else torch.zeros_like(p)
        return model

    def _step_at_depth(self, method: str, T: int, depth: int, trace: list | None = None
                       ) -> tuple[MemoryReport, Work]:
        # (with sp > 1: rank 0 of the group, holding the first T/P rows)
        group = PlannedSequenceGroup(size=self.setup.sp) if self.setup.sp > 1 else None
        model = apply_method(self._model(depth), method, self.stream, sequence_parallel=group)
        with self._mode, _one_document_per_row():
            ids = torch.zeros(self.batch, T // self.setup.sp, dtype=torch.long)
            with track(model, trace=trace) as mem, WorkCounter() as counter:
                training_step(model, ids, self.hold_outputs)
        return mem.report, counter.work if group is None else replace(counter.work, exchange=float(group.sent[0]))

    def step(self, method: str, T: int) -> MemoryReport:
        """The one-process step's memory at the model's depth (extended along the depth line when
        probed shallower); each (method, T) is run once."""
        if method not in PLANNED:
            raise ValueError(f"leanbp plan predicts the methods {list(PLANNED)}, not {method!r}")
        if self.setup.sp > 1 and method not in SEQUENCE_METHODS:
            raise ValueError(f"{method} does not split a sequence over GPUs: with sp > 1 the plan is leanbp's "
                             f"({', '.join(SEQUENCE_METHODS)})")
        if T % self.setup.sp:
            raise ValueError(f"T={T} does not split over sp={self.setup.sp} ranks: plan a multiple of it")
        if (method, T) not in self._steps:
            self._steps[(method, T)], self._work[(method, T)] = self._step_at_full_depth(method, T)
        return self._steps[(method, T)]

    def _step_at_full_depth(self, method: str, T: int) -> tuple[MemoryReport, Work]:
        runs = [self._step_at_depth(method, T, d) for d in self.depths]
        if len(runs) == 1:
            return runs[0]
        (d1, (r1, w1)), (d2, (r2, w2)) = zip(self.depths, runs)
        k = (self.layers - d1) / (d2 - d1)
        grow = lambda a, b: round(a + k * (b - a))  # noqa: E731
        if r1.phase_peaks.keys() != r2.phase_peaks.keys():
            raise RuntimeError(f"{method}: the phases of a {d1}- and a {d2}-layer step differ; plan at full depth")
        phases = {name: grow(r1.phase_peaks[name], r2.phase_peaks[name]) for name in r1.phase_peaks}
        made = {name: grow(r1.phase_grads.get(name, 0), r2.phase_grads.get(name, 0)) for name in phases}
        report = MemoryReport(peak=max(phases.values()), params=grow(r1.params, r2.params),
                              grads=grow(r1.grads, r2.grads), host=grow(r1.host, r2.host), phase_peaks=phases,
                              phase_grads=made)
        return report, w1 + (w2 - w1) * k

    def trainable_params(self) -> int:
        """Trainable parameters of the full-depth model (all, or the LoRA adapters), from the depth line
        (counted once: every optimizer-step peak needs it)."""
        if self._trainable is None:
            counts = [sum(p.numel() for p in self._model(d).parameters() if p.requires_grad) for d in self.depths]
            if len(counts) == 1:
                self._trainable = counts[0]
            else:
                (d1, d2), (c1, c2) = self.depths, counts
                self._trainable = c1 + (self.layers - d1) * (c2 - c1) // (d2 - d1)
        return self._trainable

    def rank(self) -> RankBytes:
        """One rank's weights, gradients, optimizer state, engine buffers and host bytes at the model's
        depth (``_setup.rank_bytes`` of the fake model's parameters, along the depth line)."""
        if self._rank is None:
            shares = [rank_bytes(parameter_tensors(self._model(d)), self.setup) for d in self.depths]
            if len(shares) == 1:
                self._rank = shares[0]
            else:
                (d1, d2) = self.depths
                self._rank = RankBytes.extend(*shares, (self.layers - d1) / (d2 - d1))
        return self._rank

    def with_setup(self, setup: Setup) -> "Planner":
        """This model and these settings on another set-up, sharing this planner's fake steps and
        lines (a rank's step depends only on how many ranks share its sequence; its shares and its
        time on the rest of the set-up)."""
        if not isinstance(setup, Setup):
            raise ValueError(f"setup must be a leanbp.plan.Setup, got {type(setup).__name__}")
        _check_free_grads(self.free_grads, setup)
        _check_quantize(self.quantize, self.lora_rank, setup)
        other = copy.copy(self)  # (the caches are the same dicts: what either planner runs, both know)
        other.setup, other._rank, other._fits, other._traces = setup, None, {}, {}  # (replays hold the rank's bytes)
        if setup.sp != self.setup.sp:  # (another step: its own fake steps, the fake models shared)
            other._lines, other._probes, other._steps, other._work = {}, {}, {}, {}
        return other

    # -- the line in T -----------------------------------------------------------------------------
    def lines(self, method: str, progress=None) -> Lines:
        """Each phase's peak of the one-process step as a line in T, from fake steps at doubling T
        (until three in a row put every phase on one line, to the byte). A streamed method starts at
        two chunks per rank: one chunk has no prefix K/V, so its backward is off the line; each doubling
        costs more than all the probes before it (under ``sp`` each rank attends over the whole T), so
        starting low is what keeps a plan quick."""
        if method in self._lines:
            return self._lines[method]
        T, probes = (2 * self.stream.chunk_size if _chunked(method) else 1024) * self.setup.sp, []
        while True:
            report = self.step(method, T)
            probes.append((T, report))
            if progress is not None:
                progress(method, T)
            if len(probes) >= 3:
                last = probes[-3:]
                names = last[-1][1].phase_peaks.keys()
                fits = {name: _affine([(t, r.phase_peaks.get(name, -1)) for t, r in last]) for name in names}
                host = _affine([(t, r.host) for t, r in last])
                if host is not None and all(f is not None for f in fits.values()):
                    # (the gradients at a phase's peak only split it: a line, else the last probe's)
                    grads = {name: _affine([(t, r.phase_grads.get(name, 0)) for t, r in last])
                             or (float(last[-1][1].phase_grads.get(name, 0)), 0.0) for name in names}
                    lines = Lines(fits, host, last[0][0], grads)
                    break
            if len(probes) == 8:
                raise RuntimeError(f"{method}: the phases' peaks are not affine in T between {probes[0][0]} and {T} "
                                   "tokens; plan at the listed lengths with probes only")
            T *= 2
        self._lines[method] = lines
        self._probes[method] = [t for t, _ in probes[-3:]]
        return lines

    def work(self, method: str, T: int) -> Work:
        """The work of the step at T: counted by its fake step when it ran, else the polynomial
        through the lines' last three probes."""
        if (method, T) in self._work:
            return self._work[(method, T)]
        self.lines(method)
        if T < self._probes[method][0]:
            self.step(method, T)
            return self._work[(method, T)]
        return quadratic_through([(t, self._work[(method, t)]) for t in self._probes[method]])(T)

    def time(self, method: str, T: int, optimizer: bool = False) -> StepTime:
        """The step-time model at T (``_time.step_time``) on one rank of the set-up."""
        return step_time(self.work(method, T), self.setup, self.rank(), self.dtype, optimizer=optimizer,
                         offload_bytes=self.offload_pcie_bytes(method, T), tokens=self.batch * T // self.setup.sp)

    def offload_pcie_bytes(self, method: str, T: int) -> int:
        """Bytes offload moves over PCIe in a step: each streamed layer reads its input and writes its
        output in forward, and in backward reads its prefix rows (for their K/V; all but the last
        chunk), its input and its output gradient and writes its input gradient; the embedding
        output goes down once, the last layer's output and its gradient cross once each way
        (``leanbp.engine``'s offload: ``HostStore``, ``backward_reads``)."""
        if not method_named(method).overrides.get("offload"):
            return 0
        rows_per_layer = 2 * T + (T - min(self.stream.chunk_size, T)) + 3 * T
        rows = self.layers * rows_per_layer + 3 * T
        itemsize = torch.empty((), dtype=dtype_named(self.dtype)).element_size()
        return rows * self.batch * self.config.hidden_size * itemsize

    def peak(self, method: str, T: int, optimizer: bool = False, probe: bool = False) -> Peak:
        """One rank's step memory at T: a fake step when ``probe`` (or when T lies before the lines'
        range), else read from the phases' lines."""
        if not (probe or (method, T) in self._steps) and T < self.lines(method).valid_from:
            probe = True  # (before the lines' range: a fake step)
        if probe or (method, T) in self._steps:
            report = self.step(method, T)
            single = Lines({n: (float(v), 0.0) for n, v in report.phase_peaks.items()}, (float(report.host), 0.0), T,
                           {n: (float(v), 0.0) for n, v in report.phase_grads.items()})
            probed = True
        else:
            single, probed = self.lines(method), False
        total, host, phase = self._shift(single, optimizer).at(T)
        rank = self.rank()
        opt = rank.optimizer if optimizer else 0
        grads = rank.grads
        if phase == OPTIMIZER_STEP:
            activations = 0
        else:  # the one-process step's activations in that phase
            a, b = single.phases[phase]
            if self.free_grads:  # (one engine or DDP: the rank's gradients are the step's own, made so far)
                g0, g1 = single.grads.get(phase, (0.0, 0.0))
                grads = round(g0 + g1 * T)
            activations = round(a + b * T) - rank.full_weights - (grads if self.free_grads else rank.full_grads)
        buffers = total - rank.weights - grads - opt - activations
        return Peak(method, T, rank.weights, grads, opt, activations, host, probed, phase, buffers,
                    self.time(method, T, optimizer))

    def _shift(self, single: Lines, optimizer: bool) -> Lines:
        """The lines of one rank: each phase's line of the one-process step with the rank's share in
        place of its weights and gradients, the engine's buffers and working set in that phase, and
        with ``optimizer`` the optimizer's state (device and host) and its own step as a phase."""
        rank = self.rank()
        opt = rank.optimizer if optimizer else 0
        extra = {name: rank.phase_extra(name) + opt for name in single.phases}
        if optimizer:
            persistent = rank.buffers if self.setup.engine in ("ddp", "zero3") else 0
            extra[OPTIMIZER_STEP] = rank.weights + rank.grads + rank.optimizer + rank.step + persistent
        return single.shifted(extra, host=rank.host if optimizer else 0)

    def longest(self, method: str, budget: int, optimizer: bool = False, multiple: int = 256) -> Longest:
        """The longest T, a multiple of ``multiple`` (and of the chunk size for leanbp, whose lines
        hold at whole chunks), whose step fits ``budget`` bytes of device memory on every rank and
        the set-up's host memory with all ranks together; 0 when not even the resident bytes fit."""
        if _chunked(method):  # (a rank's rows in whole chunks)
            multiple = math.lcm(multiple, self.stream.chunk_size * self.setup.sp)
        lines = self._shift(self.lines(method), optimizer)
        host_budget = self.setup.host_memory / self.setup.world
        device_T = lines.longest(budget) // multiple * multiple
        host_T = lines.host_longest(host_budget)
        host_T = None if host_T is None else host_T // multiple * multiple
        T = device_T if host_T is None else min(device_T, host_T)
        bound = "host" if host_T is not None and host_T < device_T else "device"
        if T < lines.valid_from:  # before the affine range: search with fake steps
            T = self._bisect(method, budget, host_budget, optimizer, multiple, 0, lines.valid_from)
            return Longest(T, True, bound, device_T, host_T)
        if not self._affordable(method, T):
            return Longest(T, False, bound, device_T, host_T)
        peak = self.peak(method, T, optimizer, probe=True)
        if peak.total > budget or peak.host > host_budget:
            raise RuntimeError(f"{method}: the fake step at T={T} does not fit although every phase's line says it "
                               "does; a phase is not affine in T")
        return Longest(T, True, bound, device_T, host_T)

    def max_seq_len(self, method: str, budget: int, optimizer: bool = False, multiple: int = 256
                    ) -> tuple[int, bool]:
        """(the longest T, whether a fake step at that T confirmed it): ``longest`` in short."""
        found = self.longest(method, budget, optimizer, multiple)
        return found.seq_len, found.checked

    # -- the caching allocator -------------------------------------------------------------------
    def allocator(self, method: str, T: int, optimizer: bool = False) -> AllocatorFit:
        """The step at T through the caching allocator's model: a fake step at the model's full
        depth (the allocator's state does not extend along a depth line) records its allocations,
        which ``replay_steps`` steps replay after the rank's resident bytes."""
        key = (method, T, optimizer, self.replay_steps)
        if key not in self._fits:
            replayed = self._replayed(method, T, optimizer)
            unlimited = replayed(None)
            needed = needed_capacity(*replayed.args, **replayed.keywords, unlimited=unlimited)
            self._fits[key] = AllocatorFit(T, unlimited.peak_allocated, needed, unlimited.peak_reserved)
        return self._fits[key]

    def fits(self, method: str, T: int, capacity: int, optimizer: bool = False) -> bool:
        """Whether the steps at T run in ``capacity`` bytes through the allocator's model (a replay at
        that capacity)."""
        return self._replayed(method, T, optimizer)(capacity).fits

    def _replayed(self, method: str, T: int, optimizer: bool):
        """The replay of the step at T at any capacity (its trace recorded once)."""
        if _chunked(method):
            raise ValueError(f"{method} streams its layers: a fake step at full depth is too slow to replay at the "
                             "lengths it reaches (plan it with the reserve's fragmentation share)")
        key = (method, T, optimizer, self.replay_steps)
        if key not in self._traces:
            trace: list = []
            self._step_at_depth(method, T, self.layers, trace)
            resident, state, update = self._rank_blocks(optimizer)
            self._traces.clear()  # (one trace kept: a long step's is tens of thousands of events)
            # (called with a capacity, None for no limit: the replay)
            self._traces[key] = functools.partial(replay, trace, resident, steps=self.replay_steps, state=state,
                                                  update=update)
        return self._traces[key]

    def _rank_blocks(self, optimizer: bool) -> tuple[list, list, int]:
        """(resident blocks, the optimizer's lazily made state, its step's temporary bytes) of one
        rank for the allocator's model."""
        rank = self.rank()
        resident = [rank.weights, rank.buffers, max(rank.forward, rank.backward)]
        if not self.free_grads:  # (else the step's trace makes them)
            resident.append(rank.grads)
        if not optimizer or not rank.optimizer:
            return resident, [], rank.step if optimizer else 0
        if not self.setup.device_state_made_at_first_step:  # (ZeRO makes its flat partitions when it starts)
            return resident + [rank.optimizer], [], rank.step
        # a torch optimizer makes two moments per parameter at its first step
        sizes = [t.numel for t in parameter_tensors(self._model(self.layers)) if t.trainable]
        total = sum(sizes)
        return resident, [rank.optimizer * n // (2 * total) for n in sizes for _ in range(2)], rank.step

    def longest_allocated(self, method: str, capacity: int, optimizer: bool = False, multiple: int = 256
                          ) -> Longest:
        """The longest T (a multiple of ``multiple``) whose steps run through the caching allocator's
        model in ``capacity`` bytes of device memory (the GPU's memory less what is not the
        allocator's: the CUDA context and cuBLAS workspaces), and fit the host budget. From the
        lines' T for the tensors alone (an upper bound), each try takes the allocator's overhead at
        the last T off the budget until the T repeats; a bisection between the longest T that fit and
        the shortest that did not ends it (each try is a fake step at full depth)."""
        lines = self._shift(self.lines(method), optimizer)
        fits: dict = {}
        T = upper = lines.longest(capacity) // multiple * multiple
        for _ in range(6):
            if T <= 0 or T in fits:
                break
            fits[T] = self.fits(method, T, capacity, optimizer)
            if fits[T] and T == upper:  # (no longer T fits even the tensors)
                break
            T = lines.longest(capacity - self.allocator(method, T, optimizer).fragmentation) // multiple * multiple
        lo = max((t for t, ok in fits.items() if ok), default=0)
        hi = min((t for t, ok in fits.items() if not ok and t > lo), default=None)
        while hi is not None and hi - lo > multiple:
            mid = (lo + hi) // 2 // multiple * multiple
            if self.fits(method, mid, capacity, optimizer):
                lo = mid
            else:
                hi = mid
        host_T = lines.host_longest(self.setup.host_memory / self.setup.world)
        host_T = None if host_T is None else host_T // multiple * multiple
        if host_T is not None and host_T < lo:
            return Longest(host_T, False, "host", lo, host_T)
        return Longest(lo, True, "device", lo, host_T)

    def _affordable(self, method: str, T: int) -> bool:
        """Whether a fake step at T is quick enough to run (at most ``verify_limit`` layer chunks)."""
        return not _chunked(method) or -(-T // (self.stream.chunk_size * self.setup.sp)) <= self.verify_limit

    def _bisect(self, method: str, budget: int, host_budget: float, optimizer: bool, multiple: int, lo: int,
                hi: int) -> int:
        """The longest multiple of ``multiple`` in [lo, hi) that fits, by fake steps (``lo`` fits)."""
        lo = lo // multiple * multiple
        while hi - lo > multiple:
            mid = (lo + hi) // 2 // multiple * multiple or multiple
            peak = self.peak(method, mid, optimizer, probe=True)
            if peak.total <= budget and peak.host <= host_budget:
                lo = mid
            else:
                hi = mid
        return lo


def _chunked(method: str) -> bool:
    """Whether ``method`` streams its layers in chunks (its lines in T hold at whole chunks)."""
    return method_named(method).streamed


def _check_free_grads(free_grads: bool, setup: Setup) -> None:
    if free_grads and setup.engine not in ("single", "ddp"):
        raise ValueError(f"free_grads models a loop that frees its gradients between steps; {setup.engine} keeps "
                         "the rank's gradient share in its own buffers through the step (plan it without)")


def training_step(model, input_ids: torch.Tensor, hold_outputs: bool = True) -> None:
    """The step the plan measures: a causal-LM loss on ``input_ids`` and its backward.

    hold_outputs: the loop keeps the model's outputs until the backward is done, as the usual loop
    does (``outputs = model(**batch); outputs.loss.backward()``): with transformers' own head the
    (B, T, V) logits stay alive through backward. False drops them first, as ``Trainer`` does
    (its ``compute_loss`` returns only the loss). A streamed model returns no logits in training:
    the same either way."""
    outputs = model(input_ids=input_ids, labels=input_ids, use_cache=False)
    loss = outputs.loss
    if not hold_outputs:
        del outputs
    loss.backward()


def _check_quantize(quantize: str, lora_rank: int | None, setup: Setup) -> None:
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    if quantize == "none":
        return
    if not lora_rank:
        raise ValueError(f"{quantize} base weights are frozen: plan them under LoRA (lora_rank, --lora R)")
    if setup.engine not in ("single", "ddp"):
        raise ValueError(f"4-bit base weights are planned on one GPU or under DDP, not {setup.engine}: sharding "
                         "bitsandbytes' packed weights is not modelled")


def _fake_lora(model, rank: int):
    """PEFT's LoRA (r=rank on every linear layer but the head) on a fake model. PEFT moves each new
    adapter to its base layer's device (and dtype) with ``Module.to``, which must swap fake
    parameters and cannot. The adapters are created on that device already, and PEFT keeps them in
    fp32 whatever the base dtype (``autocast_adapter_dtype``), so while they are made those moves
    are skipped: the result is the model real PEFT builds."""
    import peft
    from peft.tuners.tuners_utils import BaseTunerLayer

    move, to = BaseTunerLayer._move_adapter_to_device_of_base_layer, torch.nn.Module.to

    def to_unless_there(module, *args, **kwargs):
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None and all(p.device == device for p in module.parameters()):
            return module
        return to(module, *args, **kwargs)

    BaseTunerLayer._move_adapter_to_device_of_base_layer = lambda self, adapter_name, device=None: None
    torch.nn.Module.to = to_unless_there
    try:
        return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer, torch.nn.Module.to = move, to


@contextmanager
def _one_document_per_row():
    """transformers reads ``position_ids`` to find packed rows; fake ids have no values, so it would
    build a (T, T) mask for every layer. The plan assumes one document per row (as leanbp's engine
    does on fake tensors, ``leanbp.engine.has_values``)."""
    from transformers import masking_utils

    find = masking_utils.find_packed_sequence_indices

    def real_ids_only(position_ids):
        return find(position_ids) if has_values(position_ids) else None

    masking_utils.find_packed_sequence_indices = real_ids_only
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find


def _layer_period(config) -> int | None:
    """Layers per repeat of the layer pattern (1 when all layers are alike; the model may end with a
    part of one repeat, as Gemma 3 1B's 26 layers end two layers into their fifth repeat of six)."""
    types = getattr(config, "layer_types", None)
    if not types:
        return 1
    types = list(types)
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return p
    return None
