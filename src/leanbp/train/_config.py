"""``TrainConfig``: one run of ``leanbp train``, every setting declared once (the command line's
options are built from these fields)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .._dtypes import dtype_named
from .._options import setting
from ..approx import VARIANTS, variant_settings
from ..streaming import StreamConfig
from ._data import CLASSIFY
from ..pipeline import SCHEDULES as PIPELINE_SCHEDULES
from ._engines import ENGINES

OBJECTIVES = ("lm", "sft", "dpo", "grpo")
TRAIN_DTYPES = ("fp32", "bf16", "fp64")
# adamw: backprop (streamed) + AdamW; dpzero: two forwards per step, differentially private
OPTIMIZERS = ("adamw", "dpzero")
DEFAULT_LR = {"adamw": 1e-3, "dpzero": 2e-4}


class NonFiniteError(RuntimeError):
    """A training step produced a loss or gradient that is not finite."""


@dataclass
class TrainConfig:
    model: str | None = setting(None, metavar="DIR|config.json",
                                help="local transformers model directory or config.json (default: the built-in "
                                     "Qwen3-shaped model, random init, byte-level vocabulary)")
    data: str | None = setting(None, metavar="FILE",
                               help="lm: local .txt or .jsonl ('text', or 'prompt'+'completion'), or builtin:classify "
                                    "(the bundled verses as a two-class task: does someone speak in the verse? one "
                                    "label token, y or n); sft|dpo|grpo: a .jsonl in TRL's format (sft: text | "
                                    "prompt+completion | messages; dpo: prompt+chosen+rejected; grpo: prompt+answer) "
                                    "(default: the bundled text, or the objective's built-in set made from it)")
    objective: str = setting("lm", choices=OBJECTIVES,
                             help="lm: leanbp's own loop; sft | dpo | grpo: TRL's trainer on the streamed model "
                                  "(needs pip install -e '.[trl]')")
    out: str = setting("runs/leanbp-train", metavar="DIR",
                       help="run folder: checkpoints/step-*/ (checkpoint -> the newest), train_log.csv, loss.png, "
                            "run.json")
    seq_len: int = setting(4096, help="tokens per sequence")
    batch_size: int | None = setting(None, parse=int,
                                     help="sequences per micro-batch, per process (default: 1; grpo: --group-size, "
                                          "so that a micro-batch holds one prompt's completions, as TRL's defaults do)")
    grad_accum: int = setting(1, help="micro-batches per optimizer step")
    steps: int = setting(40, help="optimizer steps of the run")
    lr: float | None = setting(None, parse=float,
                               help=f"peak learning rate (default: {DEFAULT_LR['adamw']:g} for adamw, "
                                    f"{DEFAULT_LR['dpzero']:g} for dpzero)")
    warmup: int = setting(5, help="linear warmup steps, then cosine decay to 10% of the learning rate")
    weight_decay: float = setting(0.0, help="AdamW's weight decay")
    dtype: str = setting("fp32", choices=TRAIN_DTYPES, help="the model's dtype")
    # how the model streams (its settings are StreamConfig's options); None: plain autograd, the
    # baseline (--no-stream)
    stream: StreamConfig | None = field(default_factory=StreamConfig)
    approx: str = setting("none", choices=VARIANTS,
                          help="opt in to Approx-BP (act: ReSiLU2/ReGELU2; inverted: Inverted Activations; both "
                               "approximate gradients) and/or MS-BP (norm: memory-sharing norms with folded affines)")
    save_every: int = setting(20, help="steps between checkpoints")
    seed: int = setting(0, help="seed of the built-in model's weights and of the data order")
    device: str = setting("cpu", help="cpu, cuda, cuda:N")
    resume: bool = setting(False, help="continue the run in the run folder from its newest complete checkpoint (TRL "
                                       "objectives: the newest OUT/trainer/checkpoint-*)")
    packing: bool = setting(False, help="sft: pack examples into padding-free rows")
    group_size: int = setting(4, help="grpo: completions per prompt")
    completion_len: int = setting(64, help="grpo: tokens generated per completion")
    keep: int = setting(2, help="checkpoints kept in OUT/checkpoints")
    overwrite: bool = setting(False, help="replace a previous run in the run folder (else: an error)")
    skip_nonfinite: bool = setting(False, help="skip a step whose loss or gradient is not finite (default: stop with "
                                               "an error)")
    engine: str = setting("single", choices=ENGINES,
                          help="single: one process (the default); ddp | fsdp2 | zero2 | zero3 (DeepSpeed ZeRO): one "
                               "process per device, each on its own micro-batches, launched by --nproc N or torchrun "
                               "(where ddp is the default); pipeline: --stages S processes, each running its share "
                               "of the layers (--schedule)")
    stages: int = setting(1, metavar="S",
                          help="--engine pipeline: the pipeline's stages, one process each (consecutive decoder "
                               "layers; launched by itself, or by --nproc S; --nproc R x S runs R pipelines side by "
                               "side, each on its own micro-batches, gradients averaged); a pipeline's stages train "
                               "on the same micro-batches (--grad-accum of them per step)")
    schedule: str = setting("1f1b", choices=PIPELINE_SCHEDULES,
                            help="--engine pipeline: 1f1b (one forward, one backward) or 2bp (each backward split "
                                 "into its input pass, sent upstream at once, and its weight pass, deferred to fill "
                                 "the pipeline's idle time; with streamed layers the weight pass recomputes, which "
                                 "costs more than it fills on the measured set-ups: see docs/pipeline.md)")
    sp: int = setting(1, metavar="P",
                      help="sequence parallelism: P ranks share each sequence, each holding --seq-len / P rows "
                           "(Ulysses' head exchange inside every streamed layer); P divides the ranks, and each group "
                           "of P consecutive ranks trains on the same micro-batches (--objective lm, streamed, no "
                           "offload; see docs/multi-gpu.md)")
    optimizer: str = setting("adamw", choices=OPTIMIZERS,
                             help="adamw: backprop and AdamW; dpzero: differentially private zeroth-order steps (two "
                                  "forwards, no backward; Poisson-sampled batches of --batch-size x --grad-accum "
                                  "records expected; needs pip install -e '.[dp]'; see docs/dpzero.md)")
    dp_epsilon: float = setting(8.0, help="dpzero: the privacy budget epsilon of the whole run (--steps steps)")
    dp_delta: float | None = setting(None, parse=float,
                                     help="dpzero: the privacy budget delta (default: min(1e-5, 1 / (10 N)), N the "
                                          "records of the data)")
    dp_clip: float = setting(1.0, help="dpzero: C, each example's loss difference is clipped to [-C, C]")
    zo_mu: float = setting(1e-3, help="dpzero: mu, the step of the finite difference along the random direction")

    def __post_init__(self):
        if self.batch_size is None:  # (each objective's default, so that the defaults form a valid run)
            self.batch_size = self.group_size if self.objective == "grpo" else 1
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.lr is None:  # (each optimizer's default)
            self.lr = DEFAULT_LR[self.optimizer]
        dtype_named(self.dtype, TRAIN_DTYPES)
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.warmup < 0:
            raise ValueError("warmup must be >= 0")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "save_every", "group_size", "completion_len",
                     "keep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.objective == "grpo":
            _check_groups(self.batch_size, self.grad_accum, self.group_size)
        if self.stream is not None and not isinstance(self.stream, StreamConfig):
            raise TypeError(f"stream must be a leanbp.StreamConfig or None, got {type(self.stream).__name__}")
        variant_settings(self.approx)  # one of approx's VARIANTS, else ValueError
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine != "single" and self.objective != "lm":
            raise ValueError(f"--engine {self.engine} trains --objective lm; TRL's trainers (sft, dpo, grpo) run on "
                             "several processes through `accelerate launch` (see docs/multi-gpu.md)")
        if self.engine in ("fsdp2", "zero2", "zero3") and self.approx != "none":
            raise ValueError(f"--approx with --engine {self.engine}: the exported checkpoint would hold the folded "
                             "weights; use --engine ddp (or single) with --approx")
        if self.engine.startswith("zero") and self.grad_accum != 1:
            raise ValueError("--engine zero2/zero3 takes --grad-accum 1 (DeepSpeed accumulates by itself); raise "
                             "--batch-size instead")
        if self.data == CLASSIFY and self.objective != "lm":
            raise ValueError(f"--data {CLASSIFY} is a task for --objective lm (a prompt and one label token)")
        if self.optimizer == "dpzero":
            _check_dpzero(self)
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"schedule must be one of {PIPELINE_SCHEDULES}, got {self.schedule!r}")
        if self.engine == "pipeline" or self.stages != 1:
            _check_pipeline(self)
        if self.sp < 1:
            raise ValueError(f"--sp must be >= 1, got {self.sp}")
        if self.sp > 1:
            _check_sequence_parallel(self)

    def settings(self, world: int = 1) -> dict:
        """What the run is, flat (run.json; a --resume must match it): every setting, the stream's
        among them, and the number of processes (which splits the data and sizes the step)."""
        flat = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "stream"}
        streamed = self.stream is not None
        return {**flat, **vars(self.stream if streamed else StreamConfig()), "stream": streamed, "world_size": world}


def _check_sequence_parallel(cfg: "TrainConfig") -> None:
    """What --sp P needs, said before any process starts."""
    if cfg.engine == "single":
        raise ValueError(f"--sp {cfg.sp} spreads each sequence over {cfg.sp} ranks: launch several with --nproc N "
                         "--engine ddp (or fsdp2, zero2, zero3)")
    if cfg.stream is None:
        raise ValueError("--sp runs inside the streamed layers: leave streaming on (no --no-stream)")
    if not cfg.stream.layers:
        raise ValueError("--sp splits the streamed layers' rows: it needs StreamConfig(layers=True)")
    if cfg.optimizer != "adamw":
        raise ValueError(f"--sp trains with backprop (--optimizer adamw), got --optimizer {cfg.optimizer}")
    if cfg.seq_len % cfg.sp:
        raise ValueError(f"--seq-len {cfg.seq_len} does not split over --sp {cfg.sp} ranks: choose a multiple of "
                         f"{cfg.sp}")


def _check_pipeline(cfg: TrainConfig) -> None:
    """What --engine pipeline needs, said before any process starts."""
    if cfg.engine != "pipeline":
        raise ValueError(f"--stages {cfg.stages} splits the model into a pipeline: pass --engine pipeline")
    if cfg.stages < 2:
        raise ValueError(f"--engine pipeline needs --stages >= 2, got {cfg.stages}")
    if cfg.stream is None or not cfg.stream.layers or cfg.stream.offload:
        raise ValueError("--engine pipeline runs streamed layers in every stage: leave streaming on (no --no-stream), "
                         "without --offload")
    if cfg.approx != "none":
        raise ValueError("--approx with --engine pipeline is not supported yet")
    if cfg.sp != 1:
        raise ValueError("--sp with --engine pipeline is not supported yet")


def _check_dpzero(cfg: TrainConfig) -> None:
    """What DPZero's guarantee and its two-forward step need of the rest of the run."""
    if cfg.engine != "single":
        raise ValueError(f"--optimizer dpzero runs in one process (--engine single), got --engine {cfg.engine}: its "
                         "step is two forwards and one scalar, with nothing to all-reduce")
    if cfg.objective != "lm":
        raise ValueError(f"--optimizer dpzero trains --objective lm (a text corpus, prompt/completion examples or "
                         f"--data {CLASSIFY}), got --objective {cfg.objective}")
    if cfg.dtype == "bf16":
        raise ValueError("--optimizer dpzero needs --dtype fp32 or fp64: perturbing and restoring bf16 weights by "
                         "mu z rounds them by up to 2**-8 of their size at every step")
    if cfg.approx != "none":
        raise ValueError("--approx changes backprop; --optimizer dpzero makes none (forwards only)")
    if cfg.weight_decay != 0:
        raise ValueError("--weight-decay is AdamW's; --optimizer dpzero's update is theta -= lr * noisy scalar * z")
    if not (math.isfinite(cfg.dp_epsilon) and cfg.dp_epsilon > 0):
        raise ValueError(f"--dp-epsilon must be a finite number > 0, got {cfg.dp_epsilon}")
    if cfg.dp_delta is not None and not 0 < cfg.dp_delta < 1:
        raise ValueError(f"--dp-delta must be in (0, 1), got {cfg.dp_delta}")
    if not (math.isfinite(cfg.dp_clip) and cfg.dp_clip > 0):
        raise ValueError(f"--dp-clip must be a finite number > 0, got {cfg.dp_clip}")
    if not (math.isfinite(cfg.zo_mu) and cfg.zo_mu > 0):
        raise ValueError(f"--zo-mu must be a finite number > 0, got {cfg.zo_mu}")


def _check_groups(batch_size: int, grad_accum: int, group_size: int) -> None:
    """GRPO scores each prompt's group of completions against each other, so TRL's trainer needs a
    step's completions (batch size x gradient accumulation, on one process) to hold whole groups."""
    if group_size < 2:
        raise ValueError(f"--group-size {group_size}: GRPO compares each completion with the others of its prompt, so "
                         "it needs at least 2 completions per prompt")
    completions = batch_size * grad_accum
    if completions % group_size:
        fits = [g for g in range(2, completions + 1) if completions % g == 0]
        other = f", or --group-size {' or '.join(map(str, fits))}" if fits else ""
        raise ValueError(f"--objective grpo: a step holds --batch-size {batch_size} x --grad-accum {grad_accum} = "
                         f"{completions} completions, which is not a whole number of groups of --group-size "
                         f"{group_size}; pass --batch-size {group_size} (or a multiple of it){other}")
