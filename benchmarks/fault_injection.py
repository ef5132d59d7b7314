"""kill -9 `leanbp train` at random moments over several runs, resume each, compare bit for bit.

    python benchmarks/fault_injection.py --runs 4 --kills 6 --out benchmarks/results/faults
    python benchmarks/fault_injection.py --nproc 2 --engine fsdp2 --target group --runs 2 --kills 5 \
        --out benchmarks/results/faults/fsdp2-group

Each run: one uninterrupted reference, then the same run killed ``--kills`` times at random
moments (start-up, training, checkpoint writes; checkpoints every step) and resumed until it
finishes. ``--target`` says what is killed: the leanbp process, its process group (the launcher
and torchrun's agent of ``--nproc``), or one rank. Writes summary.json: kills, kills that hit a
checkpoint write, processes alive 10 s after a kill, files written after a kill, how long the
launcher took to exit after a rank's kill and with what code, and whether the final weights
(sha256) and the loss log equal the reference.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from leanbp.testing import KILL_TARGETS, fingerprint, kill_and_resume, run_to_completion


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--kills", type=int, default=6, help="kills per run")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, help="processes of a multi-process run (leanbp train --nproc)")
    parser.add_argument("--engine", default="ddp", help="with --nproc: ddp, fsdp2, zero2 or zero3")
    parser.add_argument("--target", default="process", choices=KILL_TARGETS)
    parser.add_argument("--out", default="benchmarks/results/faults")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    for run in range(args.runs):
        train = ["train", "--seq-len", "64", "--chunk-size", "16", "--steps", str(args.steps), "--save-every", "1",
                 "--lr", "3e-3", "--seed", str(run), "--batch-size", str(1 + run % 2)]
        if args.nproc:
            train += ["--nproc", str(args.nproc), "--engine", args.engine]
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            run_to_completion([*train, "--out", f"{tmp}/reference"])
            report = kill_and_resume(train, Path(tmp) / "faulted", kills=args.kills, max_delay_s=9.0, rng=rng,
                                     target=args.target)
            same = fingerprint(Path(tmp) / "faulted") == fingerprint(Path(tmp) / "reference")
            rows.append({"run": run, "kills": report.kills, "launches": report.launches,
                         "kills_in_checkpoint_writes": report.kills_in_checkpoint_writes,
                         "kill_delays_s": report.delays, "orphans": report.orphans, "late_writes": report.late_writes,
                         "launcher_exits": report.launcher_exits, "bit_identical": same,
                         "seconds": round(time.time() - t0)})
            print(json.dumps(rows[-1]), flush=True)
    launch = f" --nproc {args.nproc} --engine {args.engine}" if args.nproc else ""
    summary = {"runs": rows, "target": args.target, "kills": sum(r["kills"] for r in rows),
               "kills_in_checkpoint_writes": sum(r["kills_in_checkpoint_writes"] for r in rows),
               "orphans": sum(r["orphans"] for r in rows), "late_writes": sum(len(r["late_writes"]) for r in rows),
               "launcher_exits": [e for r in rows for e in r["launcher_exits"]],
               "all_bit_identical": all(r["bit_identical"] for r in rows),
               "date": time.strftime("%Y-%m-%d"),
               "command": f"python benchmarks/fault_injection.py --runs {args.runs} --kills {args.kills} "
                          f"--steps {args.steps} --seed {args.seed}{launch} --target {args.target}"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("kills", "kills_in_checkpoint_writes", "orphans", "late_writes",
                                              "launcher_exits", "all_bit_identical")}))


if __name__ == "__main__":
    main()
