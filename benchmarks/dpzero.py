"""DPZero: does a private zeroth-order step cost what inference costs, and does it learn?

(a) Memory. The peak of one DPZero step (two forwards at theta +/- mu z, clip, noise, update)
    against one no-grad forward of the same batch, and one backprop step for context, measured by
    leanbp's tracker (live tensor bytes on CPU) on the built-in Qwen3-shaped model (fp32, streamed),
    on a batch of the classification task and on one window of T = 4096 of the bundled text. The bar:
    the DPZero step's peak is at most 1.05 x the forward's.
(b) Learning. ``leanbp train --optimizer dpzero`` for --steps steps at epsilon 8 on
    ``builtin:classify`` (Poisson sampling, OS randomness: the run is private, so not
    bit-reproducible), next to plain SGD (non-private, first-order, the same expected batch size,
    the same learning-rate schedule, the same initial weights). The loss per step of both, and the
    loss and accuracy on every 4th example of the task before and after. The model is a smaller
    Qwen3 shape than leanbp train's built-in one (``SMALL``, 131k parameters: 300 steps of both
    take minutes on 2 cores; --model builtin for the built-in one, 3.3M).

Writes dpzero.csv (loss per step), dpzero.png (the curves) and summary.json to --out.

    python benchmarks/dpzero.py --steps 300 --out benchmarks/results/dpzero
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers

import leanbp
from leanbp.memory import MiB, track
from leanbp.streaming import StreamConfig
from leanbp.train import (CLASSIFY, TokenData, TrainConfig, byte_tokenizer, classify_records, load_model,
                          privacy_summary, qwen3_config, train)
from leanbp.zo import DPZero, DPZeroConfig, SeededRandom, example_losses

EVAL_BATCH = 32
EVAL_EVERY = 4  # (evaluate on every 4th example: the task's loss and accuracy, at a quarter of the cost)
# the model trained in (b): Qwen3-shaped, random init, byte vocabulary (leanbp train's built-in
# model is the same shape at hidden 256, 4 layers)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=192, vocab_size=256)


def lr_at(step: int, lr: float, warmup: int, steps: int) -> float:
    """leanbp train's schedule (linear warmup, cosine to 10%), for the SGD baseline."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# -- (a) memory ----------------------------------------------------------------------------------
def memory(seq_len: int, chunk_size: int) -> list[dict]:
    model = load_model(None, max(seq_len, 4096), torch.float32, seed=0).train()  # (positions for the 4096 window)
    leanbp.stream(model, StreamConfig(chunk_size=chunk_size))
    classify = TokenData(byte_tokenizer(), CLASSIFY, seq_len)
    text = TokenData(byte_tokenizer(), None, 4096)
    cases = {"classify, 16 rows": classify.rows(list(range(0, 1600, 100))), "text, 1 x 4096": text.rows([3])}
    rows = []
    for name, batch in cases.items():
        def forward():
            with torch.no_grad():
                model(**batch).loss

        def dpzero():  # (noise from a seed here: the memory does not depend on it)
            config = DPZeroConfig(mu=1e-3, clip=1.0, noise_multiplier=1.0, expected_batch_size=len(batch["labels"]))
            DPZero(model, config, SeededRandom(0)).step(lambda: example_losses(model, **batch), lr=1e-6, step=0)

        def backprop():
            model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)

        peaks = {}
        for what, fn in (("forward", forward), ("dpzero", dpzero), ("backprop", backprop)):
            fn()  # (warm: first calls allocate caches)
            with track(model) as mem:
                fn()
            peaks[what] = mem.report
        rows.append({"case": name, "shape": list(batch["input_ids"].shape),
                     "params_mib": peaks["forward"].params / MiB,
                     **{f"{k}_peak_mib": v.peak / MiB for k, v in peaks.items()},
                     "dpzero_over_forward": peaks["dpzero"].peak / peaks["forward"].peak,
                     "backprop_over_forward": peaks["backprop"].peak / peaks["forward"].peak})
        print(f"memory, {name}: " + ", ".join(f"{k} {v.peak / MiB:.1f} MiB" for k, v in peaks.items())
              + f"; dpzero / forward = {rows[-1]['dpzero_over_forward']:.4f}", flush=True)
    return rows


