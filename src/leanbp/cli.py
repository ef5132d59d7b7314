"""The `leanbp` command: train | bench | plan | verify.

The options of a setting that a config declares (``StreamConfig``, ``TrainConfig``) are built from
its field (``_options.py``): one default, one help text, one validation, in every command."""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import warnings

from ._options import add_options, field_default as _default, values
from .streaming import StreamConfig
from .train import NonFiniteError, TrainConfig, privacy_summary

# the StreamConfig settings each command offers
_STREAM_OPTIONS = {
    "train": ("chunk_size", "head_chunk_size", "chunk_memory", "offload", "attention"),
    "bench": ("chunk_size", "head_chunk_size", "attention"),  # (method leanbp_auto: "auto" in its default budget)
    "plan": ("chunk_size", "head_chunk_size"),
    "verify": ("chunk_size", "head_chunk_size", "chunk_memory", "offload", "attention"),
}
# TrainConfig's settings, each an option of leanbp train (``stream`` is StreamConfig's options)
_TRAIN_OPTIONS = tuple(name for name in TrainConfig.__dataclass_fields__ if name != "stream")


def _stream_config(args, command: str) -> StreamConfig:
    return StreamConfig(**values(args, _STREAM_OPTIONS[command]))


def _add_train(sub):
    # allow_abbrev=False: --nproc relaunches this command without it, which it must recognize exactly
    p = sub.add_parser("train", allow_abbrev=False,
                       help="train a model with StreamBP (default: built-in Qwen3-shaped model on bundled text)",
                       description="Train a causal LM with exact sequence-streamed backprop. With no arguments: "
                                   "a small Qwen3-shaped model (random init, byte-level vocabulary) on the bundled "
                                   "public-domain text at T=4096.")
    # --engine: unset means "single", or "ddp" under torchrun
    add_options(p, TrainConfig, _TRAIN_OPTIONS, defaults={"engine": None})
    add_options(p, StreamConfig, _STREAM_OPTIONS["train"])
    p.add_argument("--no-stream", action="store_true", help="plain autograd (the baseline)")
    p.add_argument("--nproc", type=int, default=None,
                   help="launch N processes on this machine (torchrun --standalone) running this command with --engine")


def _train(args) -> int:
    from .train import launch, launched_by_torchrun, train

    if args.nproc is not None and launched_by_torchrun():  # (the launched ranks run this command without --nproc)
        raise ValueError("--nproc launches torchrun itself; under torchrun, leave it out")
    if args.no_stream and args.offload:
        raise ValueError("--offload moves the streamed layers' inputs to the host: it needs streaming (drop "
                         "--no-stream)")
    settings = values(args, _TRAIN_OPTIONS)
    several = args.nproc is not None or launched_by_torchrun()
    settings["engine"] = args.engine or ("ddp" if several else "single")
    cfg = TrainConfig(**settings, stream=None if args.no_stream else _stream_config(args, "train"))
    if args.nproc is not None:
        return launch(args.nproc, args.argv, cfg)
    if cfg.engine == "pipeline" and not launched_by_torchrun():  # (one process per stage, launched here)
        return launch(cfg.stages, args.argv, cfg)
    state = train(cfg)
    losses = state["losses"]
    if losses and int(os.environ.get("RANK", "0")) == 0:
        final = ("final (transformers), checkpoint" if cfg.engine in ("fsdp2", "zero2", "zero3", "pipeline")
                 else "checkpoint")
        print(f"{cfg.objective} step {state['step']}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
              f"{final} in {cfg.out}")
    if state.get("privacy") is not None:  # (--optimizer dpzero)
        print(privacy_summary(state["privacy"]))
    return 0


