"""How close is `leanbp plan --gpus/--engine/--optimizer` to a real rank? One rank's whole memory
(weights, gradients, optimizer state, the engine's buffers, activations) measured on the CPU with
gloo, against the planner's prediction for the same set-up.

    python benchmarks/plan_setups_calibration.py --out benchmarks/results/plan_setups

Each case runs `--world` processes (gloo; one process for engine single), each entering
`leanbp.plan.RankMemory` before it builds the model, so that every storage the model, the engine
and the optimizer make is counted; one warm-up step creates the optimizer state, the gradients are
then made resident (zeros, the planner's steady state; DeepSpeed keeps its own), and the next step
(forward, backward, optimizer step) is measured on rank 0, less the model's own buffers (RoPE
tables; the plan counts parameters, not buffers). The planner predicts the same step
(`Planner.peak(method, T, optimizer=True)`). The optimizer is `torch.optim.AdamW(fused=True)` (the
plan's assumption: a fused step, no temporaries): on fp32 weights that is `--optimizer adamw`, on
bf16 weights `--optimizer adamw-bf16`. The engines are set up as `leanbp train` sets them up
(DDP's defaults; `fully_shard` per decoder layer and the root; DeepSpeed ZeRO-2/3 with its own
defaults around the same AdamW).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = [  # (engine, optimizer, dtype, method)
    ("single", "adamw", "fp32", "ckpt"), ("single", "adamw", "fp32", "leanbp"),
    ("single", "adamw-bf16", "bf16", "leanbp"),
    ("ddp", "adamw", "fp32", "ckpt"), ("ddp", "adamw", "fp32", "leanbp"),
    ("fsdp2", "adamw", "fp32", "ckpt"), ("fsdp2", "adamw", "fp32", "leanbp"),
    ("zero2", "adamw", "fp32", "leanbp"), ("zero3", "adamw", "fp32", "leanbp"),
]
SHAPE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=8192, tie_word_embeddings=False)


def config():
    import transformers

    return transformers.Qwen3Config(**SHAPE, max_position_embeddings=8192, attn_implementation="sdpa")


def _rank(rank: int, world: int, case: dict, port: int, out: str) -> None:
    import leanbp
    from leanbp import StreamConfig
    from leanbp.plan import RankMemory, training_step
    from leanbp.streaming import apply_method

    engine, dtype = case["engine"], {"fp32": torch.float32, "bf16": torch.bfloat16}[case["dtype"]]
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if engine.startswith("zero"):
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo", rank=rank, world_size=world)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, case["seq_len"]))
    stream = StreamConfig(chunk_size=case["chunk_size"], head_chunk_size=case["head_chunk_size"])
    import transformers

    with RankMemory() as mem:
        model = transformers.AutoModelForCausalLM.from_config(config(), dtype=dtype).train()
        apply_method(model, case["method"], stream)
        module = model
        if engine == "ddp":
            module = torch.nn.parallel.DistributedDataParallel(model)
        elif engine == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            from leanbp.models import adapter_for
            from leanbp.streaming import causal_lm_of

            for layer in adapter_for(causal_lm_of(model)).layers():
                fully_shard(layer)
            fully_shard(model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
        if engine.startswith("zero"):
            import deepspeed

            ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": int(engine[-1])}, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 10**9}
            module, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)

        def step():
            if engine.startswith("zero"):
                loss = module(input_ids=ids, labels=ids, use_cache=False).loss
                module.backward(loss)
                module.step()
            else:
                training_step(module, ids)
                optimizer.step()

        step()  # warm-up: the optimizer's state exists from here on
        if not engine.startswith("zero"):
            for p in model.parameters():  # steady state: gradients resident (the plan's assumption)
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        with mem.window() as w:
            step()
        buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    if rank == 0:
        Path(out).write_text(json.dumps({"peak": w.peak - buffers, "start": w.start - buffers,
                                         "buffers": buffers}))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def measure(case: dict, world: int) -> dict:
    import tempfile

    out = Path(tempfile.mkdtemp()) / "rank0.json"
    if case["engine"] == "single":
        _rank(0, 1, case, 0, str(out))
    else:
        port = 29500 + (os.getpid() % 1000)
        mp.start_processes(_rank, args=(world, case, port, str(out)), nprocs=world, start_method="spawn")
    return json.loads(out.read_text())


def predict(case: dict, world: int):
    from leanbp import StreamConfig
    from leanbp.plan import Planner, Setup

    setup = Setup(gpus=1 if case["engine"] == "single" else world, engine=case["engine"],
                  optimizer=case["optimizer"], host_memory=2**40)
    planner = Planner(config(), dtype=case["dtype"], setup=setup,
                      stream=StreamConfig(chunk_size=case["chunk_size"], head_chunk_size=case["head_chunk_size"]))
    return planner.peak(case["method"], case["seq_len"], optimizer=True, probe=True), planner.rank()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--head-chunk-size", type=int, default=256)
    parser.add_argument("--engines", default=None, help="only these engines (comma-separated)")
    parser.add_argument("--out", default="plan_setups")
    args = parser.parse_args()
    rows = []
    for engine, optimizer, dtype, method in CASES:
        if args.engines and engine not in args.engines.split(","):
            continue
        case = dict(engine=engine, optimizer=optimizer, dtype=dtype, method=method, seq_len=args.seq_len,
                    chunk_size=args.chunk_size, head_chunk_size=args.head_chunk_size)
        t0 = time.perf_counter()
        real = measure(case, args.world)
        peak, rank = predict(case, args.world)
        row = dict(case, world=1 if engine == "single" else args.world, measured=real["peak"],
                   measured_resident=real["start"], planned=peak.total, planned_phase=peak.phase,
                   planned_resident=rank.weights + rank.grads + rank.optimizer + rank.buffers,
                   difference=peak.total - real["peak"], rel=peak.total / real["peak"] - 1,
                   seconds=time.perf_counter() - t0)
        rows.append(row)
        print(f"{engine:6s} {optimizer:10s} {dtype} {method:8s} measured {real['peak']:>13,} planned {peak.total:>13,}"
              f" ({100 * row['rel']:+.3f}%, {row['difference']:+,} B); resident measured {real['start']:,} "
              f"planned {row['planned_resident']:,}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "setups.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "setups.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
