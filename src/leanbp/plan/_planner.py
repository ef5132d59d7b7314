"""``leanbp plan``: the peak device memory of a training step, and the longest sequence that fits,
predicted without the device.

Every number comes from running the real training step (``model(input_ids, labels=...)`` and
``loss.backward()``, through transformers, its gradient checkpointing, or ``leanbp.stream``) on fake
tensors (``FakeTensorMode``: shapes and dtypes, no values, no memory), measured by the same live-bytes
tracker as ``leanbp.memory.track``. So the plan follows the code: change the engine and the plan
changes with it. Two regularities of a decoder stack make it fast (the length one is checked on
every run, both in ``tests/plan/test_plan.py``):

* Depth: a stack of identical layers adds the same bytes per layer (its weights, gradients and what
  each method keeps per layer), so the step is run at two small depths (2 and 3 layers: the first
  layer can differ, e.g. when a frozen embedding gives it an input without gradient) and the peak,
  weights, gradients and host bytes are extended to the model's depth along that line.
* Length: at a fixed chunk size every buffer a step keeps grows linearly in T, so the peak of each
  phase of the step (the engine labels its layer forward, layer backward, head and final norm;
  the rest is "forward" or "backward", see ``memory.phase``) is affine in T, and the step's peak is
  the largest of them. Probes double T until three in a row put every phase on one line (to the
  byte); the lines give the peak at every T beyond, and which phase holds it. The longest T under
  the budget is checked by a fake step at that T when that step is affordable (``verify_limit``
  layer chunks).

What it does not model: allocator fragmentation and caching, the CUDA context, kernel workspaces
(cuBLAS, flash attention) and the communication buffers of distributed engines; ``leanbp plan
--reserve`` holds them back from the budget. The attention kernels are the CPU ones (SDPA's flash kernel for
transformers, leanbp's two-block (out, lse) attention), which keep what the CUDA flash kernels keep.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import InitVar, dataclass, field

import torch

from .._dtypes import dtype_named
from ..engine import has_values
from ..memory import MemoryReport, track
from ..streaming import PLANNED, StreamConfig, apply_method, old_chunk_sizes
from ..streaming import method as method_named

# the dtypes of the weights and gradients a plan is made for
PLAN_DTYPES = ("bf16", "fp16", "fp32")

# AdamW's two moments per trainable parameter, kept in fp32 whatever the parameter dtype (as mixed-
# precision trainers and DeepSpeed do), stepped by a fused kernel (no whole-model temporaries).
OPTIMIZER_BYTES_PER_PARAM = 8


def _qwen3(hidden, layers, heads, inter, tied, kv=8):
    return dict(model_type="qwen3", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=128, intermediate_size=inter, vocab_size=151936,
                tie_word_embeddings=tied, rope_theta=1_000_000.0)


def _llama(hidden, layers, heads, inter, vocab=128256, model_type="llama", **extra):
    return dict(model_type=model_type, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=8, intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=False,
                **extra)


def _qwen2(hidden, layers, heads, kv, inter):
    return dict(model_type="qwen2", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, intermediate_size=inter, vocab_size=152064, tie_word_embeddings=False,
                rope_theta=1_000_000.0)


# The shapes of common open models (from their published config.json files): nothing is downloaded.
PRESETS: dict[str, dict] = {
    "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, tied=True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, tied=True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, tied=True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, tied=False),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408, tied=False),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600, tied=False),
    "llama-3.1-8b": _llama(4096, 32, 32, 14336, rope_theta=500_000.0),
    "llama-3.1-70b": _llama(8192, 80, 64, 28672, rope_theta=500_000.0),
    "mistral-7b": _llama(4096, 32, 32, 14336, vocab=32768, model_type="mistral", rope_theta=1_000_000.0),
    "qwen2.5-7b": _qwen2(3584, 28, 28, 4, 18944),
    "qwen2.5-32b": _qwen2(5120, 64, 40, 8, 27648),
}


def load_config(model: str):
    """A transformers config from a preset name (``PRESETS``), a model directory or a config.json."""
    from pathlib import Path

    import transformers

    preset = PRESETS.get(model.lower())
    if preset is not None:
        kwargs = dict(preset)
        return transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    path = Path(model)
    if path.is_dir() or (path.is_file() and path.suffix == ".json"):
        return transformers.AutoConfig.from_pretrained(str(path))
    raise FileNotFoundError(f"{model!r} is not a preset ({', '.join(PRESETS)}), a model directory or a config.json")


@dataclass(frozen=True)
class Peak:
    """Bytes of one step at one T. ``optimizer`` is 0 for backprop only; ``host`` is what offload
    keeps in host memory (not part of ``total``)."""

    method: str
    seq_len: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    host: int = 0
    probed: bool = False  # a fake step at this T (else read from the phases' lines)
    phase: str = ""  # the phase of the step that holds the peak

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations


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


@dataclass
class Planner:
    """Fake training steps of one model configuration (see the module docstring).

    dtype: parameters and gradients (``PLAN_DTYPES``); batch: sequences per step; stream: leanbp's
    settings (a fixed chunk size: with "auto" the chunk grows with T and the phases' peaks are not
    lines); hold_outputs: the loop keeps the model's outputs until backward (see ``training_step``);
    lora_rank: train LoRA adapters of this rank on every linear layer but the head (PEFT's
    "all-linear"), the base frozen; verify_limit: a fake step to check the longest T is run when it
    has at most this many layer chunks."""

    config: object
    dtype: str = "bf16"
    batch: int = 1
    stream: StreamConfig = field(default_factory=StreamConfig)
    hold_outputs: bool = True
    lora_rank: int | None = None
    verify_limit: int = 64
    _models: dict = field(default_factory=dict, repr=False)
    _lines: dict = field(default_factory=dict, repr=False)
    _resident: MemoryReport | None = field(default=None, repr=False)
    _steps: dict = field(default_factory=dict, repr=False)  # (method, T) -> the fake step's report
    _trainable: int | None = field(default=None, repr=False)
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
        from torch._subclasses.fake_tensor import FakeTensorMode

        self._mode = FakeTensorMode()
        self.layers = self.config.num_hidden_layers
        # two depths whose difference is one repeat of the layer pattern (or the whole model when
        # its layers are not alike, or when it is that shallow). Not from one repeat: the first
        # layer differs from the others when its input needs no gradient (a frozen embedding, LoRA)
        period = _layer_period(self.config)
        self.depths = (2 * period, 3 * period) if period and 3 * period < self.layers else (self.layers,)

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
                if self.lora_rank:
                    model = _fake_lora(model, self.lora_rank)
                for p in model.parameters():  # steady state of a training loop: gradients resident
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)
            self._models[depth] = model
        return self._models[depth]

    def _step_at_depth(self, method: str, T: int, depth: int) -> MemoryReport:
        model = apply_method(self._model(depth), method, self.stream)
        with self._mode, _one_document_per_row():
            ids = torch.zeros(self.batch, T, dtype=torch.long)
            with track(model) as mem:
                training_step(model, ids, self.hold_outputs)
        return mem.report

    def step(self, method: str, T: int) -> MemoryReport:
        """The step's memory at the model's depth (extended along the depth line when probed
        shallower); each (method, T) is run once."""
        if method not in PLANNED:
            raise ValueError(f"leanbp plan predicts the methods {list(PLANNED)}, not {method!r}")
        if (method, T) not in self._steps:
            self._steps[(method, T)] = self._step_at_full_depth(method, T)
        return self._steps[(method, T)]

    def _step_at_full_depth(self, method: str, T: int) -> MemoryReport:
        reports = [self._step_at_depth(method, T, d) for d in self.depths]
        if len(reports) == 1:
            return reports[0]
        (d1, r1), (d2, r2) = zip(self.depths, reports)
        k = (self.layers - d1) / (d2 - d1)
        grow = lambda a, b: round(a + k * (b - a))  # noqa: E731
        if r1.phase_peaks.keys() != r2.phase_peaks.keys():
            raise RuntimeError(f"{method}: the phases of a {d1}- and a {d2}-layer step differ; plan at full depth")
        phases = {name: grow(r1.phase_peaks[name], r2.phase_peaks[name]) for name in r1.phase_peaks}
        return MemoryReport(peak=max(phases.values()), params=grow(r1.params, r2.params),
                            grads=grow(r1.grads, r2.grads), host=grow(r1.host, r2.host), phase_peaks=phases)

    def _peak(self, method: str, T: int, report: MemoryReport, optimizer: bool, probed: bool, phase: str = "") -> Peak:
        opt = OPTIMIZER_BYTES_PER_PARAM * self.trainable_params() if optimizer else 0
        if not phase and report.phase_peaks:
            phase = max(report.phase_peaks, key=report.phase_peaks.get)
        return Peak(method, T, report.params, report.grads, opt, report.activations, report.host, probed, phase)

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

    # -- the line in T -----------------------------------------------------------------------------
    def lines(self, method: str, progress=None) -> Lines:
        """Each phase's peak as a line in T, from fake steps at doubling T (until three in a row
        put every phase on one line, to the byte)."""
        if method in self._lines:
            return self._lines[method]
        T, probes = 4 * self.stream.chunk_size if _chunked(method) else 1024, []
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
                    lines = Lines(fits, host, last[0][0])
                    break
            if len(probes) == 8:
                raise RuntimeError(f"{method}: the phases' peaks are not affine in T between {probes[0][0]} and {T} "
                                   "tokens; plan at the listed lengths with probes only")
            T *= 2
        self._lines[method] = lines
        self._resident = report  # weights and gradients: the same at every T
        return lines

    def peak(self, method: str, T: int, optimizer: bool = False, probe: bool = False) -> Peak:
        """The step's memory at T: a fake step when ``probe`` (or when T lies before the lines'
        range), else read from the phases' lines."""
        lines = self.lines(method)
        if probe or T < lines.valid_from or (method, T) in self._steps:
            return self._peak(method, T, self.step(method, T), optimizer, probed=True)
        peak, host, phase = lines.at(T)
        base = self._resident
        return self._peak(method, T, MemoryReport(peak=peak, params=base.params, grads=base.grads, host=host),
                          optimizer, probed=False, phase=phase)

    def max_seq_len(self, method: str, budget: int, optimizer: bool = False, multiple: int = 256
                    ) -> tuple[int, bool]:
        """(the longest T, a multiple of ``multiple`` (and of the chunk size for leanbp, whose lines
        hold at whole chunks), whose step fits ``budget`` bytes; whether a fake step at that T
        confirmed it). 0 when not even the model's resident bytes fit."""
        if _chunked(method):
            multiple = math.lcm(multiple, self.stream.chunk_size)
        lines = self.lines(method)
        optimizer_bytes = OPTIMIZER_BYTES_PER_PARAM * self.trainable_params() if optimizer else 0
        # the lines are the step's peak with weights and gradients; the optimizer's states sit beside it
        T = lines.longest(budget - optimizer_bytes) // multiple * multiple
        if T < lines.valid_from:  # before the affine range: search with fake steps
            return self._bisect(method, budget, optimizer, multiple, 0, lines.valid_from), True
        if not self._affordable(method, T):
            return T, False
        if self.peak(method, T, optimizer, probe=True).total > budget:
            raise RuntimeError(f"{method}: the fake step at T={T} does not fit although every phase's line says it "
                               "does; a phase is not affine in T")
        return T, True

    def _affordable(self, method: str, T: int) -> bool:
        """Whether a fake step at T is quick enough to run (at most ``verify_limit`` layer chunks)."""
        return not _chunked(method) or -(-T // self.stream.chunk_size) <= self.verify_limit

    def _bisect(self, method: str, budget: int, optimizer: bool, multiple: int, lo: int, hi: int) -> int:
        """The longest multiple of ``multiple`` in [lo, hi) that fits, by fake steps (``lo`` fits)."""
        lo = lo // multiple * multiple
        while hi - lo > multiple:
            mid = (lo + hi) // 2 // multiple * multiple or multiple
            if self.peak(method, mid, optimizer, probe=True).total <= budget:
                lo = mid
            else:
                hi = mid
        return lo


def _chunked(method: str) -> bool:
    """Whether ``method`` streams its layers in chunks (its lines in T hold at whole chunks)."""
    return method_named(method).streamed


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
    """Layers per repeat of the layer pattern (1 when all layers are alike), None when the layers
    differ in ways the depth line cannot follow."""
    types = getattr(config, "layer_types", None)
    if not types:
        return 1
    types = list(types)
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return p if len(types) % p == 0 else None
    return None
