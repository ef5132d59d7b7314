"""Fault injection for `leanbp train`: kill -9 at random moments, resume, compare.

A run is started with the given arguments; after a random delay it is killed with SIGKILL (at any
moment: starting up, training, writing a checkpoint), then started again with ``--resume``, until a
launch finishes by itself. The result must equal an uninterrupted run bit for bit: the final
weights (``model.safetensors``) and the loss column of ``train_log.csv``.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class FaultReport:
    kills: int = 0
    launches: int = 0
    kills_in_checkpoint_writes: int = 0  # a kill that left a half-written checkpoint folder behind
    delays: list[float] = field(default_factory=list)


def _launch(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONWARNINGS="ignore", TQDM_DISABLE="1")
    return subprocess.Popen([sys.executable, "-m", "leanbp.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env)


def run_to_completion(args: list[str], timeout_s: float = 600) -> None:
    proc = _launch(args)
    _, err = proc.communicate(timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"leanbp {' '.join(args)} failed ({proc.returncode}): {err.decode()[-2000:]}")


def kill_and_resume(args: list[str], out: Path, kills: int, max_delay_s: float, rng: random.Random,
                    timeout_s: float = 900) -> FaultReport:
    """Run ``leanbp <args> --out OUT`` killing it ``kills`` times at random moments, then let it finish."""
    report = FaultReport()
    deadline = time.monotonic() + timeout_s
    while True:
        resume = ["--resume"] if (out / "run.json").exists() else []
        proc = _launch([*args, "--out", str(out), *resume])
        report.launches += 1
        if report.kills < kills:
            delay = rng.uniform(0.2, max_delay_s)
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                report.kills += 1
                report.delays.append(round(delay, 2))
                if any((out / "checkpoints").glob(".step-*.tmp")):
                    report.kills_in_checkpoint_writes += 1
                continue
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if proc.returncode != 0:
            raise RuntimeError(f"launch {report.launches} failed ({proc.returncode}): {err.decode()[-2000:]}")
        if report.kills >= kills:
            return report


def fingerprint(out: Path) -> tuple[str, list[tuple[str, str]]]:
    """(sha256 of the final weights, [(step, loss)] of the log)."""
    weights = hashlib.sha256((out / "checkpoint" / "model.safetensors").read_bytes()).hexdigest()
    rows = (out / "train_log.csv").read_text().splitlines()[1:]
    return weights, [tuple(r.split(",")[:2]) for r in rows]
