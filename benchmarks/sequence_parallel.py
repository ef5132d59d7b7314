"""Sequence parallelism on CPU processes (gloo): what one rank holds, and what the ranks exchange.

(a) Memory. One training step of the bench model (Qwen3-shaped: hidden 512, 4 layers, 8 heads / 4
    K/V heads, head_dim 64, vocab 32000; float32, batch 1) on one sequence of --seq-len tokens,
    streamed in one process (P = 1) and with ``leanbp.stream(model, sequence_parallel=True)`` over
    P = 2 and P = 4 processes, every rank holding T/P rows. Each rank measures its own step with
    leanbp's tracker (live tensor bytes; parameters and zeroed gradients resident, as ``leanbp
    bench`` does): activation memory = peak - parameters - gradients. The bar: the largest rank's
    activation memory at most 0.55x (P = 2) and 0.3x (P = 4) of the one-process step's.
(b) Communication. The all-to-all calls and bytes (what each rank sends) per layer of one step,
    counted by wrapping torch.distributed.all_to_all_single, for leanbp at --comm-seq-len tokens,
    beside DeepSpeed's Ulysses attention (``deepspeed.sequence.layer.DistributedAttention``, the
    exchange ALST builds on) with the same heads, rows and ranks: once plain, once inside
    activation checkpointing (how long-sequence training runs it, ALST included: the layer's
    forward, exchanges and all, runs again in backward). leanbp's streamed layer always recomputes
    its forward in backward, so the comparison that counts is the checkpointed one (bar: bytes
    within 10%).

Writes sequence_parallel.json, sequence_parallel.csv and sequence_parallel.png to --out.

    python benchmarks/sequence_parallel.py --out benchmarks/results/sequence_parallel
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

MiB = 2**20


class _Traffic:
    """Counts the calls and the bytes each rank sends of the collectives a step runs."""

    NAMES = ("all_to_all_single", "all_gather", "all_reduce")

    def __init__(self):
        self.calls = {n: 0 for n in self.NAMES}
        self.bytes = {n: 0 for n in self.NAMES}
        self._originals = {}

    def __enter__(self):
        for name in self.NAMES:
            original = self._originals[name] = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                sent = kwargs.get("input", kwargs.get("tensor"))
                if sent is None:
                    sent = args[1] if _name in ("all_to_all_single", "all_gather") else args[0]
                self.calls[_name] += 1
                self.bytes[_name] += sent.numel() * sent.element_size()
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _bench_model(seq_len: int):
    from leanbp.bench._models import bench_config

    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(bench_config("qwen3", max_positions=seq_len)).train()
    for p in model.parameters():  # steady state of a training loop: gradients resident
        p.grad = torch.zeros_like(p)
    return model


def _leanbp_step(world: int, seq_len: int, chunk: int, head_chunk: int) -> dict:
    """One streamed step on this rank's rows: memory, time, loss and the collectives per layer."""
    import leanbp
    from leanbp.memory import track

    model = _bench_model(seq_len)
    leanbp.stream(model, chunk_size=chunk, head_chunk_size=head_chunk, sequence_parallel=True if world > 1 else None)
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    rows = leanbp.sequence_rows(model, ids) if world > 1 else ids
    with _Traffic() as traffic, track(model) as mem:
        t0 = time.perf_counter()
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        seconds = time.perf_counter() - t0
    layers = model.config.num_hidden_layers
    r = mem.report
    return dict(loss=loss.item(), activation_mib=r.activations / MiB, peak_mib=r.peak / MiB, step_s=seconds,
                all_to_all_calls_per_layer=traffic.calls["all_to_all_single"] / layers,
                all_to_all_mib_per_layer=traffic.bytes["all_to_all_single"] / layers / MiB,
                other_collectives={n: [traffic.calls[n], traffic.bytes[n] / MiB] for n in ("all_gather", "all_reduce")})


