"""The GPU check of the CUDA attention backend, prepared to run once when a session is lent a GPU.

    python benchmarks/cuda_check.py --out $OUT            # on the GPU machine (about 5 minutes)
    python benchmarks/cuda_check.py --small --device cpu  # the same script on CPU, tiny shapes

1. Exactness, per dtype (fp32, bf16): a streamed model's loss and every parameter gradient against
   plain autograd in the same dtype, both measured against a float64 reference (plain autograd,
   math attention); the streamed error must stay within 1.25x of plain autograd's own error (the
   bar of `tests/test_families.py`) plus a small floor.
2. Speed and memory: a Qwen3-8B-shaped stack (hidden 4096, 32/8 heads, intermediate 12288, vocab
   151936; a few layers) in bf16, one training step per method at each T (median of 3 after one
   warm-up): gradient checkpointing, leanbp, and leanbp with host offload (whose copies should
   hide behind the compute).

Writes cuda_check.json (the card, torch, the date, every number) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from copy import deepcopy as copy_module
from pathlib import Path

import torch

import leanbp
from leanbp._builtin import build_model, qwen3_config
from leanbp.bench._case import _sync

QWEN3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936)
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, vocab_size=256)


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}


def _error(grads, ref):
    """Relative error of the whole gradient: ||g - g_ref|| / ||g_ref|| over all parameters."""
    num = sum(float((grads[n] - ref[n]).norm() ** 2) for n in ref) ** 0.5
    den = sum(float(ref[n].norm() ** 2) for n in ref) ** 0.5
    return num / den


def exactness(shape, device, T, chunk):
    config = qwen3_config(dict(shape, num_hidden_layers=2), max_positions=max(T, 2048))
    ids = torch.randint(0, shape["vocab_size"], (1, T), generator=torch.Generator().manual_seed(0)).to(device)
    base = build_model(config)  # fp32 weights; every model below is a cast copy of them

    def copy(dtype):
        return copy_module(base).to(device=device, dtype=dtype).train()

    reference = copy(torch.float64)
    reference.config._attn_implementation = "eager"  # (float64 on CUDA: no fused kernel takes it)
    ref_loss, ref = _grads(reference, ids)
    rows = []
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        plain = copy(dtype)
        plain.config._attn_implementation = "sdpa"
        plain_loss, plain_grads = _grads(plain, ids)
        streamed = leanbp.stream(copy(dtype), chunk_size=chunk)
        loss, grads = _grads(streamed, ids)
        plain_err, leanbp_err = _error(plain_grads, ref), _error(grads, ref)
        rows.append(dict(dtype=name, T=T, chunk=chunk, plain_grad_error=plain_err, leanbp_grad_error=leanbp_err,
                         plain_loss_error=float(abs(plain_loss - ref_loss)),
                         leanbp_loss_error=float(abs(loss - ref_loss)),
                         ok=leanbp_err <= 1.25 * plain_err + 1e-6))
    return rows


def timing(shape, device, layers, T, method, steps=3):
    config = qwen3_config(dict(shape, num_hidden_layers=layers), max_positions=max(T, 2048))
    model = build_model(config, dtype=torch.bfloat16).to(device).train()
    if method == "ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        leanbp.stream(model, offload=method == "leanbp_offload")
    ids = torch.randint(0, shape["vocab_size"], (1, T), device=device)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(steps + 1):  # the first is the warm-up
        _sync(device)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        _sync(device)
        if step:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=False)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(method=method, T=T, layers=layers, step_s=statistics.median(times), peak_gib=peak)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU run of the script itself)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-lens", default="8192,32768")
    parser.add_argument("--out", default="benchmarks/results/cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shape = SMALL if args.small else QWEN3_8B
    seq_lens = [256, 512] if args.small else [int(t) for t in args.seq_lens.split(",")]
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, shape=shape)
    result["exactness"] = exactness(shape, device, T=200 if args.small else 2048, chunk=64 if args.small else 512)
    for row in result["exactness"]:
        print(f"exact {row['dtype']}: leanbp {row['leanbp_grad_error']:.2e} vs plain {row['plain_grad_error']:.2e}"
              f" -> {'ok' if row['ok'] else 'FAIL'}", flush=True)
    result["timing"] = []
    for T in seq_lens:
        pair = {}
        for method in ("ckpt", "leanbp", "leanbp_offload"):
            row = timing(shape, device, 2 if args.small else args.layers, T, method, steps=1 if args.small else 3)
            result["timing"].append(row)
            pair[method] = row["step_s"]
        print(f"T={T}: ckpt {pair['ckpt']:.3f} s, leanbp {pair['leanbp']:.3f} s "
              f"({pair['leanbp'] / pair['ckpt']:.3f}x), leanbp + offload {pair['leanbp_offload']:.3f} s "
              f"({pair['leanbp_offload'] / pair['ckpt']:.3f}x)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cuda_check.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'cuda_check.json'}")
    return 0 if all(row["ok"] for row in result["exactness"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