def _add_bench(sub):
    from ._dtypes import QUANTIZE
    from .bench import BENCH_DTYPES, BENCH_MODELS, PEERS, PEERS_SUITE, ApproxBenchCase, BenchCase, TrlBenchCase
    from .streaming import METHODS

    trl_lengths = ",".join(f"{k}={':'.join(map(str, v))}" for k, v in _default(TrlBenchCase, "seq_lens").items())

    p = sub.add_parser("bench", help="plain autograd vs gradient checkpointing vs leanbp, side by side",
                       description="Runs each method and sequence length in its own process on the bench model "
                                   "(Qwen3-shaped, hidden 512, 4 layers, vocab 32000) and prints peak memory, "
                                   "activation memory (peak - params - grads), step time and ratios to gradient "
                                   "checkpointing. Writes bench.csv, bench.json and bench.png to --out.")
    p.add_argument("--suite", choices=["stream", "peers", "approx", "trl"], default="stream",
                   help="stream: plain vs checkpointing vs leanbp on the Qwen3 bench model; peers: leanbp vs the "
                        "strongest exact single-device recipes (checkpointing + tiled loss, ALST: + DeepSpeed's "
                        "TiledMLP) at T 8192 and 16384, 3 rounds, ratios to ALST; approx: exact vs "
                        "ReSiLU2 / MS-RMSNorm / both on a Llama-shaped model (batch 4, T 512-2048, full and LoRA); "
                        "trl: TRL's SFT (packed) / DPO / GRPO trainers with checkpointing, checkpointing + leanbp's "
                        "head, and leanbp")
    p.add_argument("--seq-lens", help="comma-separated sequence lengths (stream: "
                                      f"{','.join(map(str, _default(BenchCase, 'seq_lens')))}; approx: "
                                      f"{','.join(map(str, _default(ApproxBenchCase, 'seq_lens')))}; trl: per "
                                      f"objective, {trl_lengths})")
    p.add_argument("--timed-steps", type=int,
                   help=f"stream, peers and trl suites: steps timed per case, the median (stream and trl: "
                        f"{_default(BenchCase, 'timed_steps')}, peers: {PEERS_SUITE['timed_steps']})")
    p.add_argument("--rounds", type=int,
                   help=f"stream and peers suites: run every case this many times, alternating the order of the "
                        f"methods (time: the median of the rounds; stream: {_default(BenchCase, 'rounds')}, peers: "
                        f"{PEERS_SUITE['rounds']})")
    p.add_argument("--methods",
                   help=f"stream and peers suites: comma-separated, from {', '.join((*METHODS, *PEERS))} "
                        '(leanbp_auto: chunk size "auto"; leanbp_offload: the hidden states between layers and their '
                        "gradients in host memory, reported in a host column; head: transformers' decoder with "
                        f"leanbp's head; {', '.join(PEERS)}: the peers suite's; peers default: "
                        f"{','.join(PEERS_SUITE['methods'])})")
    p.add_argument("--model", default=_default(BenchCase, "model"), choices=BENCH_MODELS,
                   help="stream suite: the bench shape as a Qwen3 (default), Gemma3 (3 sliding-window layers of "
                        "1024 + 1 global) or Qwen3-MoE (8 experts, top 2, load-balancing loss on) model")
    p.add_argument("--batch", type=int, help=f"batch size (stream: {_default(BenchCase, 'batch')}, approx: "
                                             f"{_default(ApproxBenchCase, 'batch')})")
    p.add_argument("--dtype", choices=BENCH_DTYPES,
                   help=f"stream suite: {_default(BenchCase, 'dtype')} (default) or bf16; approx suite: "
                        f"{_default(ApproxBenchCase, 'dtype')} (default: fp32 parameters, bf16 compute) or fp32")
    p.add_argument("--quantize", choices=QUANTIZE, default="none",
                   help="stream suite: nf4 measures QLoRA (the model loaded in bitsandbytes' 4-bit NormalFloat with "
                        "double quantization, LoRA r=8 on every linear layer but the head; needs bitsandbytes)")
    p.add_argument("--device", default="cpu", help="every suite: cpu (default) or cuda")
    add_options(p, StreamConfig, _STREAM_OPTIONS["bench"])
    p.add_argument("--out", default="bench_out",
                   help="folder for bench.csv / bench.json / bench.png (peers: bench_peers.*; approx, trl: theirs)")