# -- (b) learning ----------------------------------------------------------------------------------
def evaluate(model, data: TokenData) -> dict:
    """Loss and accuracy on every ``EVAL_EVERY``-th example: the label the model finds likelier
    of y and n is its answer."""
    records = classify_records()
    assert data.records == len(records)  # (no verse dropped: the rows are in the records' order)
    tokenizer = byte_tokenizer()
    label_ids = [tokenizer(label, add_special_tokens=False)["input_ids"][0] for label in ("n", "y")]
    picks = list(range(0, data.records, EVAL_EVERY))
    losses, correct = [], 0
    for start in range(0, len(picks), EVAL_BATCH):
        rows = picks[start: start + EVAL_BATCH]
        batch = data.rows(rows)
        scored = batch["labels"] != -100  # (B, T): one label position per row
        per_label = torch.stack([example_losses(model, batch["input_ids"], batch["labels"].masked_fill(scored, label),
                                                batch["attention_mask"]) for label in label_ids])  # (2, B)
        truth = torch.tensor([records[i]["completion"] == "y" for i in rows]).long()  # (B,) 0: n, 1: y
        losses.append(per_label.gather(0, truth.unsqueeze(0)).squeeze(0))
        correct += int((per_label.argmin(0) == truth).sum())
    return {"loss": float(torch.cat(losses).mean()), "accuracy": correct / len(picks), "examples": len(picks)}


