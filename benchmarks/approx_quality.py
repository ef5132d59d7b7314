"""Training quality of the approximate backward: the built-in model trained with the exact backward
and with each approximation (same data, same seed), final losses and every loss curve on one PNG.

    python benchmarks/approx_quality.py --steps 300 --out bench_out/approx_quality
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from leanbp.streaming import StreamConfig
from leanbp.train import TrainConfig, train

VARIANTS = {"none": "exact backward", "both": "ReSiLU2 + MS-RMSNorm (approximate)",
            "inverted": "Inverted SiLU (approximate)", "inverted+norm": "Inverted SiLU + MS-RMSNorm (approximate)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default="bench_out/approx_quality")
    args = parser.parse_args()
    out = Path(args.out)
    curves = {}
    for variant in VARIANTS:
        cfg = TrainConfig(out=str(out / variant), steps=args.steps, seq_len=args.seq_len, overwrite=True,
                          batch_size=args.batch_size, lr=args.lr, warmup=20, approx=variant,
                          save_every=args.steps, stream=StreamConfig(chunk_size=args.seq_len))
        curves[variant] = train(cfg)["losses"]

    def final(losses):  # mean of the last 10 steps: one batch's loss is noisy
        tail = losses[-10:]
        return sum(tail) / len(tail)

    exact = final(curves["none"])
    summary = {"steps": args.steps, "seq_len": args.seq_len, "batch_size": args.batch_size,
               "command": f"python benchmarks/approx_quality.py --steps {args.steps} --seq-len {args.seq_len} "
                          f"--batch-size {args.batch_size} --lr {args.lr}",
               "final_loss": {variant: final(curves[variant]) for variant in VARIANTS},
               "relative_difference": {variant: (final(curves[variant]) - exact) / exact
                                       for variant in VARIANTS if variant != "none"}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for variant, label in VARIANTS.items():
        ax.plot(range(1, len(curves[variant]) + 1), curves[variant], label=f"{label}: final {final(curves[variant]):.3f}",
                alpha=0.85)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title(f"built-in Qwen3-shaped model, bundled text, T={args.seq_len}, batch {args.batch_size}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=110)


if __name__ == "__main__":
    main()
