"""`leanbp train`: a complete training loop on a streamed model, with checkpoints and resume."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from . import _checkpoint as checkpoints
from . import memory
from ._builtin import TRAIN_QWEN3, build_model, qwen3_config
from ._data import TokenData, load_tokenizer
from .approx import approx
from .distributed._engines import ENGINES, Engine, make_engine
from .engine import StreamConfig, chunk_size_used, stream

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


OBJECTIVES = ("lm", "sft", "dpo", "grpo")


@dataclass
class TrainConfig:
    model: str | None = None  # local model directory or config.json; None: the built-in model
    data: str | None = None  # .txt or .jsonl; None: the bundled text (or the objective's built-in set)
    # lm: leanbp's own loop (next-token loss on text, or prompt/completion SFT);
    # sft | dpo | grpo: TRL's trainers on the streamed model
    objective: str = "lm"
    out: str = "runs/leanbp-train"
    seq_len: int = 4096
    batch_size: int = 1
    grad_accum: int = 1
    steps: int = 40
    lr: float = 1e-3
    warmup: int = 5
    weight_decay: float = 0.0
    dtype: str = "fp32"
    chunk_size: int | str = "auto"  # the largest chunk within the default budget (engine/_chunking.py)
    head_chunk_size: int = StreamConfig.head_chunk_size
    stream: bool = True
    offload: bool = False  # the hidden states between streamed layers, and their gradients, in host memory
    approx: str = "none"  # none | act | norm | both (Approx-BP / MS-BP; "act" changes gradients)
    save_every: int = 20
    seed: int = 0
    device: str = "cpu"
    resume: bool = False
    packing: bool = False  # sft: pack examples into padding-free rows
    group_size: int = 4  # grpo: completions per prompt
    completion_len: int = 64  # grpo: tokens generated per completion
    keep: int = 2  # checkpoints kept
    overwrite: bool = False  # replace a previous run in `out`
    skip_nonfinite: bool = False  # skip a step whose loss or gradient is not finite, instead of stopping
    # single: one process; ddp | fsdp2 | zero2 | zero3: one process per device (torchrun or --nproc),
    # each rank training on its own micro-batches (see leanbp.distributed._engines)
    engine: str = "single"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.warmup < 0:
            raise ValueError("warmup must be >= 0")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "chunk_size", "head_chunk_size",
                     "save_every", "group_size", "completion_len", "keep"):
            if name == "chunk_size":
                StreamConfig(chunk_size=self.chunk_size)  # a positive int or "auto", else ValueError
            elif getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.lr <= 0:
            raise ValueError("lr must be > 0")
        if self.offload and not self.stream:
            raise ValueError("--offload moves the streamed layers' inputs to the host: it needs streaming (drop --no-stream)")
        if self.approx not in ("none", "act", "norm", "both"):
            raise ValueError(f"approx must be none, act, norm or both, got {self.approx!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine != "single" and self.objective != "lm":
            raise ValueError(f"--engine {self.engine} trains --objective lm; TRL's trainers (sft, dpo, grpo) run on "
                             "several processes through `accelerate launch` (see README, Multiple GPUs)")
        if self.engine in ("fsdp2", "zero2", "zero3") and self.approx != "none":
            raise ValueError(f"--approx with --engine {self.engine}: the exported checkpoint would hold the folded "
                             "weights; use --engine ddp (or single) with --approx")
        if self.engine.startswith("zero") and self.grad_accum != 1:
            raise ValueError("--engine zero2/zero3 takes --grad-accum 1 (DeepSpeed accumulates by itself); raise "
                             "--batch-size instead")


def load_model(spec: str | None, seq_len: int, dtype: torch.dtype, seed: int):
    """A transformers causal LM from a local directory or config.json, or the built-in Qwen3 model.
    A directory with weights is loaded; a bare config is built with random init (seeded)."""
    if spec is None:
        return build_model(qwen3_config(TRAIN_QWEN3, max_positions=max(seq_len, 2048)), dtype, seed)
    path = Path(spec)
    if path.is_file() and path.suffix == ".json":
        config = transformers.AutoConfig.from_pretrained(str(path))
        return build_model(config, dtype, seed)
    if path.is_dir():
        has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
        if has_weights:
            return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        return build_model(transformers.AutoConfig.from_pretrained(str(path)), dtype, seed)
    raise FileNotFoundError(f"--model {spec!r} is neither a model directory nor a config .json file")


def _lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to 10% of the peak rate."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class NonFiniteError(RuntimeError):
    """A training step produced a loss or gradient that is not finite."""


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this PyTorch has no CUDA device (torch {torch.__version__})")
    return device


def _run_settings(cfg: TrainConfig, world: int) -> dict:
    """What a run is (run.json, what --resume must match): the config and the number of processes
    (which splits the data and sizes the step)."""
    return {**asdict(cfg), "world_size": world}


def _prepare_out(cfg: TrainConfig, world: int = 1) -> Path:
    """The run folder: refuse to overwrite a run silently, or to resume it with other settings."""
    out = Path(cfg.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise ValueError(f"--out {cfg.out}: cannot make a folder there ({e.strerror})") from None
    saved = checkpoints.read_run(out)
    if cfg.resume:
        if saved is None:
            raise FileNotFoundError(f"--resume: no run in {out}")
        checkpoints.check_resumable(saved, _run_settings(cfg, world))
    elif checkpoints.has_run(out):
        if not cfg.overwrite:
            done = checkpoints.latest(out)
            at = f" (checkpoint at step {int(done.name.split('-')[1])})" if done else ""
            raise ValueError(f"{out} already holds a run{at}; pass --resume to continue it, --overwrite to replace "
                             "it, or another --out")
        checkpoints.clear_run(out)
    return out


def record_run(out: Path, cfg: TrainConfig, world: int = 1) -> None:
    """Written once the model and data have loaded, so that a run that never started leaves none."""
    checkpoints.write_atomic(out / checkpoints.RUN, json.dumps(_run_settings(cfg, world), indent=1))


def save_checkpoint(out: Path, engine: Engine, state: dict, keep: int) -> Path:
    """The engine's checkpoint plus the loop's state, crash-safe (every rank writes its part)."""
    bad = next((name for name, p in engine.model.named_parameters()  # a non-finite weight never reaches a checkpoint
                if not torch.isfinite(_local(p)).all()), None)
    bad = engine.first_error(bad)
    if bad is not None:
        raise NonFiniteError(f"step {state['step']}: parameter {bad} is not finite; not saving a checkpoint")
    if engine.is_main:
        checkpoints.begin(out, state["step"])
    engine.barrier()
    tmp = checkpoints.temp_folder(out, state["step"])
    engine.save(tmp)
    if engine.is_main:
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
    engine.barrier()
    final = checkpoints.finish(out, state["step"], tmp, keep) if engine.is_main else None
    engine.barrier()
    return final


def _local(p: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds: an FSDP2 shard, a ZeRO-3 partition, or all of it."""
    if hasattr(p, "to_local"):
        return p.to_local()
    return p.ds_tensor if hasattr(p, "ds_tensor") else p