def sgd(data: TokenData, args) -> tuple[list[float], float, torch.nn.Module]:
    model = load_model(args.model_spec, args.seq_len, torch.float32, seed=0).train()
    leanbp.stream(model, StreamConfig(chunk_size=args.chunk_size))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.sgd_lr)
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.sgd_lr, args.warmup, args.steps)
        loss = model(**data.batch(step, 0, args.batch_size)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, time.perf_counter() - t0, model


def mean(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16, help="expected rows per step (DPZero: Poisson)")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--lr", type=float, default=None, help="DPZero's (default: leanbp train's)")
    parser.add_argument("--clip", type=float, default=None, help="DPZero's C (default: leanbp train's)")
    parser.add_argument("--sgd-lr", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=512, help="longest row (the task's rows are shorter)")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--model", choices=["small", "builtin"], default="small",
                        help="the model trained in (b) (the memory of (a) is the built-in model's)")
    parser.add_argument("--skip-memory", action="store_true", help="only (b)")
    parser.add_argument("--out", default="benchmarks/results/dpzero")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    t_start = time.perf_counter()

    memory_rows = [] if args.skip_memory else memory(args.seq_len, args.chunk_size)

    scratch = Path(tempfile.mkdtemp(prefix="leanbp-dpzero-"))  # (the run's folder: checkpoints stay out of results/)
    args.model_spec = None  # (leanbp train's built-in model)
    if args.model == "small":  # a config.json, which leanbp train builds with random init from --seed
        qwen3_config(SMALL, max_positions=2048).save_pretrained(scratch / "model")
        args.model_spec = str(scratch / "model" / "config.json")
    data = TokenData(byte_tokenizer(), CLASSIFY, args.seq_len)
    initial = evaluate(load_model(args.model_spec, args.seq_len, torch.float32, seed=0), data)
    print(f"initial: {initial}", flush=True)

    extra = {k: v for k, v in (("lr", args.lr), ("dp_clip", args.clip)) if v is not None}
    cfg = TrainConfig(model=args.model_spec, optimizer="dpzero", data=CLASSIFY, steps=args.steps,
                      batch_size=args.batch_size, seq_len=args.seq_len, dp_epsilon=args.epsilon, warmup=args.warmup,
                      save_every=args.steps, out=str(scratch / "run"), overwrite=True,
                      stream=StreamConfig(chunk_size=args.chunk_size), **extra)
    t0 = time.perf_counter()
    state = train(cfg, progress=False)
    dpzero_seconds = time.perf_counter() - t0
    with open(scratch / "run" / "train_log.csv") as f:
        epsilons = [float(r["epsilon"]) for r in csv.DictReader(f)]
    dpzero_losses = state["losses"]
    trained = transformers.AutoModelForCausalLM.from_pretrained(scratch / "run" / "checkpoint", dtype=torch.float32)
    dpzero_final = evaluate(trained, data)
    print(f"dpzero ({dpzero_seconds:.0f} s): {dpzero_final}; {privacy_summary(state['privacy'])}", flush=True)

    sgd_losses, sgd_seconds, sgd_model = sgd(data, args)
    sgd_final = evaluate(sgd_model, data)
    print(f"sgd ({sgd_seconds:.0f} s): {sgd_final}", flush=True)

    with open(out / "dpzero.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "dpzero_loss", "epsilon", "sgd_loss"])
        for i in range(args.steps):
            writer.writerow([i + 1, f"{dpzero_losses[i]:.5f}", f"{epsilons[i]:.4f}", f"{sgd_losses[i]:.5f}"])

    window = 20
    labels = torch.tensor([r["completion"] == "y" for r in classify_records()]).double()
    prior = float(labels.mean())
    summary = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "machine": f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}",
        "memory_model": "leanbp train's built-in Qwen3-shaped model (hidden 256, 4 layers, 3.3M parameters, byte "
                        f"vocabulary), fp32, streamed (chunk {args.chunk_size}), random init (seed 0)",
        "training_model": ({"shape": SMALL, "parameters": sum(p.numel() for p in sgd_model.parameters())}
                           if args.model == "small" else "the built-in model"),
        "task": "builtin:classify (1618 verses; does someone speak? one label token y/n; 33% y)",
        "memory": memory_rows,
        "dpzero": {"steps_run": state["step"], "lr": cfg.lr, "clip": cfg.dp_clip, "mu": cfg.zo_mu,
                   "expected_batch_size": args.batch_size, "privacy": state["privacy"],
                   f"loss_first_{window}": mean(dpzero_losses[:window]),
                   f"loss_last_{window}": mean(dpzero_losses[-window:]), "seconds": dpzero_seconds,
                   "task_before": initial, "task_after": dpzero_final},
        "sgd": {"lr": args.sgd_lr, "batch_size": args.batch_size, f"loss_first_{window}": mean(sgd_losses[:window]),
                f"loss_last_{window}": mean(sgd_losses[-window:]), "seconds": sgd_seconds,
                "task_before": initial, "task_after": sgd_final},
        "label_prior": {"accuracy_always_n": 1 - prior,
                        "loss_of_the_prior": -(prior * math.log(prior) + (1 - prior) * math.log(1 - prior))},
        "seconds_total": time.perf_counter() - t_start,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "memory"}, indent=1))
    plot(out / "dpzero.png", dpzero_losses, sgd_losses, epsilons, summary, window)
    shutil.rmtree(scratch)


def plot(path: Path, dpzero_losses, sgd_losses, epsilons, summary, window) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(values):
        out = []
        for i in range(len(values)):
            out.append(mean(values[max(0, i - window + 1): i + 1]))
        return out

    fig, (ax, ax_eps) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    steps = range(1, len(dpzero_losses) + 1)
    eps = summary["dpzero"]["privacy"]["epsilon"]
    for losses, label, color in ((dpzero_losses, f"DPZero (epsilon {eps:.2f}, two forwards/step)", "C0"),
                                 (sgd_losses, "SGD (non-private, backprop)", "C1")):
        ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, smooth(losses), color=color, label=f"{label}, {window}-step mean")
    ax.axhline(summary["label_prior"]["loss_of_the_prior"], color="grey", linestyle=":",
               label="loss of the label prior (33% y)")
    ax.set_ylabel("training loss (nats, label token)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    model = "Qwen3-shaped, hidden 64, 2 layers" if isinstance(summary["training_model"], dict) else \
        "the built-in Qwen3-shaped model"
    ax.set_title(f"builtin:classify, {model}, random init, 2-core CPU", fontsize=9)
    ax_eps.plot(steps, epsilons, color="C0")
    ax_eps.set_ylabel("epsilon spent")
    ax_eps.set_xlabel("step")
    ax_eps.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
