"""Attention backends behind the (out, lse) interface: the CPU flash kernel against the plain
PyTorch reference, the CUDA kernels' glue with stand-ins that follow the CUDA kernels' contracts,
the glue's calls against the real CUDA ops' schemas (meta tensors), and a streamed model whose
chunk attention runs on the reference backend."""

from __future__ import annotations

import pytest
import torch

import leanbp
from conftest import tiny_model
from _cuda_ops import StrictCudaOps
from _helpers import REPO, make_batch
from leanbp.engine import _attention
from leanbp.engine import ChunkMasks, KeyKeep, chunk_attention
from leanbp.engine import CPU_FLASH, MATH, CudaKernels

TOL = dict(rtol=1e-12, atol=1e-12)


def _block(B=2, Hq=4, Hkv=2, c=9, k=9, D=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, c, D, generator=g, dtype=dtype)
    key = torch.randn(B, Hkv, k, D, generator=g, dtype=dtype)
    value = torch.randn(B, Hkv, k, D, generator=g, dtype=dtype)
    return q, key, value


def _padding_bias(B, k, dtype=torch.float64):
    keep = torch.ones(B, k, dtype=torch.bool)
    keep[0, :3] = False  # row 0 is left-padded
    return torch.zeros(B, 1, 1, k, dtype=dtype).masked_fill_(~keep[:, None, None], float("-inf"))


def _cpu_flash_matches_the_reference(q, k, v, causal, bias):
    """CPU_FLASH's forward and backward equal MATH's to 1e-12 (float64)."""
    out, lse = CPU_FLASH.forward(q, k, v, causal, bias, 0.3)
    out_ref, lse_ref = MATH.forward(q, k, v, causal, bias, 0.3)
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)
    dout = torch.randn_like(out)
    for got, want in zip(CPU_FLASH.backward(dout, q, k, v, out, lse, causal, bias, 0.3),
                         MATH.backward(dout, q, k, v, out, lse, causal, bias, 0.3)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("causal,padded", [(True, False), (False, False), (False, True)])
def test_cpu_flash_matches_the_reference_forward_and_backward(causal, padded):
    q, k, v = _block(c=9, k=9 if causal else 13)
    bias = _padding_bias(2, k.shape[2]) if padded else None
    _cpu_flash_matches_the_reference(q, k, v, causal, bias)


@pytest.mark.parametrize("Hq,Hkv,c,causal,padded,folds", [
    (4, 2, 9, False, False, True),      # a prefix block of grouped heads: one head of 2 x 9 rows
    (4, 1, 9, False, False, True),      # one K/V head for all four
    (4, 2, 9, True, False, False),      # a causal block: the mask follows each row's position
    (4, 2, 9, False, True, False),      # a bias is per row and key
    (4, 4, 9, False, False, False),     # no grouping
    (4, 2, 768, False, False, False),   # long enough for the kernel's large query blocks
])
def test_cpu_flash_folds_grouped_query_heads_only_where_it_is_the_same_attention(Hq, Hkv, c, causal, padded, folds):
    q, k, v = _block(B=2, Hq=Hq, Hkv=Hkv, c=c, k=c if causal else 13)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # the projections' (B, c, H, D) memory
    bias = _padding_bias(2, k.shape[2]) if padded else None
    assert CPU_FLASH._folds(q, k, causal, bias) is folds
    _cpu_flash_matches_the_reference(q, k, v, causal, bias)


def test_reference_backward_is_the_gradient_of_its_forward():
    q, k, v = _block(c=7, k=11)
    bias = _padding_bias(2, 11)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = MATH.forward(*leaves, False, bias, 0.5)
    dout = torch.randn_like(out)
    autograd = torch.autograd.grad(out, leaves, dout)
    with torch.no_grad():
        out, lse = MATH.forward(q, k, v, False, bias, 0.5)
        mine = MATH.backward(dout, q, k, v, out, lse, False, bias, 0.5)
    for got, want in zip(mine, autograd):
        torch.testing.assert_close(got, want, **TOL)


def _chunk(backend, monkeypatch, dtype=torch.float64, padded=True):
    """One chunk [20, 29) of a 29-row sequence (prefix of 20 keys), GQA, left padding: out and
    the gradients of query, own K/V and prefix K/V, with chunk attention on ``backend``."""
    monkeypatch.setattr(_attention, "backend_for", lambda device: backend)
    q, own_k, own_v = _block(c=9, k=9, dtype=dtype, seed=1)
    _, pre_k, pre_v = _block(c=9, k=20, dtype=dtype, seed=2)
    keep = torch.ones(2, 29, dtype=torch.bool)
    if padded:
        keep[0, :3] = False
    masks = ChunkMasks(20, 29, 0, None, KeyKeep(keep) if padded else None, torch.device("cpu"))
    leaves = [t.clone().requires_grad_() for t in (q, pre_k, pre_v, own_k, own_v)]
    out = chunk_attention(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], masks, scale=0.35)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


