"""One benchmark case, run in its own process so that peaks and allocator state never mix.

    python -m leanbp.bench._case '{"method": "leanbp", "seq_len": 4096, ...}'

prints one JSON line: peak/params/grads/activation bytes of a training step and its time.
"""

from __future__ import annotations

import json
import sys
import time

import torch

METHODS = ("plain", "ckpt", "leanbp")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(spec: dict) -> dict:
    from .. import memory, stream
    from .._builtin import BENCH_QWEN3, build_model, qwen3_config

    method = spec["method"]
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    device = torch.device(spec.get("device", "cpu"))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec.get("dtype", "fp32")]
    T, B = spec["seq_len"], spec.get("batch", 1)
    model = build_model(qwen3_config(BENCH_QWEN3, max_positions=max(T, 2048)), dtype=dtype).to(device).train()
    if method == "ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif method == "leanbp":
        stream(model, chunk_size=spec.get("chunk_size", 1024), head_chunk_size=spec.get("head_chunk_size", 512))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=gen).to(device)

    def step():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss if method != "leanbp" else \
            model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item()

    # Steady state of a training loop: parameters and their gradients are resident, so
    # peak - params - grads is exactly the memory the step needs on top of them.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    # step 1: memory (also warms up kernels and the allocator)
    with memory.track(model, device=device) as mem:
        loss = step()
    model.zero_grad(set_to_none=False)
    # step 2: time, with nothing watching
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    seconds = time.perf_counter() - t0
    r = mem.report
    return {**spec, "loss": loss, "peak": r.peak, "params": r.params, "grads": r.grads,
            "activations": r.activations, "step_s": seconds}


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    print("LEANBP_CASE " + json.dumps(run_case(json.loads(sys.argv[1]))), flush=True)
