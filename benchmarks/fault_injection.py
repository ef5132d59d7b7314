"""kill -9 `leanbp train` at random moments over several runs, resume each, compare bit for bit.

    python benchmarks/fault_injection.py --runs 4 --kills 6 --out benchmarks/results/faults

Each run: one uninterrupted reference, then the same run killed ``--kills`` times at random
moments (start-up, training, checkpoint writes; checkpoints every step) and resumed until it
finishes. Writes summary.json: kills, kills that hit a checkpoint write, and whether the final
weights (sha256) and the loss log equal the reference.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from leanbp.testing import fingerprint, kill_and_resume, run_to_completion


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--kills", type=int, default=6, help="kills per run")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/faults")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    for run in range(args.runs):
        train = ["train", "--seq-len", "64", "--chunk-size", "16", "--steps", str(args.steps), "--save-every", "1",
                 "--lr", "3e-3", "--seed", str(run), "--batch-size", str(1 + run % 2)]
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            run_to_completion([*train, "--out", f"{tmp}/reference"])
            report = kill_and_resume(train, Path(tmp) / "faulted", kills=args.kills, max_delay_s=9.0, rng=rng)
            same = fingerprint(Path(tmp) / "faulted") == fingerprint(Path(tmp) / "reference")
            rows.append({"run": run, "kills": report.kills, "launches": report.launches,
                         "kills_in_checkpoint_writes": report.kills_in_checkpoint_writes,
                         "kill_delays_s": report.delays, "bit_identical": same, "seconds": round(time.time() - t0)})
            print(json.dumps(rows[-1]), flush=True)
    summary = {"runs": rows, "kills": sum(r["kills"] for r in rows),
               "kills_in_checkpoint_writes": sum(r["kills_in_checkpoint_writes"] for r in rows),
               "all_bit_identical": all(r["bit_identical"] for r in rows),
               "command": f"python benchmarks/fault_injection.py --runs {args.runs} --kills {args.kills} "
                          f"--steps {args.steps} --seed {args.seed}"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("kills", "kills_in_checkpoint_writes", "all_bit_identical")}))


if __name__ == "__main__":
    main()
