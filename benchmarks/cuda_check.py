"""The GPU check of leanbp's CUDA path, prepared to run once when a session is lent a GPU.

    python benchmarks/cuda_check.py --out $OUT            # on the GPU machine (about 5 minutes on an H100)
    python benchmarks/cuda_check.py --small --device cpu  # the same script on CPU, tiny shapes (a test)

1. Exactness, per dtype (fp32, bf16): a streamed model's loss and every parameter gradient against
   plain autograd in the same dtype, both measured against a float64 reference (plain autograd,
   math attention); the streamed error must stay within 1.25x of plain autograd's own error (the
   bar of `tests/models/test_families.py`) plus a small floor.
2. Every mask kind on the real kernels (the cases tests/engine/test_cuda_path.py runs on strict CPU
   stand-ins): sliding window 4096 at T = 6000, batch 2 with left and right padding and prefixes
   of 2182 keys (p % 8 = 6), packed documents, soft-capped attention, GQA; fp32 and bf16. The
   device's backend (flash / memory-efficient kernels) against the plain-PyTorch backend on the
   same device, both against a float64 run: the kernels' error within 1.25x of the reference
   backend's plus a floor; which kernels ran is recorded.
3. Host offload at batch 2 (pinned (T, B, H) host memory, side-stream copies): the gradients bit
   for bit those without offload, under deterministic algorithms, with a second run without
   offload as the control.
4. No sync inside the chunk loops: the CUDA syncs of a streamed step with padding and with
   packed documents (``torch.cuda.set_sync_debug_mode``) are as many with 9 chunks as with 3.
5. Speed and memory: a Qwen3-8B-shaped stack (hidden 4096, 32/8 heads, intermediate 12288, vocab
   151936; a few layers) in bf16, one training step per method at each T (median of 3 after one
   warm-up): gradient checkpointing, leanbp, and leanbp with host offload (whose copies should
   hide behind the compute); what the process holds beside its tensors (the CUDA context and
   workspaces: used minus reserved; the allocator's fragmentation: peak reserved minus peak
   allocated), the numbers behind ``leanbp plan``'s default reserve. Beside checkpointing's
   measured peaks, what ``leanbp plan --allocator replay`` predicts for the same steps (the
   tensors' peak, and the allocator's reserved peak from its model replaying the fake step), so
   that a GPU run checks the model.

Writes cuda_check.json (the card, torch, the date, every number) and prints a line per check;
exits 1 if a check fails.
"""

from __future__ import annotations

import os

# deterministic cuBLAS for the bit-for-bit offload check (set before any CUDA call makes a handle)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse
import contextlib
import datetime
import json
import statistics
import time
import warnings
from collections import Counter
from copy import deepcopy as copy_module
from pathlib import Path

import torch
import transformers

import leanbp
from leanbp.bench import synchronize
from leanbp.engine import CUDA_KERNELS, MATH, forced_backend
from leanbp.train import build_model, qwen3_config

QWEN3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936)
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, vocab_size=256)
# the mask-kind models: one layer, GQA, head dim 64 (flash and the efficient kernel both take it)
MASK_MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=512, tie_word_embeddings=False,
                  attn_implementation="sdpa", max_position_embeddings=8192)
DTYPES = (("fp32", torch.float32), ("bf16", torch.bfloat16))


def _grads(model, ids=None, **inputs):
    model.zero_grad(set_to_none=True)
    if ids is not None:
        inputs = dict(input_ids=ids, labels=ids)
    loss = model(**inputs).loss
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
    for name, dtype in DTYPES:
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


# -- every mask kind on the device's kernels ---------------------------------------------------------

