"""Fault injection for `leanbp train`: kill -9 at random moments, resume, compare.

A run is started with the given arguments and killed with SIGKILL, then started again with
``--resume``, until a launch finishes by itself. Each kill comes either after a random delay (any
moment: starting up, training, writing a checkpoint) or, for every other kill, the moment a
checkpoint write is seen in progress (its temporary folder exists), so that writes are hit too. The
result must equal an uninterrupted run bit for bit: the final weights (``model.safetensors``) and
the loss column of ``train_log.csv``.

What is killed (``target``):

    process   the ``leanbp`` process (one process, or the launcher of ``--nproc``)
    group     its process group (the launcher and torchrun's agent: what a shell's ``kill -9`` of a
              job, a watchdog or the OOM killer's choice of the launcher does); the ranks, each in
              a session of its own, must die with them
    rank      one rank of a ``--nproc`` run, at random; the others and the launcher must end

After each kill the report records the processes of the launch still alive 10 s later (they are
killed then, so the run can go on), files written in OUT after the kill, and for a killed rank how
long the launcher took to exit and with what code.
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


KILL_TARGETS = ("process", "group", "rank")
ORPHAN_WAIT_S = 10.0  # how long the processes of a launch may outlive a kill


@dataclass
class FaultReport:
    kills: int = 0
    launches: int = 0
    kills_in_checkpoint_writes: int = 0  # a kill that left a half-written checkpoint folder behind
    delays: list[float] = field(default_factory=list)
    orphans: int = 0  # processes of a launch alive ORPHAN_WAIT_S after a kill
    late_writes: list[str] = field(default_factory=list)  # files in OUT written after a kill
    launcher_exits: list[tuple[float, int]] = field(default_factory=list)  # (s after a rank's kill, exit code)


def _child_map() -> dict[int, list[int]]:
    """Every process's children, read once from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # (ended meanwhile)
            continue
        parent = int(text.rsplit(")", 1)[1].split()[1])  # (the command in parentheses may hold spaces)
        children.setdefault(parent, []).append(int(stat.parent.name))
    return children


def descendants(pid: int) -> list[int]:
    """The processes started by ``pid``, at any depth (Linux: read from /proc)."""
    children = _child_map()
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # (a zombie has ended; its parent has not reaped it yet)


def _ranks(launcher: int) -> list[int]:
    """The ranks of a ``--nproc`` launch: the children of torchrun's agent, the launcher's child
    only (not a process a rank starts itself: killing one of those ends no launch)."""
    children = _child_map()
    return [rank for agent in children.get(launcher, []) for rank in children.get(agent, [])]


def _written_after(out: Path, moment: float) -> list[str]:
    late = []
    for path in out.rglob("*"):
        try:
            if path.is_file() and path.stat().st_mtime > moment:
                late.append(str(path.relative_to(out)))
        except FileNotFoundError:
            pass
    return late


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
    # a session of its own, as a shell's job has its own process group
    return subprocess.Popen([sys.executable, "-m", "leanbp.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env, start_new_session=True)


def run_to_completion(args: list[str], timeout_s: float = 600) -> None:
    proc = _launch(args)
    _, err = proc.communicate(timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"leanbp {' '.join(args)} failed ({proc.returncode}): {err.decode()[-2000:]}")


def kill_and_resume(args: list[str], out: Path, kills: int, max_delay_s: float, rng: random.Random,
                    timeout_s: float = 900, target: str = "process") -> FaultReport:
    """Run ``leanbp <args> --out OUT``, killing it (``target``) up to ``kills`` times, until a
    launch finishes."""
    if target not in KILL_TARGETS:
        raise ValueError(f"target must be one of {KILL_TARGETS}, got {target!r}")
    report = FaultReport()
    deadline = time.monotonic() + timeout_s
    while True:
        resume = ["--resume"] if (out / "run.json").exists() else []
        launched = time.time()
        proc = _launch([*args, "--out", str(out), *resume])
        report.launches += 1
        if report.kills < kills:
            t0 = time.monotonic()
            if report.kills % 2:  # strike inside a checkpoint write: wait for one however long the
                # launch takes to start (2 ranks importing torch on 2 busy cores can take 20 s before
                # their first write; a wait bounded by the delays missed every write there)
                alive = _wait_for_write(proc, out, launched, timeout_s=deadline - time.monotonic())
            else:
                try:
                    proc.wait(timeout=rng.uniform(0.2, max_delay_s))
                except subprocess.TimeoutExpired:
                    pass
                alive = proc.poll() is None
            if alive and _strike(proc, out, target, rng, report):
                report.kills += 1
                report.delays.append(round(time.monotonic() - t0, 3))
                if _writing(out, launched):
                    report.kills_in_checkpoint_writes += 1
                continue
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if proc.returncode != 0:
            raise RuntimeError(f"launch {report.launches} failed ({proc.returncode}): {err.decode()[-2000:]}")
        return report  # the run finished (possibly before all kills were spent: the report says)


def _strike(proc: subprocess.Popen, out: Path, target: str, rng: random.Random, report: FaultReport) -> bool:
    """Kill ``target`` of the launch ``proc``; wait for the launch to end and record what outlived
    the kill and what was written after it (after the launcher's exit, for a killed rank: the other
    ranks may finish a checkpoint they were writing together). False if there was nothing to kill
    (no rank yet: the launch goes on)."""
    launch = [proc.pid, *descendants(proc.pid)]
    if target == "rank":
        ranks, end = _ranks(proc.pid), time.monotonic() + 60
        while not ranks and proc.poll() is None and time.monotonic() < end:  # (still starting: strike once they run)
            time.sleep(0.05)
            ranks = _ranks(proc.pid)
        if not ranks:
            return False
        os.kill(rng.choice(ranks), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            proc.wait(timeout=ORPHAN_WAIT_S * 6)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        report.launcher_exits.append((round(time.monotonic() - t0, 3), proc.returncode))
        killed = time.time()
    else:
        killed = time.time()
        if target == "group":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait()
    proc.stderr.close()
    end = time.monotonic() + ORPHAN_WAIT_S
    while time.monotonic() < end and any(_alive(pid) for pid in launch):
        time.sleep(0.05)
    left = [pid for pid in launch if _alive(pid)]
    report.orphans += len(left)
    for pid in left:  # (so that the run can go on)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    report.late_writes += _written_after(out, killed + 0.2)
    return True


def fingerprint(out: Path) -> tuple[str, list[tuple[str, str]]]:
    """(sha256 of the final weights, [(step, loss)] of the log)."""
    final = out / "final" if (out / "final").is_dir() else out / "checkpoint"  # (engines with their own format export)
    weights = hashlib.sha256((final / "model.safetensors").read_bytes()).hexdigest()
    rows = (out / "train_log.csv").read_text().splitlines()[1:]
    return weights, [tuple(r.split(",")[:2]) for r in rows]
