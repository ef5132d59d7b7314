"""Multi-process runs die together, own their run folder, and fail with one clear line.

Every test here runs the real launcher (`leanbp train --nproc 2`, gloo, in a subprocess), or a
small tree of processes for the parent-death mechanism itself, which is tested both ways: with
Linux's parent-death signal and with the thread that watches the parent where the signal does
not exist (forced by tests/_forced_probes)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time

import pytest

from _helpers import forced_probes
from leanbp.cli import main
from leanbp.testing import descendants, fingerprint, kill_and_resume, run_to_completion
from leanbp.train import RunLock

TINY = ["train", "--seq-len", "48", "--chunk-size", "16", "--save-every", "1", "--lr", "3e-3"]


def _leanbp(*args, timeout=120, env=None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "leanbp", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)
    return proc, time.monotonic() - t0


# -- one clear error ---------------------------------------------------------------------------

def test_bad_inputs_under_nproc_are_one_line_before_any_rank_starts(tmp_path):
    (tmp_path / "torn.jsonl").write_text('{"text": "in the beginning"}\n{"text": "and the')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "short.txt").write_text("tiny")
    (tmp_path / "no_model").mkdir()
    (tmp_path / "no_model" / "notes.txt").write_text("not a model")
    cases = {"torn JSONL": (["--data", str(tmp_path / "torn.jsonl")], "torn.jsonl:2: not valid JSON"),
             "empty file": (["--data", str(tmp_path / "empty.jsonl")], "has no records"),
             "too little data": (["--data", str(tmp_path / "short.txt")], "fewer than seq_len"),
             "missing file": (["--data", str(tmp_path / "missing.txt")], "no such file"),
             "seq-len 0": (["--seq-len", "0"], "seq_len must be >= 1"),
             "no model": (["--model", str(tmp_path / "no_model")], "not a transformers model")}
    for name, (args, says) in cases.items():
        proc, seconds = _leanbp("train", "--nproc", "2", *args, "--out", str(tmp_path / "out"))
        lines = (proc.stdout + proc.stderr).splitlines()
        assert proc.returncode == 2, (name, proc.stderr)
        assert len(lines) <= 5 and [line for line in lines if "error:" in line] == [lines[0]], (name, lines)
        assert lines[0].startswith("leanbp train: error: ") and says in lines[0], (name, lines)
        assert seconds < 10, (name, seconds)
    assert not (tmp_path / "out").exists()  # (checked, nothing started, nothing written)


def test_an_error_the_ranks_meet_is_said_once_with_its_exit_code(tmp_path):
    # a step that goes non-finite (found by the ranks, not before): exit code 3, one line, no
    # torchrun report after it
    proc, _ = _leanbp(*TINY, "--nproc", "2", "--steps", "3", "--lr", "1e12", "--out", str(tmp_path / "nan"))
    err = proc.stderr.replace("\r", "\n")
    assert proc.returncode == 3, err[-3000:]
    assert err.count("leanbp train: stopped: step 2: loss") == 1, err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err and "exitcode" not in err, err[-3000:]
    # under a plain torchrun (no launcher to check first), the ranks' error is printed once
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "leanbp",
           "train", "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "plain")]
    err = subprocess.run(run, capture_output=True, text=True, timeout=120).stderr
    assert err.count("leanbp train: error: --data") == 1, err


# -- ranks die with their launcher ---------------------------------------------------------------

CHILD = textwrap.dedent("""
    import os, sys, time
    from leanbp.train._ranks import die_with_parent, parent_death_signal_available
    assert parent_death_signal_available() == (sys.argv[1] == "1")
    die_with_parent(os.getppid())
    print(os.getpid(), flush=True)
    time.sleep(60)
""")
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=sys.stdout)
    time.sleep(60)
""")