def _deepspeed_attention(world: int, seq_len: int, checkpoint: bool) -> dict:
    """DeepSpeed's Ulysses attention block with the bench model's sizes on this rank's rows: the
    q/k/v projections, the exchange-wrapped causal attention, the output projection; one forward and
    backward (inside activation checkpointing when asked, whose recompute then needs the output
    exchange again for the output projection); the all-to-alls it runs."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention
    from leanbp.bench._models import BENCH_QWEN3

    deepspeed.init_distributed(dist_backend="gloo")
    hidden = BENCH_QWEN3["hidden_size"]
    H, Hkv, D = BENCH_QWEN3["num_attention_heads"], BENCH_QWEN3["num_key_value_heads"], BENCH_QWEN3["head_dim"]
    n = seq_len // world
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, hidden, generator=g, requires_grad=True)  # (rows, B, hidden), Megatron's layout
    wq, wk, wv = (torch.randn(h * D, hidden, generator=g) / hidden**0.5 for h in (H, Hkv, Hkv))
    wo = torch.randn(hidden, H * D, generator=g) / (H * D) ** 0.5

    def local(q, k, v, *args, **kwargs):  # every row, this rank's heads: (T, B, h, D)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).permute(2, 0, 1, 3)

    attention = DistributedAttention(local, dist.group.WORLD, scatter_idx=2, gather_idx=0)

    def block(x):
        q, k, v = (F.linear(x, w).view(n, 1, -1, D) for w in (wq, wk, wv))
        return F.linear(attention(q, k, v, 1).reshape(n, 1, H * D), wo)

    with _Traffic() as traffic:
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if checkpoint else block(x)
        out.backward(torch.ones_like(out))
    return dict(all_to_all_calls_per_layer=traffic.calls["all_to_all_single"],
                all_to_all_mib_per_layer=traffic.bytes["all_to_all_single"] / MiB)


def _rank(rank: int, world: int, init: str, job: dict, folder: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    if job["kind"] == "leanbp":
        result = _leanbp_step(world, job["seq_len"], job["chunk"], job["head_chunk"])
    else:
        result = _deepspeed_attention(world, job["seq_len"], job["checkpoint"])
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1 and job["kind"] == "leanbp":  # (DeepSpeed's communication threads abort a teardown: exit as is)
        dist.destroy_process_group()


def _run(world: int, job: dict) -> list[dict]:
    """``job`` on ``world`` processes (one: in a spawned process too, so every run starts alike)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        init = f"file://{os.path.join(folder, 'rendezvous')}"
        mp.spawn(_rank, args=(world, init, job, folder), nprocs=world)
        return [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]


