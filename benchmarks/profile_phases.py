"""Where a training step's time goes: gradient checkpointing vs leanbp, phase by phase.

    python benchmarks/profile_phases.py --seq-len 16384 --out benchmarks/results/profile

For each method (its own process, the bench model of `leanbp bench`): one warm-up step, then one
step timed phase by phase with wall-clock timers around the engine's pieces, then one step under
torch.profiler whose per-op table (self CPU time) is written to `<method>_ops.txt`. Writes
`phases.json` and `phases.png` (a stacked bar per method).

Phases:
* forward: the layers' forward pass (leanbp: chunk by chunk without a graph; checkpointing: each
  layer under no_grad, inputs kept);
* head: the LM head and loss (leanbp's chunked cross-entropy, which also computes its gradient;
  checkpointing: only the head's forward matmul is timed as head; the loss, the head's backward,
  the embedding and the final norm fall in "linear backward", and its "other" is 0 by construction);
* prefix K/V (leanbp): the K/V of all rows that later chunks attend to, once per layer in backward;
* recompute: the chunk (leanbp) or the layer (checkpointing) run again with a graph in backward;
* layer backward: autograd through the recomputed graph; split by op into attention backward (the
  flash kernel's backward) and the rest (the linears' and norms' backward);
* other: what the timers do not cover (embedding, final norm, optimizer-free glue).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

PHASES = ["forward", "head", "prefix K/V", "recompute", "attention backward", "linear backward", "other"]


class Timers:
    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.depth = 0  # nested timed calls count once, in the outermost phase

    @contextmanager
    def phase(self, name):
        self.depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def wrap(self, owner, attr, name_of):
        plain = getattr(owner, attr)

        def timed(*args, **kwargs):
            with self.phase(name_of()):
                return plain(*args, **kwargs)

        setattr(owner, attr, timed)


def _attention_backward_seconds(prof) -> float:
    """Seconds of the flash kernel's backward in a profiled step."""
    return sum(e.self_cpu_time_total for e in prof.key_averages()
               if "flash_attention" in e.key and "backward" in e.key) / 1e6


def run_method(method: str, seq_len: int, out: Path) -> dict:
    from leanbp.bench import build_case_model

    spec = {"method": method, "seq_len": seq_len}  # (StreamConfig's default chunk sizes)
    model, config = build_case_model(spec)
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    timers = Timers()
    in_backward = [False]

    def step() -> float:
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        in_backward[0] = True
        loss.backward()
        in_backward[0] = False
        seconds = time.perf_counter() - t0
        model.zero_grad(set_to_none=False)
        return seconds

    if method == "leanbp":
        # (a profiler reaches into the modules it times: the layer's chunks, the streamed head's call)
        import leanbp.engine._layer as layer_mod
        import leanbp.streaming._forwards as forwards_mod
        from leanbp.engine import LayerCall
        from leanbp.models import DecoderAdapter

        timers.wrap(LayerCall, "chunk_out", lambda: "recompute" if in_backward[0] else "forward")
        timers.wrap(DecoderAdapter, "key_value", lambda: "prefix K/V")
        timers.wrap(forwards_mod, "cross_entropy", lambda: "head")
        plain_grad = torch.autograd.grad

        def grad(*args, **kwargs):  # the layer's chunk backward (the head takes its gradient in forward)
            with timers.phase("layer backward"):
                return plain_grad(*args, **kwargs)

        # (process-wide, this process only: the final norm's chunked backward counts here too)
        layer_mod.torch.autograd.grad = grad
    else:  # (checkpointing re-runs the layer's own forward code, which calls its submodules again)
        for layer in model.model.layers:
            for child in layer.children():
                timers.wrap(child, "forward", lambda: "recompute" if in_backward[0] else "forward")
        timers.wrap(model.lm_head, "forward", lambda: "head")

    step()  # warm-up
    timers.seconds.clear()
    total = step()
    seconds = dict(timers.seconds)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    (out / f"{method}_ops.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    # leanbp: the layers' chunk backward is timed; checkpointing: autograd's backward is what the
    # timers leave over
    layer_bwd = seconds.pop("layer backward", None)
    phases = {name: seconds.get(name, 0.0) for name in ("forward", "head", "prefix K/V", "recompute")}
    # the flash backward's share of the step, from the profiled step (profiling slows every op
    # about alike, so the share carries over to the unprofiled one)
    profiled_total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
    attention = _attention_backward_seconds(prof) / max(profiled_total, 1e-9) * total
    if layer_bwd is not None:
        phases["attention backward"] = min(attention, layer_bwd)
        phases["linear backward"] = layer_bwd - phases["attention backward"]
    else:
        rest = total - sum(phases.values())
        phases["attention backward"] = min(attention, rest)
        phases["linear backward"] = rest - phases["attention backward"]
    phases["other"] = max(0.0, total - sum(phases.values()))
    return {"method": method, "seq_len": seq_len, "total_s": total, "phases": phases}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = [f"{r['method']} (T={r['seq_len']})" for r in results]
    left = [0.0] * len(results)
    for phase in PHASES:
        widths = [r["phases"].get(phase, 0.0) for r in results]
        ax.barh(labels, widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("seconds per training step")
    ax.legend(fontsize=7, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    ax.set_title("where the step's time goes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--methods", default="ckpt,leanbp")
    p.add_argument("--out", default="benchmarks/results/profile")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one method in this process
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        print("PHASES " + json.dumps(run_method(args.one, args.seq_len, out)), flush=True)
        return
    methods = args.methods.split(",")
    if not set(methods) <= {"ckpt", "leanbp"}:
        p.error(f"--methods: ckpt and/or leanbp, got {methods}")
    results = []
    for method in methods:
        proc = subprocess.run([sys.executable, __file__, "--one", method, "--seq-len", str(args.seq_len),
                               "--out", str(out)], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{method} failed:\n{proc.stderr[-4000:]}")
        line = next(l for l in proc.stdout.splitlines() if l.startswith("PHASES "))
        results.append(json.loads(line[len("PHASES "):]))
        r = results[-1]
        print(f"{method:8s} {r['total_s']:7.1f} s  " + "  ".join(f"{k}: {v:.1f}" for k, v in r["phases"].items()))
    from leanbp.bench import machine

    (out / "phases.json").write_text(json.dumps({"machine": machine(), "results": results}, indent=1))
    plot(results, out / "phases.png")
    print(f"wrote {out}/phases.json, phases.png, <method>_ops.txt")


if __name__ == "__main__":
    main()
