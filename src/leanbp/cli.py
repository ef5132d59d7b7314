"""The `leanbp` command: train | bench | plan | verify."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from ._builtin import BENCH_MODELS
from ._train import NonFiniteError
from .engine import StreamConfig


def _add_train(sub):
    # allow_abbrev=False: --nproc relaunches this command without it, which it must recognize exactly
    p = sub.add_parser("train", allow_abbrev=False,
                       help="train a model with StreamBP (default: built-in Qwen3-shaped model on bundled text)",
                       description="Train a causal LM with exact sequence-streamed backprop. With no arguments: "
                                   "a small Qwen3-shaped model (random init, byte-level vocabulary) on the bundled "
                                   "public-domain text at T=4096.")
    p.add_argument("--model", help="local transformers model directory or config.json (default: built-in)")
    p.add_argument("--data", help="lm: local .txt or .jsonl ('text', or 'prompt'+'completion'); sft|dpo|grpo: a .jsonl in "
                                  "TRL's format (sft: text | prompt+completion | messages; dpo: prompt+chosen+rejected; "
                                  "grpo: prompt+answer) (default: bundled text / the objective's built-in set)")
    p.add_argument("--objective", choices=["lm", "sft", "dpo", "grpo"], default="lm",
                   help="lm: leanbp's own loop; sft | dpo | grpo: TRL's trainer on the streamed model, on built-in "
                        "data made from the bundled text (needs pip install -e '.[trl]')")
    p.add_argument("--out", default="runs/leanbp-train",
                   help="run folder: checkpoints/step-*/ (checkpoint -> the newest), train_log.csv, loss.png, run.json")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=5, help="linear warmup steps, then cosine decay to 10%% of --lr")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp64"], default="fp32")
    p.add_argument("--chunk-size", type=_chunk_size, default="auto",
                   help='rows per chunk in a decoder layer, or "auto" (default): the largest chunk whose working set '
                        "fits the size of one layer input, at least min(1024, T) rows (shown in the progress bar)")
    p.add_argument("--head-chunk-size", type=int, default=StreamConfig.head_chunk_size,
                   help="labelled rows per chunk in the LM head + loss")
    p.add_argument("--no-stream", action="store_true", help="plain autograd (baseline)")
    p.add_argument("--offload", action="store_true",
                   help="keep the hidden states between decoder layers, and their gradients, in host memory "
                        "(same gradients; the device then holds one layer's working set)")
    p.add_argument("--approx", choices=["none", "act", "norm", "both"], default="none",
                   help="opt in to Approx-BP (act: ReSiLU2/ReGELU2, approximate gradients) and/or MS-BP "
                        "(norm: memory-sharing norms with folded affines)")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--resume", action="store_true", help="continue the run in OUT from its newest complete checkpoint "
                                                          "(TRL objectives: the newest OUT/trainer/checkpoint-*)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in OUT (else: an error)")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept in OUT/checkpoints")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="skip a step whose loss or gradient is not finite (default: stop with an error)")
    p.add_argument("--engine", choices=["single", "ddp", "fsdp2", "zero2", "zero3"], default=None,
                   help="single: one process (default); ddp | fsdp2 | zero2 | zero3 (DeepSpeed ZeRO): one process per "
                        "device, each on its own micro-batches, launched by --nproc N or torchrun (default there: ddp)")
    p.add_argument("--nproc", type=int, default=None,
                   help="launch N processes on this machine (torchrun --standalone) running this command with --engine")
    p.add_argument("--packing", action="store_true", help="sft: pack examples into padding-free rows")
    p.add_argument("--group-size", type=int, default=4, help="grpo: completions per prompt")
    p.add_argument("--completion-len", type=int, default=64, help="grpo: tokens generated per completion")


def _add_bench(sub):
    p = sub.add_parser("bench", help="plain autograd vs gradient checkpointing vs leanbp, side by side",
                       description="Runs each method and sequence length in its own process on the bench model "
                                   "(Qwen3-shaped, hidden 512, 4 layers, vocab 32000) and prints peak memory, "
                                   "activation memory (peak - params - grads), step time and ratios to gradient "
                                   "checkpointing. Writes bench.csv, bench.json and bench.png to --out.")
    p.add_argument("--suite", choices=["stream", "approx", "trl"], default="stream",
                   help="stream: plain vs checkpointing vs leanbp on the Qwen3 bench model; approx: exact vs "
                        "ReSiLU2 / MS-RMSNorm / both on a Llama-shaped model (batch 4, T 512-2048, full and LoRA); "
                        "trl: TRL's SFT (packed) / DPO / GRPO trainers with checkpointing, checkpointing + leanbp's "
                        "head, and leanbp")
    p.add_argument("--seq-lens", help="comma-separated sequence lengths (stream: 2048,4096,8192,16384; "
                                      "approx: 512,1024,2048; trl: per objective, e.g. sft=4096:16384,dpo=8192)")
    p.add_argument("--timed-steps", type=int, default=3, help="stream and trl suites: steps timed per case (median)")
    p.add_argument("--methods", default="plain,ckpt,leanbp",
                   help='stream suite: comma-separated plain, ckpt, leanbp, leanbp_auto (chunk_size="auto"), leanbp_offload '
                        '(hidden states between layers and their gradients in host memory, reported in a host column)')
    p.add_argument("--model", default="qwen3", choices=BENCH_MODELS,
                   help="stream suite: the bench shape as a Qwen3 (default), Gemma3 (3 sliding-window layers of "
                        "1024 + 1 global) or Qwen3-MoE (8 experts, top 2, load-balancing loss on) model")
    p.add_argument("--batch", type=int, help="batch size (stream: 1, approx: 4)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "autocast"],
                   help="stream suite: fp32 (default) or bf16; approx suite: autocast (default: fp32 parameters, "
                        "bf16 compute) or fp32")
    p.add_argument("--device", default="cpu", help="every suite: cpu (default) or cuda")
    p.add_argument("--chunk-size", type=_chunk_size, default=StreamConfig.chunk_size,
                   help='rows per chunk in a decoder layer (default 1024), or "auto"; method leanbp_auto runs "auto" '
                        "beside the fixed size")
    p.add_argument("--head-chunk-size", type=int, default=StreamConfig.head_chunk_size)
    p.add_argument("--out", default="bench_out", help="folder for bench.csv / bench.json / bench.png")


def _add_plan(sub):
    from .memory._planner import METHODS, PRESETS

    p = sub.add_parser("plan", help="peak device memory per method and the longest sequence that fits, without the GPU",
                       description="Runs the real training step (transformers, its gradient checkpointing, leanbp, "
                                   "leanbp with host offload) on fake tensors and reports the peak device memory at "
                                   "each T (weights, gradients, optimizer state, activations) and the longest T that "
                                   "fits the memory. Writes plan.md, plan.csv, plan.json and plan.png to --out.")
    p.add_argument("--model", default="qwen3-8b",
                   help=f"a preset ({', '.join(PRESETS)}), a model directory or a config.json (default qwen3-8b)")
    p.add_argument("--memory", default="80GiB", help="the device's memory, e.g. 80GiB, 141GB (default 80GiB)")
    p.add_argument("--reserve", default="auto",
                   help="memory held back for what the plan does not model: CUDA context, kernel workspaces, "
                        "allocator fragmentation (default auto: 1 GiB + 64 MiB + 5%% of --memory, the report says "
                        "why)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="parameters and gradients")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-lens", help="comma-separated T to report (default 4096,16384,65536,131072,262144,1048576)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--mode", choices=["backprop", "step", "both"], default="both",
                   help="backprop: weights + gradients + activations (the StreamBP paper's setting); step: also "
                        "AdamW's two fp32 moments per parameter; both (default)")
    p.add_argument("--chunk-size", type=int, default=StreamConfig.chunk_size, help="leanbp's rows per chunk")
    p.add_argument("--head-chunk-size", type=int, default=StreamConfig.head_chunk_size)
    p.add_argument("--free-outputs", action="store_true",
                   help="the loop drops the model's outputs (logits) before backward, as transformers' Trainer does "
                        "(default: held through backward, as in outputs = model(**batch); outputs.loss.backward())")
    p.add_argument("--lora", type=int, metavar="R",
                   help="train LoRA adapters of rank R on every linear layer but the head, the base frozen "
                        "(default: full fine-tuning)")
    p.add_argument("--out", default="plan_out", help="folder for plan.md / plan.csv / plan.json / plan.png")


def _plan(args) -> int:
    from .memory._plan_report import DEFAULT_SEQ_LENS, PlanRequest, format_plan, run_plan, write_plan
    from .memory._planner import load_config, parse_bytes

    reserve = None if args.reserve == "auto" else parse_bytes(args.reserve)  # (None: the default reserve)
    request = PlanRequest(model=args.model, memory=parse_bytes(args.memory), reserve=reserve,
                          dtype=args.dtype, batch=args.batch,
                          seq_lens=_ints(args.seq_lens, "--seq-lens") if args.seq_lens else list(DEFAULT_SEQ_LENS),
                          methods=[m.strip() for m in args.methods.split(",") if m.strip()],
                          modes=["backprop", "step"] if args.mode == "both" else [args.mode],
                          chunk_size=args.chunk_size, head_chunk_size=args.head_chunk_size,
                          hold_outputs=not args.free_outputs, lora_rank=args.lora)
    result = run_plan(request, load_config(args.model))
    print(format_plan(result))
    print(f"\nwritten to {write_plan(result, args.out)}/ (plan.md, plan.csv, plan.json, plan.png)")
    return 0


def _add_verify(sub):
    p = sub.add_parser("verify", help="float64 gradient check of a streamed model against plain autograd",
                       description="Builds the model in float64 (a config gets random init), runs one step with "
                                   "left padding and prompt-masked labels with plain autograd and with leanbp, "
                                   "and prints the max relative gradient error per parameter group.")
    p.add_argument("--model", help="local model directory or config.json (default: built-in model)")
    p.add_argument("--seq-len", type=int, default=96)
    p.add_argument("--batch", type=int, default=3)
    p.add_argument("--chunk-size", type=int, default=17)
    p.add_argument("--head-chunk-size", type=int, default=13)
    p.add_argument("--tol", type=float, default=1e-12, help="fail (exit 1) above this relative error")


def _train(args) -> int:
    from ._train import TrainConfig, train
    from .distributed._engines import launched_by_torchrun

    if args.nproc is not None:
        if launched_by_torchrun():  # (the launched ranks run this command without --nproc)
            raise ValueError("--nproc launches torchrun itself; under torchrun, leave it out")
        return _launch(args.nproc, args.argv)
    engine = args.engine or ("ddp" if launched_by_torchrun() else "single")
    cfg = TrainConfig(model=args.model, data=args.data, objective=args.objective, out=args.out, seq_len=args.seq_len,
                      batch_size=args.batch_size, grad_accum=args.grad_accum, steps=args.steps, lr=args.lr,
                      warmup=args.warmup, weight_decay=args.weight_decay,
                      dtype=args.dtype, chunk_size=args.chunk_size, head_chunk_size=args.head_chunk_size,
                      stream=not args.no_stream, offload=args.offload, approx=args.approx, save_every=args.save_every, seed=args.seed,
                      device=args.device, resume=args.resume, packing=args.packing, group_size=args.group_size,
                      completion_len=args.completion_len, keep=args.keep, overwrite=args.overwrite,
                      skip_nonfinite=args.skip_nonfinite, engine=engine)
    state = train(cfg)
    losses = state["losses"]
    if losses and int(os.environ.get("RANK", "0")) == 0:
        final = "final (transformers), checkpoint" if engine in ("fsdp2", "zero2", "zero3") else "checkpoint"
        print(f"{args.objective} step {state['step']}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
              f"{final} in {args.out}")
    return 0


def _launch(nproc: int, given: list[str]) -> int:
    """Run this very command (``given``, without --nproc) in ``nproc`` processes under torchrun."""
    import subprocess

    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    argv, skip = [], False
    for arg in given:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            argv.append(arg)
    if "--engine" not in argv and not any(a.startswith("--engine=") for a in argv):
        argv += ["--engine", "ddp"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "leanbp", *argv]
    return subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
                          ).returncode


def _bench(args) -> int:
    from .bench import ApproxBenchCase, BenchCase, run_approx_bench, run_bench
    from .bench._run import describe_machine, format_approx_table, format_table, machine

    print(f"machine: {describe_machine(machine())}")

    if args.suite == "trl":
        from .bench import TrlBenchCase, run_trl_bench
        from .bench._run import format_trl_table

        lengths = {"seq_lens": _per_objective(args.seq_lens)} if args.seq_lens is not None else {}
        case = TrlBenchCase(timed_steps=args.timed_steps, chunk_size=args.chunk_size,
                            head_chunk_size=args.head_chunk_size, device=args.device, **lengths)
        print(format_trl_table(run_trl_bench(case, args.out)))
        print(f"\nwrote {args.out}/bench_trl.csv, bench_trl.json, bench_trl.png")
        return 0
    seq_lens = _ints(args.seq_lens, "--seq-lens") if args.seq_lens is not None else None
    if args.suite == "approx":
        case = ApproxBenchCase(**({"seq_lens": seq_lens} if seq_lens is not None else {}),
                               **({"batch": args.batch} if args.batch is not None else {}),
                               **({"dtype": args.dtype} if args.dtype else {}), device=args.device)
        print(format_approx_table(run_approx_bench(case, args.out)))
        print(f"\nwrote {args.out}/bench_approx.csv, bench_approx.json")
        return 0
    case = BenchCase(**({"seq_lens": seq_lens} if seq_lens is not None else {}), methods=args.methods.split(","),
                     model=args.model,
                     batch=args.batch if args.batch is not None else 1, dtype=args.dtype or "fp32", device=args.device,
                     chunk_size=args.chunk_size, head_chunk_size=args.head_chunk_size, timed_steps=args.timed_steps)
    rows = run_bench(case, args.out)
    print(format_table(rows))
    print(f"\nwrote {args.out}/bench.csv, bench.json, bench.png")
    return 0


def _chunk_size(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected a number of rows or "auto", got {text!r}') from None


def _ints(text: str, flag: str, sep: str = ",") -> list[int]:
    try:
        return [int(x) for x in text.split(sep) if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes integers separated by {sep!r}, got {text!r}") from None


def _per_objective(text: str) -> dict[str, list[int]]:
    """"sft=4096:16384,dpo=8192" -> {"sft": [4096, 16384], "dpo": [8192]}."""
    out = {}
    for part in text.split(","):
        name, _, lengths = part.partition("=")
        if name not in ("sft", "dpo", "grpo") or not lengths:
            raise ValueError(f"--seq-lens for the trl suite looks like sft=4096:16384,dpo=8192; got {part!r}")
        out[name] = _ints(lengths, "--seq-lens", ":")
    return out


def _verify(args) -> int:
    import torch

    from ._builtin import TRAIN_QWEN3, build_model, qwen3_config
    from ._train import load_model
    from ._verify import verify

    if args.model is None:
        model = build_model(qwen3_config(TRAIN_QWEN3, max_positions=2048), dtype=torch.float64)
    else:
        model = load_model(args.model, args.seq_len, torch.float64, seed=0)
    result = verify(model, seq_len=args.seq_len, batch=args.batch, chunk_size=args.chunk_size,
                    head_chunk_size=args.head_chunk_size)
    print(f"{'parameter group':<16} max relative gradient error (float64, leanbp vs plain autograd)")
    for group, err in result["groups"].items():
        print(f"{group:<16} {err:.2e}")
    print(f"{'loss':<16} {result['loss']:.2e}")
    worst = max([result["loss"], *result["groups"].values()])
    ok = worst <= args.tol
    print(("PASS" if ok else "FAIL") + f": worst {worst:.2e} (tolerance {args.tol:.0e})")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    parser = argparse.ArgumentParser(prog="leanbp", description="Exact sequence-streamed backprop for long-sequence LM training.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_bench(sub)
    _add_plan(sub)
    _add_verify(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return {"train": _train, "bench": _bench, "plan": _plan, "verify": _verify}[args.command](args)
    except (ValueError, NotImplementedError, FileNotFoundError, ImportError) as e:
        print(f"leanbp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"leanbp {args.command}: stopped: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
