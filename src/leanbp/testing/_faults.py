"""Fault injection for `leanbp train`: kill -9 at random moments, resume, compare.

A run is started with the given arguments and killed with SIGKILL, then started again with
``--resume``, until a launch finishes by itself. Each kill comes either after a random delay (any
moment: starting up, training, writing a checkpoint) or, for every other kill, the moment a
checkpoint write is seen in progress (its temporary folder exists), so that writes are hit too. The result must equal an uninterrupted run bit for bit: the final
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


def _writing(out: Path, since: float) -> bool:
    """A checkpoint write by this launch is in progress: a temporary folder made after ``since``
    (one left by an earlier kill does not count)."""
    for tmp in (out / "checkpoints").glob(".step-*.tmp"):
        try:
            if tmp.stat().st_mtime >= since:
                return True
        except FileNotFoundError:  # renamed into place meanwhile
            pass
    return False


def _wait_for_write(proc: subprocess.Popen, out: Path, since: float, timeout_s: float) -> bool:
    """Poll until a checkpoint write is in progress (True) or the process ends / time runs out."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        if _writing(out, since):
            return True
        time.sleep(0.002)
    return False


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
    """Run ``leanbp <args> --out OUT``, killing it up to ``kills`` times, until a launch finishes."""
    report = FaultReport()
    deadline = time.monotonic() + timeout_s
    while True:
        resume = ["--resume"] if (out / "run.json").exists() else []
        launched = time.time()
        proc = _launch([*args, "--out", str(out), *resume])
        report.launches += 1
        if report.kills < kills:
            t0 = time.monotonic()
            if report.kills % 2:  # strike inside a checkpoint write
                alive = _wait_for_write(proc, out, launched, timeout_s=max_delay_s * 3)
            else:
                try:
                    proc.wait(timeout=rng.uniform(0.2, max_delay_s))
                except subprocess.TimeoutExpired:
                    pass
                alive = proc.poll() is None
            if alive:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                report.kills += 1
                report.delays.append(round(time.monotonic() - t0, 3))
                if _writing(out, launched):
                    report.kills_in_checkpoint_writes += 1
                continue
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if proc.returncode != 0:
            raise RuntimeError(f"launch {report.launches} failed ({proc.returncode}): {err.decode()[-2000:]}")
        return report  # the run finished (possibly before all kills were spent: the report says)


def fingerprint(out: Path) -> tuple[str, list[tuple[str, str]]]:
    """(sha256 of the final weights, [(step, loss)] of the log)."""
    weights = hashlib.sha256((out / "checkpoint" / "model.safetensors").read_bytes()).hexdigest()
    rows = (out / "train_log.csv").read_text().splitlines()[1:]
    return weights, [tuple(r.split(",")[:2]) for r in rows]