def _bench(args) -> int:
    from .bench import (PEERS_SUITE, ApproxBenchCase, BenchCase, TrlBenchCase, describe_machine, format_approx_table,
                        format_table, format_trl_table, machine, run_approx_bench, run_bench, run_trl_bench)

    print(f"machine: {describe_machine(machine())}")
    stream = _stream_config(args, "bench")
    if args.quantize != "none" and args.suite != "stream":
        raise ValueError(f"--quantize is measured by the stream suite, not the {args.suite} suite")
    if args.suite == "trl":
        lengths = {"seq_lens": _per_objective(args.seq_lens)} if args.seq_lens is not None else {}
        steps = {"timed_steps": args.timed_steps} if args.timed_steps is not None else {}
        case = TrlBenchCase(stream=stream, device=args.device, **lengths, **steps)
        print(format_trl_table(run_trl_bench(case, args.out)))
        print(f"\nwrote {args.out}/bench_trl.csv, bench_trl.json, bench_trl.png")
        return 0
    seq_lens = _ints(args.seq_lens, "--seq-lens") if args.seq_lens is not None else None
    if args.suite == "approx":
        case = ApproxBenchCase(**({"seq_lens": seq_lens} if seq_lens is not None else {}),
                               **({"batch": args.batch} if args.batch is not None else {}),
                               **({"dtype": args.dtype} if args.dtype else {}), stream=stream, device=args.device)
        print(format_approx_table(run_approx_bench(case, args.out)))
        print(f"\nwrote {args.out}/bench_approx.csv, bench_approx.json")
        return 0
    given = {"seq_lens": seq_lens, "rounds": args.rounds, "timed_steps": args.timed_steps,
             "methods": args.methods.split(",") if args.methods is not None else None}
    defaults = PEERS_SUITE if args.suite == "peers" else {}
    case = BenchCase(**{**defaults, **{k: v for k, v in given.items() if v is not None}}, model=args.model,
                     batch=args.batch if args.batch is not None else 1, dtype=args.dtype or "fp32",
                     device=args.device, stream=stream, quantize=args.quantize)
    name, baseline = ("bench_peers", "alst") if args.suite == "peers" else ("bench", "ckpt")
    print(format_table(run_bench(case, args.out, name=name, baseline=baseline), baseline))
    print(f"\nwrote {args.out}/{name}.csv, {name}.json, {name}.png")
    return 0


