"""Pipeline parallelism on CPU processes (gloo): 1F1B against 2BP, with and without streamed layers.

(a) Measured. The bench model (Qwen3-shaped: hidden 512, 4 layers, 8 heads / 4 K/V heads, vocab
    32000; float32) split over S = 2 and 4 processes (``leanbp.pipeline.Pipeline``), one step of
    --microbatches rows of --seq-len tokens (one row per micro-batch). For each schedule (1f1b, 2bp)
    and each stage kind (streamed: leanbp's layers and chunked head; plain: transformers' layers and
    full logits), every stage reports the median time of --steps steps after one warm-up, and its
    activation memory in one more step (leanbp's tracker: live tensor bytes; peak minus the stage's
    parameters and gradients, which are resident). On this 2-core machine each process has one
    thread; 4 processes share 2 cores, so their measured times also hold each other's work.
(b) From the schedule. The time of one stage's forward, full backward, input pass and weight pass
    (a 1-layer stage in the middle of the pipeline, measured in one process: median of --steps),
    fed to a simulation of torch's own action order for S = 4 and 8 stages (``leanbp.pipeline``
    ``_idle.py``): each schedule's idle fraction and makespan, in units of one forward, beside the
    zero-bubble paper's assumption F = I = W = 1.

Writes pipeline.json, pipeline.csv and pipeline.png to --out.

    python benchmarks/pipeline.py --out benchmarks/results/pipeline
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

MiB = 2**20
SCHEDULES = ("1f1b", "2bp")
KINDS = ("streamed", "plain")


def _bench_model(seq_len: int, layers: int | None = None):
    import transformers

    from leanbp.bench._models import bench_config

    torch.manual_seed(0)
    config = bench_config("qwen3", max_positions=seq_len)
    if layers is not None:
        config.num_hidden_layers = layers
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _stage_runs(job: dict) -> list[dict]:
    """Every (schedule, kind) of ``job`` on this process's stage."""
    import leanbp
    from leanbp.memory import track
    from leanbp.pipeline import Pipeline

    out = []
    for schedule in SCHEDULES:
        for kind in KINDS:
            model = _bench_model(job["seq_len"])
            if kind == "streamed":
                leanbp.stream(model, chunk_size=job["chunk"], head_chunk_size=job["chunk"])
            pipe = Pipeline(model, schedule=schedule, microbatches=job["microbatches"])
            for p in pipe.parameters():  # steady state of a training loop: gradients resident
                p.grad = torch.zeros_like(p)
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, model.config.vocab_size, (job["microbatches"], job["seq_len"]), generator=g)
            times = []
            for step in range(job["steps"] + 1):
                dist.barrier()
                t0 = time.perf_counter()
                loss = pipe.step(ids, ids)
                times.append(time.perf_counter() - t0)
            dist.barrier()
            with track(pipe.module) as mem:
                pipe.step(ids, ids)
            out.append(dict(schedule=schedule, kind=kind, stage=pipe.stage_index, step_s=statistics.median(times[1:]),
                            activation_mib=mem.report.activations / MiB, loss=float(loss),
                            passes={k: v // (job["steps"] + 2) for k, v in pipe.stage.passes.items()}))
            del pipe, model
    return out


def _rank(rank: int, world: int, init: str, job: dict, folder: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        result = _stage_runs(job)
    finally:
        dist.destroy_process_group()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))


def _run(world: int, job: dict) -> list[list[dict]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        init = f"file://{os.path.join(folder, 'rendezvous')}"
        mp.spawn(_rank, args=(world, init, job, folder), nprocs=world)
        return [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]


def _pass_costs(seq_len: int, chunk: int, steps: int) -> dict:
    """Seconds of a middle 1-layer stage's forward, full backward, input pass and weight pass, for
    streamed and plain layers (one process, one row)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    import leanbp
    from leanbp.engine import backward_pass
    from leanbp.pipeline import StageModule

    out = {}
    for kind in KINDS:
        model = _bench_model(seq_len, layers=3)
        if kind == "streamed":
            leanbp.stream(model, chunk_size=chunk)
        stage = StageModule(model, range(1, 2))
        params = list(stage.parameters())
        g = torch.Generator().manual_seed(0)
        x0 = torch.randn(1, seq_len, model.config.hidden_size, generator=g)
        dy = torch.randn(1, seq_len, model.config.hidden_size, generator=g)
        times = {k: [] for k in "FBIW"}
        for _ in range(steps + 1):
            x = x0.clone().requires_grad_()
            t0 = time.perf_counter()
            y = stage(x)
            times["F"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            y.backward(dy)
            times["B"].append(time.perf_counter() - t0)
            x = x0.clone().requires_grad_()
            y = stage(x)
            t0 = time.perf_counter()
            with backward_pass("input"):
                _, groups = stage_backward_input([y], [dy], [x], iter(params))
            times["I"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with backward_pass("weight"):
                stage_backward_weight(iter(params), groups)
            times["W"].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        out[kind] = {k: statistics.median(v[1:]) for k, v in times.items()}
    return out


def _idle_table(costs: dict, stage_counts=(4, 8)) -> list[dict]:
    from leanbp.pipeline import Costs, idle_fraction, one_f_one_b_order, simulate, zero_bubble_order

    models = {"paper (F = I = W = 1)": Costs(F=1, B=2, I=1, W=1)}
    for kind, c in costs.items():  # in units of the measured forward
        models[f"{kind} (measured)"] = Costs(F=1.0, B=c["B"] / c["F"], I=c["I"] / c["F"], W=c["W"] / c["F"])
    rows = []
    for name, model in models.items():
        for S in stage_counts:
            for M in (S, 2 * S):
                one = simulate(one_f_one_b_order(S, M), model)
                zb = simulate(zero_bubble_order(S, M), model)
                rows.append(dict(costs=name, F=model.F, B=model.B, I=model.I, W=model.W, stages=S, microbatches=M,
                                 idle_1f1b=one.idle_fraction, idle_2bp=zb.idle_fraction,
                                 makespan_1f1b=one.makespan, makespan_2bp=zb.makespan,
                                 check=idle_fraction("1f1b", S, M, model)))
    return rows


def _summary(measured: list[dict], costs: dict, microbatches: int, stage_counts=(2, 4, 8)) -> list[dict]:
    """One row per (stages, schedule, layers): the measured step and per-stage memory where it ran,
    and the idle fraction and makespan ratio of torch's action order with the measured pass costs."""
    from leanbp.pipeline import Costs, one_f_one_b_order, simulate, zero_bubble_order

    rows = []
    for S in stage_counts:
        for kind, c in costs.items():
            model = Costs(F=1.0, B=c["B"] / c["F"], I=c["I"] / c["F"], W=c["W"] / c["F"])
            one = simulate(one_f_one_b_order(S, microbatches), model)
            for schedule in SCHEDULES:
                run = simulate(zero_bubble_order(S, microbatches), model) if schedule == "2bp" else one
                m = next((x for x in measured if (x["stages"], x["schedule"], x["kind"]) == (S, schedule, kind)), None)
                rows.append(dict(stages=S, schedule=schedule, kind=kind, microbatches=microbatches,
                                 step_s=m["step_s"] if m else None, vs_1f1b=m.get("vs_1f1b") if m else None,
                                 activation_mib=m["activation_mib"] if m else None, idle=run.idle_fraction,
                                 makespan_vs_1f1b=run.makespan / one.makespan))
    return rows


def _print_summary(rows: list[dict]) -> None:
    print("\n(one table) measured where it ran; idle fraction and makespan from torch's action order with the "
          "measured pass costs")
    print("| stages | schedule | layers | step s | vs 1F1B | activation MiB per stage | idle fraction | "
          "makespan vs 1F1B |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        measured = (f"{r['step_s']:.2f} | {r['vs_1f1b']:.3f} | {', '.join(f'{x:.1f}' for x in r['activation_mib'])}"
                    if r["step_s"] is not None else "- | - | -")
        print(f"| {r['stages']} | {r['schedule']} | {r['kind']} | {measured} | {r['idle']:.3f} | "
              f"{r['makespan_vs_1f1b']:.2f} |")


def _plot(measured: list[dict], idle: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c, d) = plt.subplots(1, 4, figsize=(19, 4.2))
    labels = [f"S={m['stages']}\n{m['schedule']}\n{m['kind']}" for m in measured]
    colors = ["#3b7dd8" if m["kind"] == "streamed" else "#999999" for m in measured]
    a.bar(labels, [m["step_s"] for m in measured], color=colors)
    a.set_ylabel("step seconds (slowest stage)")
    a.set_title("measured step time (blue: streamed)", fontsize=10)
    a.tick_params(axis="x", labelsize=7)
    b.bar(labels, [max(m["activation_mib"]) for m in measured], color=colors)
    b.set_ylabel("activation MiB (largest stage)")
    b.set_title("measured per-stage peak", fontsize=10)
    b.tick_params(axis="x", labelsize=7)
    names = list(dict.fromkeys(r["costs"] for r in idle))
    xs = [f"S={r['stages']},M={r['microbatches']}" for r in idle if r["costs"] == names[0]]
    c.plot(xs, [r["idle_1f1b"] for r in idle if r["costs"] == names[0]], "ko--", label="1F1B (any costs)")
    for name in names:
        rows = [r for r in idle if r["costs"] == name]
        c.plot(xs, [r["idle_2bp"] for r in rows], "s-", label=f"2BP, {name}")
        d.plot(xs, [r["makespan_2bp"] / r["makespan_1f1b"] for r in rows], "s-", label=name)
    c.set_ylabel("idle fraction")
    c.set_title("idle fraction, from torch's action order", fontsize=10)
    c.legend(fontsize=7)
    d.axhline(1.0, color="k", lw=0.8, ls="--")
    d.set_ylabel("2BP makespan / 1F1B makespan")
    d.set_title("step time from the schedule (below 1: 2BP wins)", fontsize=10)
    d.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up (median)")
    p.add_argument("--stages", default="2,4")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline"))
    p.add_argument("--plot-only", action="store_true",
                   help="print the one table and redraw pipeline.png from --out's pipeline.json")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        saved = json.loads((args.out / "pipeline.json").read_text())
        _print_summary(_summary(saved["measured"], saved["pass_seconds"], args.microbatches))
        _plot(saved["measured"], saved["idle"], args.out / "pipeline.png")
        return 0
    from tqdm import tqdm

    job = dict(seq_len=args.seq_len, chunk=args.chunk_size, microbatches=args.microbatches, steps=args.steps)
    measured = []
    for S in tqdm([int(s) for s in args.stages.split(",")], desc="pipelines", unit="stage count"):
        per_rank = _run(S, job)
        for i, config in enumerate(per_rank[0]):
            stages = [r[i] for r in per_rank]
            measured.append(dict(stages=S, schedule=config["schedule"], kind=config["kind"],
                                 step_s=max(s["step_s"] for s in stages),
                                 activation_mib=[s["activation_mib"] for s in stages],
                                 loss=stages[-1]["loss"], passes=[s["passes"] for s in stages]))
    costs = _pass_costs(args.seq_len, args.chunk_size, args.steps)
    idle = _idle_table(costs)

    print(f"\n(a) T = {args.seq_len}, {args.microbatches} micro-batches of one row, chunk {args.chunk_size}: measured")
    print("| stages | schedule | layers | step s | vs 1F1B | activation MiB per stage | loss |")
    print("|---|---|---|---|---|---|---|")
    for m in measured:
        base = next(x for x in measured if x["stages"] == m["stages"] and x["kind"] == m["kind"]
                    and x["schedule"] == "1f1b")
        m["vs_1f1b"] = m["step_s"] / base["step_s"]
        print(f"| {m['stages']} | {m['schedule']} | {m['kind']} | {m['step_s']:.2f} | {m['vs_1f1b']:.3f} | "
              f"{', '.join(f'{x:.1f}' for x in m['activation_mib'])} | {m['loss']:.6f} |")
    print(f"\n(b) one 1-layer stage, T = {args.seq_len}: seconds per pass")
    print("| layers | F | B (full) | I (input pass) | W (weight pass) | I / B | W / B |")
    print("|---|---|---|---|---|---|---|")
    for kind, c in costs.items():
        print(f"| {kind} | {c['F']:.3f} | {c['B']:.3f} | {c['I']:.3f} | {c['W']:.3f} | {c['I'] / c['B']:.2f} | "
              f"{c['W'] / c['B']:.2f} |")
    print("\n(b) idle fraction and makespan (units of F) from torch's action order")
    print("| costs | F : B : I : W | stages | micro-batches | idle 1F1B | idle 2BP | makespan 1F1B | makespan 2BP |")
    print("|---|---|---|---|---|---|---|---|")
    for r in idle:
        print(f"| {r['costs']} | 1 : {r['B']:.2f} : {r['I']:.2f} : {r['W']:.2f} | {r['stages']} | {r['microbatches']} | "
              f"{r['idle_1f1b']:.3f} | {r['idle_2bp']:.3f} | {r['makespan_1f1b']:.1f} | {r['makespan_2bp']:.1f} |")
    table = _summary(measured, costs, args.microbatches)
    _print_summary(table)
    summary = dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), torch=torch.__version__, cpus=os.cpu_count(),
                   command="python " + " ".join(shlex.quote(a) for a in sys.argv), measured=measured,
                   pass_seconds=costs, idle=idle, table=table)
    (args.out / "pipeline.json").write_text(json.dumps(summary, indent=1))
    with open(args.out / "pipeline.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["table", "stages", "schedule", "layers", "step_s", "vs_1f1b", "max_stage_activation_mib",
                    "microbatches", "idle_1f1b", "idle_2bp"])
        for m in measured:
            w.writerow(["measured", m["stages"], m["schedule"], m["kind"], f"{m['step_s']:.3f}", f"{m['vs_1f1b']:.4f}",
                        f"{max(m['activation_mib']):.1f}", args.microbatches, "", ""])
        for r in idle:
            w.writerow(["idle", r["stages"], "", r["costs"], "", "", "", r["microbatches"], f"{r['idle_1f1b']:.4f}",
                        f"{r['idle_2bp']:.4f}"])
    _plot(measured, idle, args.out / "pipeline.png")
    print(f"\nwrote {args.out}/pipeline.json, .csv, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
