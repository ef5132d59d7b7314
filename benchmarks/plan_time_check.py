"""Does the step-time model of `leanbp plan` predict a measured step? On this CPU: the model fed the
CPU's own measured matmul rate and memory bandwidth (efficiency 1), against the step times `leanbp
bench` measured on this machine (checkpointing and leanbp at 8192 and 16384 tokens, the bench
model: Qwen3-shaped, hidden 512, 4 layers, vocab 32000, fp32, batch 1).

    python benchmarks/plan_time_check.py --bench benchmarks/results/peers/bench_peers.json \
        --out benchmarks/results/plan_time

For each (method, T) the planner runs the fake step at that T and counts its work (the FLOPs of
its products and attention kernels, the bytes of its other ops: `leanbp.plan.WorkCounter`); with
`--real` the same counter also runs over a real step of the bench model, and the two FLOP counts are
compared. The prediction is the time of the products and attention calls + bytes / bandwidth +
exp/log elements / transcendental rate + fresh large results / fresh-page rate (`leanbp.plan.step_time`
with the measured CPU as the device). The calls are timed two ways: each distinct call of the fake
step remade on random operands of its shapes and timed alone (`leanbp.plan.time_calls`: a CPU's rate
depends on the shapes), and, as the one-rate column, all products at the 2048-cubed product's rate
and all attention at the flash kernel's rate measured at one shape. Writes time_check.csv /
time_check.json / time_check.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from leanbp import StreamConfig
from leanbp.bench import bench_config, build_case_model, machine
from leanbp.plan import Planner, Setup, WorkCounter, measure_cpu, step_time, time_calls, training_step


def measured_times(paths: list[str]) -> dict:
    """{(method, T): [step seconds, ...]} from `leanbp bench` JSON files (every round's row)."""
    found: dict = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        for row in data["rows"]:
            if row.get("error") or row.get("step_s") is None:
                continue
            found.setdefault((row["method"], row["seq_len"]), []).append(row["step_s"])
    return found


def real_flops(method: str, T: int, stream: StreamConfig) -> float:
    """The work counter over a real step of the bench model (as `leanbp bench` builds it)."""
    model, config = build_case_model({"method": method, "seq_len": T, "stream": {
        "chunk_size": stream.chunk_size, "head_chunk_size": stream.head_chunk_size}})
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    with WorkCounter() as counter:
        training_step(model, ids)
    return counter.work.flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", default="benchmarks/results/peers/bench_peers.json",
                        help="comma-separated leanbp bench JSON files measured on this machine")
    parser.add_argument("--seq-lens", default="8192,16384")
    parser.add_argument("--methods", default="ckpt,leanbp")
    parser.add_argument("--chunk-size", type=int, default=StreamConfig().chunk_size)
    parser.add_argument("--head-chunk-size", type=int, default=StreamConfig().head_chunk_size)
    parser.add_argument("--real", action="store_true", help="also count the FLOPs of a real step (slow)")
    parser.add_argument("--out", default="plan_time")
    args = parser.parse_args()

    stream = StreamConfig(chunk_size=args.chunk_size, head_chunk_size=args.head_chunk_size)
    config = bench_config("qwen3", max_positions=2048)
    cpu = measure_cpu(torch.float32, heads=(config.num_attention_heads, config.num_key_value_heads),
                      head_dim=config.head_dim)
    rates = (f"matmul {cpu.flops['fp32'] / 1e9:.1f} GFLOP/s (fp32, 2048^3), attention {cpu.attention['fp32'] / 1e9:.1f} "
             f"GFLOP/s (flash forward + backward), copy bandwidth {cpu.hbm / 1e9:.1f} GB/s (read + write), "
             f"log-softmax {cpu.transcendental['fp32'] / 1e9:.2f} G elements/s (forward + backward), fresh pages "
             f"{cpu.fresh / 1e9:.1f} GB/s")
    print(f"this CPU: {rates}", flush=True)
    times = measured_times([p for p in args.bench.split(",") if p])
    planner = Planner(config, dtype="fp32", stream=stream)
    setup = Setup(host_memory=0)
    rows = []
    for method in args.methods.split(","):
        for T in (int(t) for t in args.seq_lens.split(",")):
            t0 = time.perf_counter()
            planner.step(method, T)  # the fake step at this T
            work = planner.work(method, T)
            one_rate = step_time(work, setup, planner.rank(), "fp32", device=cpu, tokens=T)
            t1 = time.perf_counter()
            timed = time_calls(work.calls)
            predicted = step_time(work, setup, planner.rank(), "fp32", device=replace(cpu, calls=timed), tokens=T)
            timing_s = time.perf_counter() - t1
            measured = times.get((method, T), [])
            median = sorted(measured)[len(measured) // 2] if measured else None
            row = {"method": method, "seq_len": T, "flops": work.flops, "attention_flops": work.attention,
                   "bytes": work.bytes, "transcendental": work.transcendental, "fresh_bytes": work.fresh,
                   "compute_s": predicted.compute, "memory_s": predicted.memory, "predicted_s": predicted.total,
                   "distinct_calls": len(timed), "one_rate_s": one_rate.total,
                   "one_rate_diff": one_rate.total / median - 1 if median else None, "timing_s": timing_s,
                   "measured_s": median, "measured_all": measured,
                   "rel_diff": predicted.total / median - 1 if median else None,
                   "plan_s": time.perf_counter() - t0}
            if args.real:
                row["real_flops"] = real_flops(method, T, stream)
                row["flops_equal"] = row["real_flops"] == work.flops
            rows.append(row)
            seen = "-" if median is None else f"{median:.1f} s ({100 * row['rel_diff']:+.1f}%)"
            print(f"{method:7s} T={T:6d} FLOPs {work.flops / 1e12:7.3f} T  bytes {work.bytes / 1e9:7.2f} GB  predicted "
                  f"{predicted.total:6.1f} s (compute {predicted.compute:.1f} + memory {predicted.memory:.1f}; "
                  f"one rate {one_rate.total:.1f} s)  measured {seen}"
                  + (f"  real FLOPs equal: {row['flops_equal']}" if args.real else ""), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "time_check.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k != "measured_all"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "time_check.json").write_text(json.dumps(
        {"args": vars(args), "machine": machine(), "cpu_matmul_flops": cpu.flops["fp32"],
         "cpu_attention_flops": cpu.attention["fp32"], "cpu_bandwidth": cpu.hbm,
         "cpu_transcendental": cpu.transcendental["fp32"], "cpu_fresh": cpu.fresh,
         "rows": rows}, indent=1))
    lines = [f"CPU (measured): {rates}", "",
             "| method | T | FLOPs (T) | of which attention (T) | other bytes (GB) | exp/log elements (G) | "
             "fresh large results (GB) | distinct calls | predicted s (one rate) | predicted s (calls timed) | "
             "measured s | difference (one rate) | difference (calls timed) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        measured = "-" if r["measured_s"] is None else f"{r['measured_s']:.1f}"
        diff = "-" if r["rel_diff"] is None else f"{100 * r['rel_diff']:+.1f}%"
        one_diff = "-" if r["one_rate_diff"] is None else f"{100 * r['one_rate_diff']:+.1f}%"
        lines.append(f"| {r['method']} | {r['seq_len']:,} | {r['flops'] / 1e12:.3f} | {r['attention_flops'] / 1e12:.3f} | "
                     f"{r['bytes'] / 1e9:.1f} | {r['transcendental'] / 1e9:.2f} | {r['fresh_bytes'] / 1e9:.1f} | "
                     f"{r['distinct_calls']} | {r['one_rate_s']:.1f} | {r['predicted_s']:.1f} | {measured} | "
                     f"{one_diff} | {diff} |")
    (out / "time_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