def _add_plan(sub):
    from .memory import GiB
    from ._dtypes import QUANTIZE
    from .plan import ALLOCATORS, DEFAULT_SEQ_LENS, GPUS, PLAN_DTYPES, PRESETS, CudaReserve, PlanRequest, Setup
    from .streaming import PLANNED

    reserve = CudaReserve()

    p = sub.add_parser("plan", help="peak device memory per method, the longest sequence that fits and the time of a "
                                    "step, without the GPU",
                       description="Runs the real training step (transformers, its gradient checkpointing, leanbp, "
                                   "leanbp with host offload) on fake tensors and reports one rank's peak device "
                                   "memory at each T (weights, gradients, optimizer state, the engine's buffers, "
                                   "activations), the host memory, the step's time on the chosen GPU, and the longest "
                                   "T that fits the device and the host. Writes plan.md, plan.csv, plan.json and "
                                   "plan.png to --out.")
    p.add_argument("--model", default=_default(PlanRequest, "model"),
                   help=f"a preset ({', '.join(PRESETS)}), a model directory or a config.json (default "
                        f"{_default(PlanRequest, 'model')})")
    p.add_argument("--memory", default=None,
                   help="the device's memory, e.g. 80GiB, 141GB (default: the --gpu's, "
                        + ", ".join(f"{name} {gpu.memory / GiB:.4g} GiB" for name, gpu in GPUS.items()) + ")")
    p.add_argument("--reserve", default="auto",
                   help="memory held back for what the plan does not model: CUDA context, kernel workspaces, "
                        f"allocator fragmentation (default auto: {reserve.context / GiB:g} GiB + "
                        f"{reserve.workspaces / 2**20:g} MiB + {100 * reserve.fragmentation:g}%% of --memory, the "
                        "share left out where --allocator replays; the report says why)")
    p.add_argument("--allocator", choices=ALLOCATORS, default=_default(PlanRequest, "allocator"),
                   help="share: the reserve holds back a share of --memory for the CUDA caching allocator; replay: "
                        "plain autograd's and checkpointing's steps are played (two steps) through a model of the "
                        "allocator, which finds what it needs beyond the tensors (a fake step at full depth per try; "
                        "the streamed methods keep the share); auto (default): replay where the device holds no "
                        "optimizer state made at the first step (backprop, ZeRO, --optimizer host), where the model "
                        "matched published runs, else share")
    p.add_argument("--dtype", choices=PLAN_DTYPES, default=_default(PlanRequest, "dtype"),
                   help="parameters and gradients")
    p.add_argument("--batch", type=int, default=_default(PlanRequest, "batch"), help="sequences per step and rank")
    p.add_argument("--seq-lens", help=f"comma-separated T to report (default {','.join(map(str, DEFAULT_SEQ_LENS))})")
    p.add_argument("--methods", help=f"comma-separated, from {', '.join(PLANNED)} (default: all; with --sp, leanbp)")
    p.add_argument("--mode", choices=["backprop", "step", "both"], default="both",
                   help="backprop: weights + gradients + activations (the StreamBP paper's setting); step: also "
                        "the optimizer's state and its step (--optimizer); both (default)")
    add_options(p, Setup, _PLAN_SETUP)
    add_options(p, StreamConfig, _STREAM_OPTIONS["plan"])
    p.add_argument("--free-outputs", action="store_true",
                   help="the loop drops the model's outputs (logits) before backward, as transformers' Trainer does "
                        "(default: held through backward, as in outputs = model(**batch); outputs.loss.backward())")
    p.add_argument("--free-grads", action="store_true",
                   help="the loop frees the gradients between steps (zero_grad(), set_to_none=True: PyTorch's and "
                        "Trainer's default), so a step's backward makes them as it goes; default: resident through "
                        "the step, as in gradient accumulation's later micro-steps (only --engine single or ddp)")
    p.add_argument("--lora", type=int, metavar="R",
                   help="train LoRA adapters of rank R on every linear layer but the head, the base frozen "
                        "(default: full fine-tuning)")
    p.add_argument("--quantize", choices=QUANTIZE, default="none",
                   help="nf4: the frozen base in bitsandbytes' 4-bit NormalFloat with double quantization, "
                        "computing in --dtype (QLoRA; needs --lora; one GPU or ddp)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="processes that plan the methods side by side (default: one per CPU)")
    p.add_argument("--out", default="plan_out", help="folder for plan.md / plan.csv / plan.json / plan.png")


# the Setup settings leanbp plan offers (all of them)
_PLAN_SETUP = ("gpus", "sp", "engine", "optimizer", "offload_params", "host_memory", "gpu", "efficiency")


def _plan(args) -> int:
    from .memory import parse_bytes
    from .plan import DEFAULT_SEQ_LENS, PlanRequest, Setup, format_plan, load_config, run_plan, write_plan

    reserve = None if args.reserve == "auto" else parse_bytes(args.reserve)  # (None: the default reserve)
    setup = Setup(**values(args, _PLAN_SETUP))
    request = PlanRequest(model=args.model, memory=parse_bytes(args.memory) if args.memory else None, reserve=reserve,
                          dtype=args.dtype, batch=args.batch,
                          seq_lens=_ints(args.seq_lens, "--seq-lens") if args.seq_lens else list(DEFAULT_SEQ_LENS),
                          methods=[m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None,
                          modes=["backprop", "step"] if args.mode == "both" else [args.mode],
                          stream=_stream_config(args, "plan"), hold_outputs=not args.free_outputs,
                          free_grads=args.free_grads, lora_rank=args.lora, quantize=args.quantize, setup=setup,
                          allocator=args.allocator)
    result = run_plan(request, load_config(args.model), workers=args.workers)
    print(format_plan(result))
    print(f"\nwritten to {write_plan(result, args.out)}/ (plan.md, plan.csv, plan.json, plan.png)")
    return 0


def _add_verify(sub):
    from .testing import BOUNDARY_CHUNKINGS, verify

    small = " and ".join(f"chunk {c} / head chunk {h}" for c, h in BOUNDARY_CHUNKINGS)
    p = sub.add_parser("verify", help="float64 gradient check of a streamed model against plain autograd",
                       description="Builds the model in float64 (a config gets random init), runs one step with "
                                   "left padding and prompt-masked labels with plain autograd and with leanbp, "
                                   "and prints the max relative gradient error per parameter group, at the chunk "
                                   f"sizes given and at {small} (rows that cut the sequence in many places).")
    p.add_argument("--model", help="local model directory or config.json (default: built-in model)")
    defaults = inspect.signature(verify).parameters
    p.add_argument("--seq-len", type=int, default=defaults["seq_len"].default)
    p.add_argument("--batch", type=int, default=defaults["batch"].default)
    add_options(p, StreamConfig, _STREAM_OPTIONS["verify"])
    p.add_argument("--tol", type=float, default=1e-12, help="fail (exit 1) above this relative error")


def _verify(args) -> int:
    import torch

    from .testing import verify
    from .train import TRAIN_QWEN3, build_model, load_model, qwen3_config

    config = _stream_config(args, "verify")  # (checked before the model is built)
    if args.model is None:
        model = build_model(qwen3_config(TRAIN_QWEN3, max_positions=2048), dtype=torch.float64)
    else:
        model = load_model(args.model, args.seq_len, torch.float64, seed=0)
    result = verify(model, seq_len=args.seq_len, batch=args.batch, config=config)
    chunkings = result["chunkings"]
    print("max relative gradient error (float64, leanbp vs plain autograd), per chunk / head chunk rows:")
    columns = [f"{r['chunk_size']} / {r['head_chunk_size']}" for r in chunkings]
    print(f"{'parameter group':<16} " + " ".join(f"{c:>12}" for c in columns))
    for group in chunkings[0]["groups"]:
        print(f"{group:<16} " + " ".join(f"{r['groups'][group]:>12.2e}" for r in chunkings))
    print(f"{'loss':<16} " + " ".join(f"{r['loss']:>12.2e}" for r in chunkings))
    ok = result["worst"] <= args.tol
    print(("PASS" if ok else "FAIL") + f": worst {result['worst']:.2e} (tolerance {args.tol:.0e})")
    return 0 if ok else 1


def _ints(text: str, flag: str, sep: str = ",") -> list[int]:
    try:
        return [int(x) for x in text.split(sep) if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes integers separated by {sep!r}, got {text!r}") from None


def _per_objective(text: str) -> dict[str, list[int]]:
    """"sft=4096:16384,dpo=8192" -> {"sft": [4096, 16384], "dpo": [8192]}."""
    from .bench import TRL_OBJECTIVES

    out = {}
    for part in text.split(","):
        name, _, lengths = part.partition("=")
        if name not in TRL_OBJECTIVES or not lengths:
            raise ValueError(f"--seq-lens for the trl suite looks like sft=4096:16384,dpo=8192; got {part!r}")
        out[name] = _ints(lengths, "--seq-lens", ":")
    return out


def options_by_command() -> dict[str, dict[str, argparse.Action]]:
    """{command: {option string: its argparse action}} of the whole command line (what the docs'
    settings tables and the tests read)."""
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {s: action for action in p._actions for s in action.option_strings}
            for name, p in sub.choices.items()}


def parser() -> argparse.ArgumentParser:
    """The whole command line (``leanbp --help``)."""
    p = argparse.ArgumentParser(prog="leanbp", description="Exact sequence-streamed backprop for long-sequence LM "
                                                           "training.")
    sub = p.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_bench(sub)
    _add_plan(sub)
    _add_verify(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    args.argv = argv
    try:
        return {"train": _train, "bench": _bench, "plan": _plan, "verify": _verify}[args.command](args)
    except (ValueError, NotImplementedError, FileNotFoundError, ImportError) as e:
        _say(f"leanbp {args.command}: error: {e}")
        return 2
    except NonFiniteError as e:
        _say(f"leanbp {args.command}: stopped: {e}")
        return 3


def _say(line: str) -> None:
    """One line on stderr, once per run: of the ranks of a multi-process run, the first that has it."""
    from .train import first_to_report

    if first_to_report():
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