def _mask_case(case: str, small: bool, device):
    """(family config, inputs, labels, chunk) of a mask kind; ``small``: CPU-sized."""
    T, B, chunk = (60, 2, 13) if small else ((6000, 1, 1024) if case == "window" else (2500, 2, 1091))
    sizes = dict(MASK_MODEL)
    if small:
        sizes.update(hidden_size=64, intermediate_size=96, head_dim=16)
    if case == "window":
        config = transformers.MistralConfig(**sizes, sliding_window=16 if small else 4096)
    elif case == "softcap":
        config = transformers.Gemma2Config(**{**sizes, "attn_implementation": "eager"}, attn_logit_softcapping=50.0,
                                           sliding_window=16 if small else 4096, query_pre_attn_scalar=sizes["head_dim"])
        T, B = (60, 2) if small else (3000, 2)
    else:
        config = transformers.LlamaConfig(**sizes)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (B, T), generator=g)
    inputs, labels = {"input_ids": ids}, ids.clone()
    if case in ("padding", "softcap"):  # row 0 left-padded, row 1 right-padded
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, :T // 60] = 0
        mask[1, T - T // 8:] = 0
        inputs["attention_mask"] = mask
        labels[mask == 0] = -100
    if case == "documents":  # row 1's second document hides keys from the last chunk's prefix
        starts = [[T * 23 // 25], [T * 10 // 25, T * 23 // 25]]
        inputs["position_ids"] = torch.stack([torch.cat([torch.arange(b - a) for a, b in zip([0, *s], [*s, T])])
                                              for s in starts])
    return config, {k: v.to(device) for k, v in {**inputs, "labels": labels}.items()}, chunk


class _KernelCalls:
    """Counts the CUDA ops the backend calls while active."""

    NAMES = ("flash_fwd", "flash_bwd", "efficient_fwd", "efficient_bwd")

    def __enter__(self):
        self.calls, self._saved = Counter(), {n: getattr(CUDA_KERNELS, n) for n in self.NAMES}
        for name, op in self._saved.items():
            setattr(CUDA_KERNELS, name, lambda *a, _op=op, _n=name, **k: self.calls.update([_n]) or _op(*a, **k))
        return self

    def __exit__(self, *exc):
        for name, op in self._saved.items():
            setattr(CUDA_KERNELS, name, op)


def mask_kinds(device, small: bool):
    rows = []
    for case in ("window", "padding", "documents", "softcap"):
        config, inputs, chunk = _mask_case(case, small, device)
        torch.manual_seed(0)
        base = transformers.AutoModelForCausalLM.from_config(config)

        def streamed(dtype, backend=None):  # (None: the device's own kernels)
            model = leanbp.stream(copy_module(base).to(device=device, dtype=dtype).train(), chunk_size=chunk)
            with forced_backend(backend) if backend is not None else contextlib.nullcontext():
                return _grads(model, **inputs)

        _, ref = streamed(torch.float64, MATH)
        for name, dtype in DTYPES:
            with _KernelCalls() as kernels:
                _, got = streamed(dtype)
            _, math = streamed(dtype, MATH)
            kernel_err, math_err = _error(got, ref), _error(math, ref)
            # on CUDA the window, padding and document cases must reach the CUDA ops (a silent fall
            # back to the reference would pass the error bar); soft-capping never does, by design
            reached = device.type != "cuda" or case == "softcap" or bool(kernels.calls)
            rows.append(dict(case=case, dtype=name, kernel_grad_error=kernel_err, math_grad_error=math_err,
                             kernels=dict(kernels.calls) if case != "softcap" else "leanbp's soft-cap block kernel",
                             ok=kernel_err <= 1.25 * math_err + 1e-6 and reached))
    return rows


def offload_batch2(device, small: bool):
    """Bit for bit: streamed with and without offload, batch 2 with padding, fp32 and bf16, with
    deterministic algorithms (the CUDA attention backwards accumulate with atomics by default). A
    second run without offload is the control: if it differs from the first, the kernels are not
    deterministic here and offload is judged against that spread instead."""
    config, inputs, chunk = _mask_case("padding", small, device)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config)
    rows = []
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for name, dtype in DTYPES:
            results = []
            for offload in (False, False, True):
                model = leanbp.stream(copy_module(base).to(device=device, dtype=dtype).train(), chunk_size=chunk,
                                      offload=offload)
                results.append(_grads(model, **inputs))
            (loss, grads), (_, control), (loss_off, grads_off) = results
            same = bool(torch.equal(loss, loss_off)) and all(torch.equal(grads[n], grads_off[n]) for n in grads)
            control_same = all(torch.equal(grads[n], control[n]) for n in grads)
            spread, offload_err = _error(control, grads), _error(grads_off, grads)
            rows.append(dict(dtype=name, bit_identical=same, control_bit_identical=control_same,
                             control_error=spread, offload_error=offload_err,
                             ok=same or (not control_same and offload_err <= 2 * spread)))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    return rows


def syncs_per_step(device, small: bool):
    """CUDA syncs of one streamed step with padding / with documents, at 3 and 9 chunks."""
    if device.type != "cuda":
        return [dict(case=c, skipped="CUDA only (tests/engine/test_cuda_path.py counts host reads on CPU)", ok=True)
                for c in ("padding", "documents")]
    rows = []
    for case in ("padding", "documents"):
        config, inputs, _ = _mask_case(case, small, device)
        T = inputs["input_ids"].shape[1]
        counts = {}
        for chunks in (3, 9):
            torch.manual_seed(0)
            model = leanbp.stream(transformers.AutoModelForCausalLM.from_config(config).to(device).train(),
                                  chunk_size=-(-T // chunks))
            _grads(model, **inputs)  # warm-up
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    _grads(model, **inputs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            counts[chunks] = sum("synchroniz" in str(w.message) for w in caught)
        rows.append(dict(case=case, syncs_3_chunks=counts[3], syncs_9_chunks=counts[9], ok=counts[3] == counts[9]))
    return rows


# -- speed and memory ---------------------------------------------------------------------------------

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
        synchronize(device)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        synchronize(device)
        if step:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=False)
    row = dict(method=method, T=T, layers=layers, step_s=statistics.median(times))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        row.update(peak_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                   peak_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30,
                   # beside the tensors: the CUDA context, cuBLAS/cuDNN workspaces (used - reserved)
                   outside_allocator_gib=(total - free - torch.cuda.memory_reserved(device)) / 2**30)
        row["fragmentation_gib"] = row["peak_reserved_gib"] - row["peak_gib"]
    if method == "ckpt":  # the allocator's model on the same steps (outputs dropped, gradients kept)
        fit = _planned(config, T, steps + 1)
        row.update(planned_peak_gib=fit.allocated / 2**30, planned_reserved_gib=fit.reserved / 2**30)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _planned(config, T, steps):
    from leanbp.plan import Planner

    # (outputs dropped before backward, gradients resident: zero_grad(set_to_none=False) keeps them)
    return Planner(config, dtype="bf16", hold_outputs=False, replay_steps=steps).allocator("ckpt", T)


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
                  capability=list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
                  torch=torch.__version__, transformers=transformers.__version__, shape=shape)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():  # after every section: a run cut short keeps what it measured
        (out / "cuda_check.json").write_text(json.dumps(result, indent=1))

    result["exactness"] = exactness(shape, device, T=200 if args.small else 2048, chunk=64 if args.small else 512)
    for row in result["exactness"]:
        print(f"exact {row['dtype']}: leanbp {row['leanbp_grad_error']:.2e} vs plain {row['plain_grad_error']:.2e}"
              f" -> {'ok' if row['ok'] else 'FAIL'}", flush=True)
    save()
    result["masks"] = mask_kinds(device, args.small)
    for row in result["masks"]:
        print(f"mask {row['case']} {row['dtype']}: kernels {row['kernel_grad_error']:.2e} vs math "
              f"{row['math_grad_error']:.2e} {row['kernels']} -> {'ok' if row['ok'] else 'FAIL'}", flush=True)
    save()
    result["offload"] = offload_batch2(device, args.small)
    for row in result["offload"]:
        print(f"offload batch 2 {row['dtype']}: bit-identical {row['bit_identical']} (control run "
              f"{row['control_bit_identical']}) -> {'ok' if row['ok'] else 'FAIL'}", flush=True)
    result["syncs"] = syncs_per_step(device, args.small)
    for row in result["syncs"]:
        print(f"syncs {row['case']}: {row.get('skipped') or (row['syncs_3_chunks'], row['syncs_9_chunks'])}", flush=True)
    save()
    result["timing"] = []
    for T in seq_lens:
        pair = {}
        for method in ("ckpt", "leanbp", "leanbp_offload"):
            row = timing(shape, device, 2 if args.small else args.layers, T, method, steps=1 if args.small else 3)
            result["timing"].append(row)
            pair[method] = row["step_s"]
            save()
            if "peak_reserved_gib" in row and "planned_reserved_gib" in row:
                print(f"T={T} ckpt memory: allocated {row['peak_gib']:.2f} GiB (planned {row['planned_peak_gib']:.2f}), "
                      f"reserved {row['peak_reserved_gib']:.2f} GiB (the allocator's model "
                      f"{row['planned_reserved_gib']:.2f})", flush=True)
        print(f"T={T}: ckpt {pair['ckpt']:.3f} s, leanbp {pair['leanbp']:.3f} s "
              f"({pair['leanbp'] / pair['ckpt']:.3f}x), leanbp + offload {pair['leanbp_offload']:.3f} s "
              f"({pair['leanbp_offload'] / pair['ckpt']:.3f}x)", flush=True)
    print(f"wrote {out / 'cuda_check.json'}")
    checks = [row["ok"] for key in ("exactness", "masks", "offload", "syncs") for row in result[key]]
    return 0 if all(checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
