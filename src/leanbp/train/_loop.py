"""``leanbp train``: a complete training loop on a streamed model, with checkpoints and resume.

    train(cfg) = open the run folder -> load the model (and the state to resume) -> prepare it
                 (approx, stream, the engine) -> one step at a time, a checkpoint every save_every
                 -> finish (export, plot)

``--objective sft|dpo|grpo`` hands the prepared model to TRL's trainer instead (``_trl.py``);
``--optimizer dpzero`` takes DPZero's private two-forward steps instead of backprop and AdamW
(``_zo.py``), and stops early, saying so, where its privacy budget would be exceeded.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from tqdm import tqdm

from .._dtypes import dtype_named
from ..approx import approx, variant_settings
from ..engine import IGNORE_INDEX
from ..memory import track
from ..streaming import chunk_size_used, sequence_batch, stream
from . import _checkpoint as checkpoints
from ._config import NonFiniteError, TrainConfig
from ._data import TokenData, load_tokenizer
from ._engines import Engine, make_engine
from ._models import load_model
from ._outputs import (LOG_HEADER, PRIVATE_LOG_HEADER, LossLog, StepResult, plot_losses, prepare_run_folder,
                       record_run)
from ._ranks import die_with_torchrun, launched_by_torchrun
from ._run_lock import RunLock
from ._trl import train_trl
from ._zo import PrivateRun


def train(cfg: TrainConfig, progress: bool = True) -> dict:
    """Run ``cfg``; returns the loop's state ({"step", "losses", "skipped", ...})."""
    if launched_by_torchrun():
        die_with_torchrun()  # (no rank outlives its launcher)
    # (joins the process group of a multi-process run)
    engine = make_engine(cfg.engine, _device(cfg.device), cfg.optimizer, schedule=cfg.schedule,
                         microbatches=cfg.grad_accum, stages=cfg.stages)
    lock = RunLock(cfg.out)  # held by the main rank from before it reads OUT until the run ends
    try:
        return _run(cfg, engine, open_run(cfg, engine, lock), progress)
    finally:
        lock.release()


def _run(cfg: TrainConfig, engine: Engine, out: Path, progress: bool) -> dict:
    model, state, resume_from = load(cfg, engine, out)
    tokenizer = load_tokenizer(cfg.model, model.config.vocab_size)
    if cfg.approx != "none":
        approx(model, **variant_settings(cfg.approx))
    if cfg.objective != "lm":
        return train_trl(cfg, model, tokenizer, progress=progress)
    data = TokenData(tokenizer, cfg.data, cfg.seq_len, seed=cfg.seed)
    if cfg.stream is not None:
        stream(model, cfg.stream, sequence_parallel=_sequence_group(cfg, engine))
    engine.prepare(model, cfg.lr, cfg.weight_decay)
    if resume_from is not None:
        engine.load(resume_from)
    private = PrivateRun(cfg, model, data, state, engine.device) if cfg.optimizer == "dpzero" else None
    log = None
    if engine.is_main:
        record_run(out, cfg, engine.world)
        log = LossLog(out, state["step"], LOG_HEADER if private is None else PRIVATE_LOG_HEADER)
    bar = tqdm(range(state["step"], cfg.steps), initial=state["step"], total=cfg.steps,
               disable=not (progress and engine.is_main), desc="leanbp train", unit="step")
    saved = state["step"]
    try:
        for step in bar:
            if private is not None and (stop := private.budget_spent(step)):
                state["stopped"] = stop
                tqdm.write(stop, file=sys.stderr)
                break
            result = private.step(step, _lr_at(step, cfg)) if private else train_step(cfg, engine, data, step)
            if result.skip:
                state["skipped"].append(step + 1)
                if engine.is_main:
                    tqdm.write(result.skip, file=sys.stderr)
            state["step"] = step + 1
            state["losses"].append(result.loss)
            if log is not None:
                log.write(step + 1, result.loss, result.lr, result.tokens_per_s, result.peak_mib, result.activation_mib,
                          result.epsilon)
            bar.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{result.tokens_per_s:.0f}",
                            # (no figure where the step is not measured: DeepSpeed's engines)
                            **({} if math.isnan(result.peak_mib) else {"peak_mib": f"{result.peak_mib:.0f}"}),
                            **({"chunk": chunk_size_used(model)} if cfg.stream is not None else {}),
                            **({"eps": f"{result.epsilon:.3f}"} if result.epsilon is not None else {}))
            if state["step"] % cfg.save_every == 0 or state["step"] == cfg.steps:
                save_checkpoint(out, engine, state, cfg.keep)
                saved = state["step"]
        if state["step"] != saved:  # (a run stopped early by its privacy budget keeps its last step)
            save_checkpoint(out, engine, state, cfg.keep)
    finally:
        bar.close()  # (so that a message of why the run stopped starts on a line of its own)
        if log is not None:
            log.close()
    finish(engine, out, state)
    return state


def open_run(cfg: TrainConfig, engine: Engine, lock: RunLock) -> Path:
    """The run folder, decided and held (``lock``) by the main process; every process stops if it
    refuses."""
    out, error = Path(cfg.out), None
    if engine.is_main:
        try:
            out = prepare_run_folder(cfg, engine.world, lock)
        except (ValueError, FileNotFoundError) as e:
            error = e
    message = engine.first_error(None if error is None else str(error))
    if error is not None:
        raise error
    if message is not None:
        raise ValueError(message)
    return out