def _plot(rows: list[dict], comm: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ps = [r["P"] for r in rows]
    a.bar([str(p) for p in ps], [r["activation_mib"] for r in rows], color="#3b7dd8")
    a.plot([str(p) for p in ps], [rows[0]["activation_mib"] / p for p in ps], "k--", label="one process / P")
    a.set_xlabel("processes P sharing the sequence")
    a.set_ylabel("activation MiB of the largest rank")
    a.set_title(f"T = {rows[0]['seq_len']}: memory of one rank")
    a.legend()
    short = {"leanbp": "leanbp", "DeepSpeed Ulysses": "DS", "DeepSpeed Ulysses + checkpointing": "DS + ckpt"}
    labels = [f"{short[c['method']]}\nP={c['P']}" for c in comm]
    b.bar(labels, [c["all_to_all_mib_per_layer"] for c in comm],
          color=["#3b7dd8" if c["method"] == "leanbp" else "#999999" for c in comm])
    b.set_ylabel("all-to-all MiB sent per rank per layer")
    b.set_title(f"T = {comm[0]['seq_len']}: exchange per layer (DS: DeepSpeed Ulysses)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=32768, help="the memory runs' sequence length")
    p.add_argument("--comm-seq-len", type=int, default=4096, help="the communication runs' sequence length")
    p.add_argument("--chunk-size", type=int, default=256, help="leanbp's chunk of (local) rows")
    p.add_argument("--head-chunk-size", type=int, default=256)
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sequence_parallel"))
    args = p.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    rows, comm = [], []
    jobs = [("memory", w) for w in worlds] + [("comm", w) for w in worlds if w > 1]
    for what, world in tqdm(jobs, desc="sequence parallel", unit="run"):
        if what == "memory":
            ranks = _run(world, dict(kind="leanbp", seq_len=args.seq_len, chunk=args.chunk_size,
                                     head_chunk=args.head_chunk_size))
            worst = max(ranks, key=lambda r: r["activation_mib"])
            rows.append(dict(P=world, seq_len=args.seq_len, activation_mib=worst["activation_mib"],
                             per_rank_mib=[r["activation_mib"] for r in ranks], step_s=max(r["step_s"] for r in ranks),
                             loss=ranks[0]["loss"]))
            continue
        lean = _run(world, dict(kind="leanbp", seq_len=args.comm_seq_len, chunk=args.chunk_size,
                                head_chunk=args.head_chunk_size))[0]
        comm.append(dict(method="leanbp", P=world, seq_len=args.comm_seq_len, **{k: lean[k] for k in (
            "all_to_all_calls_per_layer", "all_to_all_mib_per_layer", "other_collectives")}))
        for checkpoint in (False, True):
            ds = _run(world, dict(kind="deepspeed", seq_len=args.comm_seq_len, checkpoint=checkpoint))[0]
            comm.append(dict(method="DeepSpeed Ulysses" + (" + checkpointing" if checkpoint else ""), P=world,
                             seq_len=args.comm_seq_len, **ds))
    one = rows[0]["activation_mib"]
    for r in rows:
        r["vs_one_process"] = r["activation_mib"] / one
    for c in comm:
        ckpt = next(d for d in comm if d["P"] == c["P"] and d["method"].endswith("checkpointing"))
        c["bytes_vs_deepspeed_checkpointed"] = c["all_to_all_mib_per_layer"] / ckpt["all_to_all_mib_per_layer"]

    print(f"\n(a) T = {args.seq_len}, chunk {args.chunk_size}, head chunk {args.head_chunk_size}: activation memory "
          "of the largest rank")
    print("| P | activation MiB (largest rank) | every rank | vs one process | step s | loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['P']} | {r['activation_mib']:.1f} | {', '.join(f'{m:.1f}' for m in r['per_rank_mib'])} | "
              f"{r['vs_one_process']:.3f} | {r['step_s']:.1f} | {r['loss']:.6f} |")
    print(f"\n(b) T = {args.comm_seq_len}: all-to-all per layer and step, sent by one rank")
    print("| P | method | calls | MiB | vs DeepSpeed Ulysses + checkpointing |")
    print("|---|---|---|---|---|")
    for c in comm:
        print(f"| {c['P']} | {c['method']} | {c['all_to_all_calls_per_layer']:g} | {c['all_to_all_mib_per_layer']:.2f} | "
              f"{c['bytes_vs_deepspeed_checkpointed']:.3f} |")
    summary = dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), torch=torch.__version__,
                   command="python " + " ".join(shlex.quote(a) for a in sys.argv), memory=rows, communication=comm)
    (args.out / "sequence_parallel.json").write_text(json.dumps(summary, indent=1))
    with open(args.out / "sequence_parallel.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["table", "P", "method", "seq_len", "activation_mib", "vs_one_process", "all_to_all_calls_per_layer",
                    "all_to_all_mib_per_layer", "bytes_vs_deepspeed_checkpointed"])
        for r in rows:
            w.writerow(["memory", r["P"], "leanbp", r["seq_len"], f"{r['activation_mib']:.1f}",
                        f"{r['vs_one_process']:.4f}", "", "", ""])
        for c in comm:
            w.writerow(["communication", c["P"], c["method"], c["seq_len"], "", "", c["all_to_all_calls_per_layer"],
                        f"{c['all_to_all_mib_per_layer']:.3f}", f"{c['bytes_vs_deepspeed_checkpointed']:.4f}"])
    _plot(rows, comm, args.out / "sequence_parallel.png")
    print(f"\nwrote {args.out}/sequence_parallel.json, .csv, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
