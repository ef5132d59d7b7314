"""One benchmark case, run in its own process so that peaks and allocator state never mix.

    python -m leanbp.bench._case '{"method": "leanbp", "seq_len": 4096, ...}'

prints one JSON line: peak/params/grads/activation bytes of a training step and its time.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from .._dtypes import dtype_named
from ..approx import approx, variant_settings
from ..memory import track
from ..streaming import StreamConfig, apply_method, chunk_size_used, is_streamed
from ..train import build_model
from ._models import bench_config, nf4_reloaded
from ._peers import PEERS, peer_loss, prepare_peer
from ._timing import synchronize

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_case_model(spec: dict):
    """The model of a case: bench shape, dtype, optional 4-bit base weights (``quantize``: with LoRA,
    QLoRA), optional LoRA, optional approximation, then the method (``leanbp.streaming.METHODS`` with
    the case's ``StreamConfig``, or a peer of ``PEERS``)."""
    dtype_name = spec.get("dtype", "fp32")
    # "autocast": fp32 weights, bf16 compute (run_case enters autocast)
    dtype = dtype_named("fp32" if dtype_name == "autocast" else dtype_name)
    T = spec["seq_len"]
    config = bench_config(spec.get("model", "qwen3"), max_positions=max(T, 2048))
    model = build_model(config, dtype=dtype)
    device, quantized = spec.get("device", "cpu"), spec.get("quantize", "none") != "none"
    model = (nf4_reloaded(model, device) if quantized else model.to(device)).train()
    top = model
    if spec.get("lora") or quantized:
        import peft

        top = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    variant = spec.get("approx", "none")
    if variant != "none":
        approx(model, **variant_settings(variant))
    if spec["method"] in PEERS:
        prepare_peer(model, spec["method"])
    else:
        apply_method(model, spec["method"], StreamConfig(**spec.get("stream", {})))
    return top, model.config


def run_case(spec: dict) -> dict:
    device = torch.device(spec.get("device", "cpu"))
    T, B = spec["seq_len"], spec.get("batch", 1)
    model, config = build_case_model(spec)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (B, T), generator=gen).to(device)

    # "autocast": fp32 parameters, bf16 compute (mixed precision, as in most fine-tuning)
    use_autocast = spec.get("dtype") == "autocast"

    tile_rows = StreamConfig(**spec.get("stream", {})).head_chunk_size  # (a peer's loss tiles: leanbp's head chunk)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            if spec["method"] in PEERS:
                loss = peer_loss(model, ids, ids, tile_rows, spec["method"])
            else:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.item()

    # Steady state of a training loop: parameters and their gradients are resident, so
    # peak - params - grads is exactly the memory the step needs on top of them.
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    # step 1: memory (also warms up kernels and the allocator)
    with track(model, device=device) as mem:
        loss = step()
    model.zero_grad(set_to_none=False)
    # then time, with nothing watching: the median of `timed_steps` steps
    times = []
    for _ in range(spec.get("timed_steps", 1)):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=False)
    seconds = sorted(times)[len(times) // 2]
    r = mem.report
    rows = chunk_size_used(model) if is_streamed(model) else None  # (None with layers=False)
    return {**spec, "loss": loss, "peak": r.peak, "params": r.params, "grads": r.grads,
            "activations": r.activations, "host": r.host, "step_s": seconds, "chunk_rows": rows}


def run_any_case(spec: dict) -> dict:
    """The one entry point of every suite's cases: a TRL case, or a stream / approx one."""
    if spec.get("suite") == "trl":
        from ._trl_case import run_trl_case

        return run_trl_case(spec)
    return run_case(spec)


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    print("LEANBP_CASE " + json.dumps(run_any_case(json.loads(sys.argv[1]))), flush=True)
