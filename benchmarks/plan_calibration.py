"""How close is `leanbp plan` to a measured step? The planner's peak (fake tensors, depth and length
lines) against `leanbp.memory.track` on real tensors, for the bench model on this CPU.

    python benchmarks/plan_calibration.py --out benchmarks/results/plan_calibration

Every (method, T) runs the same training step (`leanbp.plan.training_step`: the loss and
its backward, outputs held through backward) once for real and is predicted once by the planner.
Writes calibration.csv / calibration.json and prints a table with the relative difference.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from leanbp import StreamConfig
from leanbp.bench import bench_config, build_case_model, machine
from leanbp.memory import MemoryReport, MiB, track
from leanbp.plan import Planner, training_step
from leanbp.streaming import PLANNED


def measured(method: str, T: int, stream: StreamConfig) -> MemoryReport:
    """The step on real tensors (the bench case's model: fp32, batch 1), measured by the live-bytes tracker."""
    model, config = build_case_model({"method": method, "seq_len": T, "stream": asdict(stream)})
    for p in model.parameters():  # steady state: gradients resident, as the planner assumes
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    with track(model) as mem:
        training_step(model, ids)
    return mem.report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="2048,8192,16384")
    parser.add_argument("--methods", default=",".join(PLANNED))
    parser.add_argument("--chunk-size", type=int, default=StreamConfig().chunk_size)
    parser.add_argument("--head-chunk-size", type=int, default=StreamConfig().head_chunk_size)
    parser.add_argument("--out", default="plan_calibration")
    args = parser.parse_args()
    seq_lens = [int(t) for t in args.seq_lens.split(",")]
    methods = args.methods.split(",")

    stream = StreamConfig(chunk_size=args.chunk_size, head_chunk_size=args.head_chunk_size)
    planner = Planner(bench_config("qwen3", max_positions=2048), dtype="fp32", stream=stream)
    rows = []
    for method in methods:
        for T in seq_lens:
            t0 = time.perf_counter()
            by_probe = planner.peak(method, T, probe=True)  # a fake step at this T
            by_lines = planner.peak(method, T)  # the phases' lines (a fake step when T is below their range)
            plan_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            real = measured(method, T, stream)
            rows.append({"method": method, "seq_len": T, "measured_act_mib": real.activations / MiB,
                         "planned_act_mib": by_probe.activations / MiB, "lines_act_mib": by_lines.activations / MiB,
                         "measured_host_mib": real.host / MiB, "planned_host_mib": by_probe.host / MiB,
                         "measured_peak_mib": real.peak / MiB, "planned_peak_mib": (by_probe.total) / MiB,
                         "rel_diff_peak": by_probe.total / real.peak - 1,
                         "rel_diff_act": by_probe.activations / real.activations - 1,
                         "rel_diff_lines": by_lines.total / real.peak - 1, "phase": by_probe.phase,
                         "plan_s": plan_s, "measure_s": time.perf_counter() - t0})
            r = rows[-1]
            print(f"{method:15s} T={T:6d} measured act {r['measured_act_mib']:9.1f} MiB  planned {r['planned_act_mib']:9.1f}"
                  f"  lines {r['lines_act_mib']:9.1f}  diff {100 * r['rel_diff_act']:+.3f}%  ({r['phase']})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "calibration.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "calibration.json").write_text(json.dumps({"args": vars(args), "machine": machine(), "rows": rows}, indent=1))
    worst = max(abs(r["rel_diff_act"]) for r in rows)
    print(f"worst relative difference in activation memory: {100 * worst:.3f}%")


if __name__ == "__main__":
    main()
