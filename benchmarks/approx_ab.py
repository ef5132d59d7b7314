"""Step time of the approximate activations against the exact backward, in one process: one model of
`leanbp bench --suite approx` (Llama-shaped, hidden 512, 4 layers, batch 4, autocast bf16, leanbp's
chunked head), the variant switched in place with `leanbp.approx` / `leanbp.unapprox`, a warm-up step
on each variant's first use (the fused CPU kernels compile then), then `--rounds` rounds of
`--steps` timed steps per variant in rotating order. Printed per variant: the median step (wall
clock, and the process's CPU time) and the median over rounds of its ratio to exact's step in the
same round, the figure to read: a drift of the shared machine's speed moves both sides of a round.

Separate processes per case (what `leanbp bench` does, for memory) leave process-to-process noise
in the times on a shared machine; switching in one process compares the variants on the same
warmed-up allocator, threads and caches.

    python benchmarks/approx_ab.py --fine-tuning lora --out benchmarks/results/approx_inverted/ab_lora.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch

import leanbp
from leanbp.approx import variant_settings
from leanbp.bench import machine
from leanbp.bench._case import build_case_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fine-tuning", choices=["lora", "full"], default="lora")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--variants", default="none,inverted,act", help="approx variants; none (exact) first")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1, help="timed steps per variant and round")
    parser.add_argument("--out", default=None, help="a JSON file for the times")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    variants = args.variants.split(",")
    spec = {"model": "llama", "method": "head", "approx": "none", "lora": args.fine_tuning == "lora",
            "seq_len": args.seq_len, "batch": 4, "dtype": "autocast", "device": "cpu"}
    top, config = build_case_model(spec)
    base = top.get_base_model() if spec["lora"] else top
    ids = torch.randint(0, config.vocab_size, (4, args.seq_len), generator=torch.Generator().manual_seed(0))
    for p in top.parameters():  # (resident gradients, as in the bench)
        if p.requires_grad:
            p.grad = torch.zeros_like(p)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = top(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        top.zero_grad(set_to_none=False)

    times: dict[str, list[float]] = {v: [] for v in variants}  # wall clock, one entry per step
    cpu: dict[str, list[float]] = {v: [] for v in variants}  # the process's CPU time, per step
    round_ratio: dict[str, list[float]] = {v: [] for v in variants}  # a round's median over exact's
    warm: set[str] = set()
    for round_ in range(args.rounds):
        this_round: dict[str, list[float]] = {}
        for v in variants[round_ % len(variants):] + variants[:round_ % len(variants)]:  # (rotating order)
            if leanbp.is_approximated(base):
                leanbp.unapprox(base)
            if v != "none":
                leanbp.approx(base, **variant_settings(v))
            if v not in warm:
                step()  # warm-up
                warm.add(v)
            for _ in range(args.steps):
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                times[v].append(time.perf_counter() - t0)
                cpu[v].append(time.process_time() - c0)
            this_round[v] = times[v][-args.steps:]
        if "none" in this_round:
            for v in variants:
                round_ratio[v].append(statistics.median(this_round[v]) / statistics.median(this_round["none"]))
        print(f"round {round_ + 1}: " + ", ".join(f"{v} {t[-1]:.2f} s" for v, t in times.items()), flush=True)
    median = {v: statistics.median(t) for v, t in times.items()}
    median_cpu = {v: statistics.median(t) for v, t in cpu.items()}
    ratio = {v: statistics.median(r) for v, r in round_ratio.items() if r}
    for v in variants:
        paired = f", median ratio of the rounds {ratio[v]:.3f}x exact" if v in ratio else ""
        print(f"{args.fine_tuning} T={args.seq_len} {v}: median {median[v]:.3f} s wall, "
              f"{median_cpu[v]:.3f} s CPU{paired}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "machine": machine(), "times": times,
                                              "cpu_times": cpu, "round_ratios": round_ratio,
                                              "median_s": median, "median_cpu_s": median_cpu,
                                              "median_round_ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