@pytest.mark.parametrize("padded", [True, False])
def test_cuda_glue_with_contract_stand_ins_matches_the_cpu_kernel(monkeypatch, padded):
    """fp32 runs the efficient kernel (float64 here, which the stand-ins allow for an exact check):
    heads repeated and summed back, bias expanded in aligned memory, lse trimmed and re-padded, the
    prefix split into key blocks (5 rows here)."""
    ops = StrictCudaOps(float64=True)
    want = _chunk(CPU_FLASH, monkeypatch, padded=padded)
    got = _chunk(ops.backend(repeat_block_rows=5), monkeypatch, padded=padded)
    assert ops.calls["efficient_fwd"] == 1 + 4 and ops.calls["flash_fwd"] == 0  # own + 20 prefix keys by 5
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_cuda_glue_takes_flash_for_half_precision_without_a_bias(monkeypatch):
    ops = StrictCudaOps()
    want = _chunk(MATH, monkeypatch, dtype=torch.bfloat16, padded=False)
    got = _chunk(ops.backend(), monkeypatch, dtype=torch.bfloat16, padded=False)
    assert ops.calls["flash_fwd"] == 2 and ops.calls["flash_bwd"] == 2 and ops.calls["efficient_fwd"] == 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)  # the same reference arithmetic, glue aside


@pytest.mark.parametrize("dtype,padded", [(torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_cuda_glue_calls_match_the_real_ops_schemas(dtype, padded):
    """The real CUDA ops on meta tensors: the arguments parse, and the outputs have the shapes the
    merge and the sink expect (lse (B, Hq, c), K/V gradients with Hkv heads); the device probes
    answered as an H100 would (meta tensors have no device to ask)."""
    cuda = CudaKernels(capability=lambda device: (9, 0), flash_built=lambda: True)
    B, Hq, Hkv, c, k, D = 2, 8, 2, 100, 300, 64
    q = torch.empty(B, Hq, c, D, dtype=dtype, device="meta")
    key = torch.empty(B, Hkv, k, D, dtype=dtype, device="meta")
    bias = torch.zeros(B, 1, 1, k, dtype=dtype, device="meta") if padded else None
    out, lse = cuda.forward(q, key, key, False, bias, 0.125)
    assert out.shape == q.shape and lse.shape == (B, Hq, c) and lse.dtype == torch.float32
    dq, dk, dv = cuda.backward(torch.empty_like(out), q, key, key, out, lse, False, bias, 0.125)
    assert dq.shape == q.shape and dk.shape == key.shape and dv.shape == key.shape


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_streamed_model_on_the_reference_backend_matches_the_cpu_kernel(monkeypatch, family):
    """Every chunk attention of a streamed float64 model (padding, a prompt inside a chunk) on the
    plain-PyTorch backend: loss and every parameter gradient as with the CPU flash kernel."""
    model = tiny_model(family)
    ids, mask, labels = make_batch(vocab=model.config.vocab_size)
    leanbp.stream(model, chunk_size=7)
    results = {}
    for name, backend in (("cpu_flash", CPU_FLASH), ("math", MATH)):
        calls = []
        monkeypatch.setattr(_attention, "backend_for", lambda device, b=backend: calls.append(b) or b)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        assert calls and all(b is backend for b in calls)  # the chunks really ran on this backend
        results[name] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    (loss, grads), (loss_ref, grads_ref) = results["cpu_flash"], results["math"]
    torch.testing.assert_close(loss, loss_ref, **TOL)
    assert len(grads) == len(list(model.parameters()))
    for n in grads:
        torch.testing.assert_close(grads[n], grads_ref[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")


def test_the_prepared_gpu_check_runs_on_cpu(tmp_path):
    """`benchmarks/cuda_check.py` is run once when a GPU is lent: its CPU run (tiny shapes) keeps it
    working, with the streamed error within the bar of plain autograd's in fp32 and bf16, every mask
    kind within the bar of the reference backend's, and offload at batch 2 bit for bit."""
    import json
    import subprocess
    import sys

    script = REPO / "benchmarks" / "cuda_check.py"
    proc = subprocess.run([sys.executable, str(script), "--small", "--device", "cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "cuda_check.json").read_text())
    assert [r["dtype"] for r in result["exactness"]] == ["fp32", "bf16"] and all(r["ok"] for r in result["exactness"])
    assert {(r["case"], r["dtype"]) for r in result["masks"]} == {
        (c, d) for c in ("window", "padding", "documents", "softcap") for d in ("fp32", "bf16")}
    assert all(r["ok"] for r in result["masks"]) and all(r["bit_identical"] for r in result["offload"])
    assert {r["method"] for r in result["timing"]} == {"ckpt", "leanbp", "leanbp_offload"}
    # the allocator's model beside checkpointing's measured peaks (a GPU run compares them): twice the
    # rows, more planned memory
    planned = [(r["planned_peak_gib"], r["planned_reserved_gib"]) for r in result["timing"] if r["method"] == "ckpt"]
    assert len(planned) == 2 and planned[1][0] > planned[0][0] and planned[1][1] > planned[0][1]