@pytest.mark.parametrize("pdeathsig", [True, False], ids=["parent-death-signal", "watching-thread"])
def test_a_process_dies_with_its_parent(pdeathsig):
    """The mechanism of the agent and every rank, both ways: killing the parent kills the child
    within a second, and a child whose parent is alive lives."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, "1" if pdeathsig else "0"], stdout=subprocess.PIPE,
                              text=True, env=forced_probes(pdeathsig=pdeathsig))
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)
        assert child in descendants(parent.pid)  # (armed, parent alive: it lives)
        parent.kill()
        parent.wait()
        end = time.monotonic() + 3
        while time.monotonic() < end and _running(child):
            time.sleep(0.02)
        assert not _running(child)
    finally:
        parent.kill()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs, one per engine."""
    found = {}
    for engine in ("ddp", "fsdp2"):
        out = tmp_path_factory.mktemp(f"reference-{engine}")
        run_to_completion([*TINY, "--nproc", "2", "--engine", engine, "--steps", "8", "--out", str(out)])
        found[engine] = fingerprint(out)
    return found


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_killing_the_launchers_group_leaves_no_rank_and_resumes_bit_identically(tmp_path, references, engine):
    args = [*TINY, "--nproc", "2", "--engine", engine, "--steps", "8"]
    report = kill_and_resume(args, tmp_path / "run", kills=2, max_delay_s=7.0, rng=random.Random(3), target="group")
    assert report.kills == 2 and report.orphans == 0 and report.late_writes == [], report
    assert fingerprint(tmp_path / "run") == references[engine]


def test_killing_one_rank_ends_the_launch_and_resumes_bit_identically(tmp_path, references):
    args = [*TINY, "--nproc", "2", "--engine", "ddp", "--steps", "8"]
    report = kill_and_resume(args, tmp_path / "run", kills=1, max_delay_s=7.0, rng=random.Random(5), target="rank")
    assert report.kills == 1 and report.orphans == 0, report
    (seconds, code), = report.launcher_exits
    assert code != 0 and seconds < 10, report  # (gloo sees the peer gone at once; the collective timeout is 30 min)
    assert fingerprint(tmp_path / "run") == references["ddp"]


# -- one run folder, one owner -----------------------------------------------------------------

def test_a_second_run_on_a_folder_in_use_is_refused_and_the_first_is_unharmed(tmp_path, references, capsys):
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "leanbp", *TINY, "--nproc", "2", "--engine", "ddp", "--steps", "8",
                              "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 60
        while not (out / "train_log.csv").exists() and time.monotonic() < end:
            time.sleep(0.05)
        holder = RunLock(out).path.read_text()
        for extra in ([], ["--resume"], ["--overwrite"], ["--nproc", "2"]):  # (in this process: quick enough
            t0 = time.monotonic()                                            # to try all while the first runs)
            assert main([*TINY, "--steps", "8", "--out", str(out), *extra]) == 2
            err = capsys.readouterr().err
            assert time.monotonic() - t0 < 5
            assert f"{out} is in use by a running leanbp train (pid " in err, (extra, err)
            assert f"launched by `leanbp train --nproc` as pid {first.pid}" in err, err
        assert first.poll() is None, "the first run ended before every second run was tried"
        assert first.wait(timeout=120) == 0, first.stderr.read()[-2000:]
    finally:
        first.kill()
    assert '"rank": 0' in holder
    assert fingerprint(out) == references["ddp"]


@pytest.mark.parametrize("objective", ["lm", "sft"])
def test_a_held_run_folder_refuses_every_objective(tmp_path, capsys, objective):
    if objective != "lm":
        pytest.importorskip("trl")
    out = tmp_path / "run"
    with RunLock(out):
        assert main(["train", "--objective", objective, "--steps", "1", "--out", str(out), "--overwrite"]) == 2
    assert f"(pid {os.getpid()} on " in capsys.readouterr().err
    assert not (out / "run.json").exists()  # (refused before anything was read or written)


def test_a_stale_lock_never_blocks_and_unlockable_filesystems_warn(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".leanbp.lock").write_text('{"pid": 1, "host": "gone"}\n')  # (left by a run that died)
    with RunLock(out) as lock:
        assert lock.held and '"pid": 1,' not in lock.path.read_text()
    RunLock.check_free(out)

    import errno
    import fcntl

    def refuses(file, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuses)
    with pytest.warns(UserWarning, match="refuses file locks"):
        lock = RunLock(out).acquire()
    assert not lock.held