def load(cfg: TrainConfig, engine: Engine, out: Path):
    """(the model on the engine's device, in training mode; the loop's state; the checkpoint to
    resume from, or None). A run that died before its first checkpoint starts again from step 0."""
    dtype = dtype_named(cfg.dtype)
    state = {"step": 0, "losses": [], "skipped": [], "config": cfg.settings(engine.world)}
    resume_from = checkpoints.latest(out) if cfg.resume and cfg.objective == "lm" else None
    if resume_from is not None and engine.transformers_weights:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(resume_from), dtype=dtype)
    else:
        model = load_model(cfg.model, cfg.seq_len, dtype, cfg.seed)
    if resume_from is not None:
        state = json.loads((resume_from / "trainer_state.json").read_text())
        state.setdefault("skipped", [])
    return model.to(engine.device).train(), state, resume_from


def _sequence_group(cfg: TrainConfig, engine: Engine):
    """--sp P: the process group of this rank's P consecutive ranks (every rank makes every group, as
    ``new_group`` requires), or None."""
    if cfg.sp == 1:
        return None
    if engine.world % cfg.sp:
        raise ValueError(f"--sp {cfg.sp} must divide the number of processes, {engine.world}")
    groups = [dist.new_group(list(range(first, first + cfg.sp))) for first in range(0, engine.world, cfg.sp)]
    return groups[engine.rank // cfg.sp]


def train_step(cfg: TrainConfig, engine: Engine, data: TokenData, step: int) -> StepResult:
    """One optimizer step: each rank's micro-batches, forward and backward, clip, step (or skip)."""
    device = engine.device
    lr = _lr_at(step, cfg)
    engine.set_lr(lr)
    # each rank its own micro-batches (rank 0 of one process: the same as ever); under --sp, each
    # group of P ranks the same ones, of which each rank takes its rows; a pipeline's stages all
    # the same ones
    sharers = cfg.sp * engine.batch_sharers
    shard = engine.rank // sharers
    batches = [data.batch(step, shard * cfg.grad_accum + m, cfg.batch_size) for m in range(cfg.grad_accum)]
    # transformers' convention: every micro-batch divides by the step's total label count; the
    # engines average gradients over ranks, so each rank divides by that count / world size (under
    # --sp the P ranks of a group each count their group's batches: the sum counts them P times;
    # each rank's loss is its group's, of which its backward carries its rows' share, and the
    # engine's average of the ranks' gradients sums the shares)
    n_items = int(engine.sum(sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches))) // sharers
    averaged = engine.averaged_ranks
    denominator = (torch.tensor(n_items, device=device) if averaged == 1 else
                   torch.tensor(n_items / averaged,
                                dtype=torch.promote_types(dtype_named(cfg.dtype), torch.float32), device=device))
    t0 = time.perf_counter()
    loss_sum, grad_norm, mem = 0.0, 0.0, None
    if n_items:
        with track(engine.model, device=device) if _trackable(engine) else nullcontext() as mem:
            rows = [sequence_batch(engine.model, **b) for b in batches] if cfg.sp > 1 else batches
            loss_sum = engine.forward_backward(rows, denominator)
        grad_norm = engine.clip()
    # (the P ranks of a group each hold its loss; a pipeline's stages each hold the step's)
    loss_sum = engine.sum(loss_sum) / engine.world / cfg.sp
    skip = _skip_reason(step, n_items, loss_sum, grad_norm, cfg.skip_nonfinite)
    if skip:
        engine.skip()
    else:
        engine.step()
    seconds = time.perf_counter() - t0
    tokens = engine.sum(sum(int(b["attention_mask"].sum()) for b in batches)) / sharers
    report = mem.report.as_mib() if mem is not None else {"peak": float("nan"), "activations": float("nan")}
    return StepResult(loss=loss_sum if not skip else float("nan"), lr=lr, tokens_per_s=tokens / seconds,
                      peak_mib=report["peak"], activation_mib=report["activations"], skip=skip)


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


def finish(engine: Engine, out: Path, state: dict) -> None:
    """After the last step: a transformers checkpoint where the engine saves its own format, the
    loss plot, and the engine's process group released."""
    if not engine.transformers_weights:
        engine.export(out / checkpoints.FINAL)
    if state["losses"] and engine.is_main:
        plot_losses(state["losses"], out / "loss.png")
    engine.close()


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this PyTorch has no CUDA device (torch {torch.__version__})")
    return device


def _lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to 10% of the peak rate."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _local(p: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds: an FSDP2 shard, a ZeRO-3 partition, or all of it."""
    if hasattr(p, "to_local"):
        return p.to_local()
    return p.ds_tensor if hasattr(p, "ds_tensor") else p


def _trackable(engine: Engine) -> bool:
    """The CPU tracker counts plain tensors' storages; sharded (DTensor, ZeRO-3) parameters it
    cannot see through are measured on CUDA only (allocator peaks)."""
    return engine.device.type == "cuda" or engine.name in ("single", "ddp", "pipeline")


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