def _log_upto(path: Path, step: int, header: list[str]) -> None:
    """Keep the log rows of steps <= ``step`` (rows written after the last checkpoint are redone)."""
    rows = list(csv.reader(path.open())) if path.exists() else []
    kept = [header] + [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= step]
    buffer = io.StringIO()
    csv.writer(buffer).writerows(kept)
    checkpoints.write_atomic(path, buffer.getvalue())


LOG_HEADER = ["step", "loss", "lr", "tokens_per_s", "peak_mib", "activation_mib"]


def train(cfg: TrainConfig, progress: bool = True) -> dict:
    engine = make_engine(cfg.engine, _device(cfg.device))  # (joins the process group of a multi-process run)
    device = engine.device
    out = Path(cfg.out)
    error = None
    if engine.is_main:  # one process decides about the run folder; all stop if it refuses
        try:
            out = _prepare_out(cfg, engine.world)
        except (ValueError, FileNotFoundError) as e:
            error = e
    message = engine.first_error(None if error is None else str(error))
    if error is not None:
        raise error
    if message is not None:
        raise ValueError(message)
    dtype = DTYPES[cfg.dtype]
    state = {"step": 0, "losses": [], "skipped": [], "config": asdict(cfg)}
    # a run that died before its first checkpoint starts again from step 0, with its own settings
    resume_from = checkpoints.latest(out) if cfg.resume and cfg.objective == "lm" else None
    if resume_from is not None and engine.transformers_weights:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(resume_from), dtype=dtype)
    else:
        model = load_model(cfg.model, cfg.seq_len, dtype, cfg.seed)
    if resume_from is not None:
        state = json.loads((resume_from / "trainer_state.json").read_text())
        state.setdefault("skipped", [])
    model.to(device).train()
    tokenizer = load_tokenizer(cfg.model, model.config.vocab_size)
    if cfg.objective != "lm":
        if cfg.approx != "none":
            approx(model, activations=cfg.approx in ("act", "both"), norms=cfg.approx in ("norm", "both"))
        from ._train_trl import train_trl

        return train_trl(cfg, model, tokenizer, progress=progress)
    data = TokenData(tokenizer, cfg.data, cfg.seq_len, seed=cfg.seed)
    if cfg.approx != "none":
        approx(model, activations=cfg.approx in ("act", "both"), norms=cfg.approx in ("norm", "both"))
    if cfg.stream:
        stream(model, chunk_size=cfg.chunk_size, head_chunk_size=cfg.head_chunk_size, offload=cfg.offload)
    engine.prepare(model, cfg.lr, cfg.weight_decay)
    if resume_from is not None:
        engine.load(resume_from)
    log = writer = None
    if engine.is_main:
        record_run(out, cfg, engine.world)
        log_path = out / checkpoints.LOG
        _log_upto(log_path, state["step"], LOG_HEADER)
        log = open(log_path, "a", newline="")
        writer = csv.writer(log)
    bar = tqdm(range(state["step"], cfg.steps), initial=state["step"], total=cfg.steps,
               disable=not (progress and engine.is_main), desc="leanbp train", unit="step")
    try:
        for step in bar:
            lr = _lr_at(step, cfg)
            engine.set_lr(lr)
            # each rank its own micro-batches (rank 0 of one process: the same as ever)
            batches = [data.batch(step, engine.rank * cfg.grad_accum + m, cfg.batch_size) for m in range(cfg.grad_accum)]
            # transformers' convention: every micro-batch divides by the step's total label count; the
            # engines average gradients over ranks, so each rank divides by that count / world size
            n_items = int(engine.sum(sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)))
            denominator = (torch.tensor(n_items, device=device) if engine.world == 1 else
                           torch.tensor(n_items / engine.world, dtype=torch.promote_types(dtype, torch.float32),
                                        device=device))
            t0 = time.perf_counter()
            loss_sum, grad_norm, mem = 0.0, 0.0, None
            if n_items:
                with memory.track(engine.model, device=device) if _trackable(engine) else nullcontext() as mem:
                    for b in batches:
                        b = {k: v.to(device) for k, v in b.items()}
                        loss = engine.module(**b, num_items_in_batch=denominator).loss
                        engine.backward(loss)
                        loss_sum += loss.item()
                grad_norm = engine.clip()
            loss_sum = engine.sum(loss_sum) / engine.world
            skip = _skip_reason(step, n_items, loss_sum, grad_norm, cfg.skip_nonfinite)
            if skip:
                engine.skip()
                state["skipped"].append(step + 1)
                if engine.is_main:
                    tqdm.write(skip, file=sys.stderr)
            else:
                engine.step()
            seconds = time.perf_counter() - t0
            tokens = engine.sum(sum(int(b["attention_mask"].sum()) for b in batches))
            report = mem.report.as_mib() if mem is not None else {"peak": float("nan"), "activations": float("nan")}
            loss_value = loss_sum if not skip else float("nan")
            state["step"] = step + 1
            state["losses"].append(loss_value)
            if engine.is_main:
                writer.writerow([step + 1, f"{loss_value:.5f}", f"{lr:.3e}", f"{tokens / seconds:.1f}",
                                 f"{report['peak']:.1f}", f"{report['activations']:.1f}"])
                log.flush()
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tokens / seconds:.0f}", peak_mib=f"{report['peak']:.0f}",
                            **({"chunk": chunk_size_used(model)} if cfg.stream else {}))
            if state["step"] % cfg.save_every == 0 or state["step"] == cfg.steps:
                save_checkpoint(out, engine, state, cfg.keep)
    finally:
        if log is not None:
            log.close()
    if not engine.transformers_weights:  # its checkpoints are its own format: a transformers one to use
        engine.export(out / checkpoints.FINAL)
    if state["losses"] and engine.is_main:
        plot_losses(state["losses"], out / "loss.png")
    engine.close()
    return state


