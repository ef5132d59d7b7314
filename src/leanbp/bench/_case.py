"""One benchmark case, run in its own process so that peaks and allocator state never mix.

    python -m leanbp.bench._case '{"method": "leanbp", "seq_len": 4096, ...}'

prints one JSON line: peak/params/grads/activation bytes of a training step and its time.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ._timing import synchronize

# head: transformers' decoder + leanbp's chunked loss; leanbp_auto: leanbp with chunk_size="auto";
# leanbp_offload: leanbp with the hidden states between layers in host memory (its host bytes are reported apart)
METHODS = ("plain", "ckpt", "leanbp", "leanbp_auto", "leanbp_offload", "head")
APPROX = ("none", "act", "norm", "both")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_case_model(spec: dict):
    """The model of a case: bench shape, dtype, optional LoRA, optional approximation, method."""
    import transformers

    from .. import approx, stream
    from ..engine import StreamConfig
    from .._builtin import BENCH_LLAMA, bench_config, build_model

    method, variant = spec["method"], spec.get("approx", "none")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    if variant not in APPROX:
        raise ValueError(f"unknown approx {variant!r}; choose from {APPROX}")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "autocast": torch.float32}[spec.get("dtype", "fp32")]
    T = spec["seq_len"]
    if spec.get("model", "qwen3") == "llama":
        config = transformers.LlamaConfig(**BENCH_LLAMA, max_position_embeddings=max(T, 2048),
                                          attn_implementation="sdpa")
    else:
        config = bench_config(spec.get("model", "qwen3"), max_positions=max(T, 2048))
    model = build_model(config, dtype=dtype).to(spec.get("device", "cpu")).train()
    if method == "ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    top = model
    if spec.get("lora"):
        import peft

        top = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    if variant != "none":
        approx(model, activations=variant in ("act", "both"), norms=variant in ("norm", "both"))
    if method in ("leanbp", "leanbp_auto", "leanbp_offload", "head"):
        stream(model, chunk_size="auto" if method == "leanbp_auto" else spec.get("chunk_size", StreamConfig.chunk_size),
               head_chunk_size=spec.get("head_chunk_size", StreamConfig.head_chunk_size),
               layers=method != "head", offload=method == "leanbp_offload")
    return top, model.config


def run_case(spec: dict) -> dict:
    from .. import memory
    from ..engine import chunk_size_used, is_streamed

    device = torch.device(spec.get("device", "cpu"))
    T, B = spec["seq_len"], spec.get("batch", 1)
    model, config = build_case_model(spec)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (B, T), generator=gen).to(device)

    # "autocast": fp32 parameters, bf16 compute (mixed precision, as in most fine-tuning)
    use_autocast = spec.get("dtype") == "autocast"

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.item()

    # Steady state of a training loop: parameters and their gradients are resident, so
    # peak - params - grads is exactly the memory the step needs on top of them.
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    # step 1: memory (also warms up kernels and the allocator)
    with memory.track(model, device=device) as mem:
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


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    case = json.loads(sys.argv[1])
    if case.get("suite") == "trl":
        from ._trl_case import run_trl_case as run_case  # noqa: F811 (one entry point, two suites)
    print("LEANBP_CASE " + json.dumps(run_case(case)), flush=True)
