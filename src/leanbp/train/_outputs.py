"""What a run leaves in its folder besides the checkpoints: ``run.json`` (what the run is, which a
``--resume`` must match), the loss log ``train_log.csv`` (a row per step: ``StepResult``) and its
plot ``loss.png``."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from . import _checkpoint as checkpoints
from ._config import TrainConfig
from ._run_lock import RunLock

LOG_HEADER = ["step", "loss", "lr", "tokens_per_s", "peak_mib", "activation_mib"]
PRIVATE_LOG_HEADER = LOG_HEADER + ["epsilon"]  # --optimizer dpzero: the privacy spent after the step


@dataclass
class StepResult:
    """What one optimizer step reports (a row of train_log.csv)."""

    loss: float  # nan for a skipped step
    lr: float
    tokens_per_s: float
    peak_mib: float  # nan where the step was not measured
    activation_mib: float
    skip: str | None  # why the step made no update
    epsilon: float | None = None  # dpzero: epsilon spent after this step


def check_run_folder(cfg: TrainConfig, world: int = 1) -> None:
    """Raise if the run folder may not take this run: it holds another run (without --resume or
    --overwrite), or --resume finds no run or one with other settings. Changes nothing."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {cfg.out}: cannot make a folder there (a file is in the way)")
    saved = checkpoints.read_run(out) if out.is_dir() else None
    if cfg.resume:
        if saved is None:
            raise FileNotFoundError(f"--resume: no run in {out}")
        checkpoints.check_resumable(saved, cfg.settings(world))
    elif out.is_dir() and checkpoints.has_run(out) and not cfg.overwrite:
        done = checkpoints.latest(out)
        at = f" (checkpoint at step {int(done.name.split('-')[1])})" if done else ""
        raise ValueError(f"{out} already holds a run{at}; pass --resume to continue it, --overwrite to replace "
                         "it, or another --out")


def prepare_run_folder(cfg: TrainConfig, world: int = 1, lock: RunLock | None = None) -> Path:
    """The run folder, made and held (``lock``, taken before anything in it is read or changed):
    refuse to overwrite a run silently, or to resume it with other settings."""
    out = Path(cfg.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise ValueError(f"--out {cfg.out}: cannot make a folder there ({e.strerror})") from None
    if lock is not None:
        lock.acquire()
    check_run_folder(cfg, world)
    if not cfg.resume and checkpoints.has_run(out):  # (--overwrite, or check_run_folder had refused)
        checkpoints.clear_run(out)
    return out


def record_run(out: Path, cfg: TrainConfig, world: int = 1) -> None:
    """Written once the model and data have loaded, so that a run that never started leaves none."""
    checkpoints.write_atomic(out / checkpoints.RUN, json.dumps(cfg.settings(world), indent=1))


class LossLog:
    """``train_log.csv``, one row per step, flushed as it is written. Rows of steps after ``step``
    (written after the last checkpoint, before a crash) are dropped first: they are redone."""

    def __init__(self, out: Path, step: int, header: list[str] = LOG_HEADER):
        path = out / checkpoints.LOG
        rows = list(csv.reader(path.open())) if path.exists() else []
        kept = [header] + [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= step]
        buffer = io.StringIO()
        csv.writer(buffer).writerows(kept)
        checkpoints.write_atomic(path, buffer.getvalue())
        self._file = open(path, "a", newline="")
        self._writer = csv.writer(self._file)

    def write(self, step: int, loss: float, lr: float, tokens_per_s: float, peak_mib: float,
              activation_mib: float, epsilon: float | None = None) -> None:
        row = [step, f"{loss:.5f}", f"{lr:.3e}", f"{tokens_per_s:.1f}", f"{peak_mib:.1f}", f"{activation_mib:.1f}"]
        self._writer.writerow(row + ([] if epsilon is None else [f"{epsilon:.4f}"]))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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