def _trackable(engine: Engine) -> bool:
    """The CPU tracker counts plain tensors' storages; sharded (DTensor, ZeRO-3) parameters it
    cannot see through are measured on CUDA only (allocator peaks)."""
    return engine.device.type == "cuda" or engine.name in ("single", "ddp")


def _skip_reason(step: int, n_items: int, loss: float, grad_norm: float | None, skip_nonfinite: bool) -> str | None:
    """Why this step makes no update (None: it does); raises on a non-finite step unless told to skip."""
    if not n_items:
        return (f"step {step + 1}: no labelled token in this step's batches (prompts longer than --seq-len, or "
                "empty completions?); skipped, the weights are unchanged")
    if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)):  # (None: DeepSpeed clips in its step)
        return None
    what = f"loss {loss} and gradient norm {grad_norm}"
    if skip_nonfinite:
        return f"step {step + 1}: {what}: not finite; skipped (--skip-nonfinite), the weights are unchanged"
    raise NonFiniteError(f"step {step + 1}: {what}: not finite. Stopped before the optimizer step: the weights and "
                         "the last checkpoint are intact. Lower --lr, or pass --skip-nonfinite to skip such steps.")


def plot_losses(losses: list[float], path: Path) -> None:
    """Loss against step (skipped steps are gaps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, marker="." if len(losses) < 50 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
