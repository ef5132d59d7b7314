"""The CUDA attention path on CPU: the CUDA backend's own glue runs every mask kind through strict
stand-ins of the four CUDA ops (tests/_cuda_ops.py enforces the kernels' preconditions), each
streamed step equal to the same step on the plain-PyTorch backend; and the review's findings on
the path, each with the test that caught it."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import leanbp
from _cuda_ops import StrictCudaOps
from conftest import tiny_model
from leanbp.engine import _attention
from leanbp.engine import ChunkMasks, KeyKeep, PrefixGradSink, chunk_attention
from leanbp.engine import MATH, CudaKernels

CPU = torch.device("cpu")

# one layer of the tiny test model (GQA: 4 query heads on 2 K/V heads, head dim 16)
ONE_LAYER = dict(num_hidden_layers=1, max_position_embeddings=8192)


def _packed_positions(T: int, starts_per_row: list[list[int]]) -> torch.Tensor:
    """(B, T) position ids restarting at each document start."""
    rows = []
    for starts in starts_per_row:
        bounds = [0, *starts, T]
        rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])]))
    return torch.stack(rows)


def _batch(case: str, vocab: int):
    """(inputs, labels) of each mask kind."""
    g = torch.Generator().manual_seed(0)
    if case == "window":  # Mistral's default window at T ~ 6000: prefixes of 4095 keys from chunk 5 on
        T, B = 6000, 1
    else:  # chunks of 1091: prefixes of 1091 and 2182 keys (> 2048, p % 8 = 6, p % 4 = 2)
        T, B = 2500, 2
    ids = torch.randint(0, vocab, (B, T), generator=g)
    inputs = {"input_ids": ids}
    labels = ids.clone()
    if case == "padding":  # row 0 left-padded, row 1 right-padded
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, :37] = 0
        mask[1, T - 301:] = 0
        inputs["attention_mask"] = mask
        labels[mask == 0] = -100
    if case == "documents":  # packed rows: row 1's second document hides keys [0, 1000) from the
        # prefix of 2182 keys that the last chunk's first segment sees; both rows start one at 2300
        inputs["position_ids"] = _packed_positions(T, [[2300], [1000, 2300]])
    return inputs, labels


CASES = {  # case: (family, window, chunk)
    "window": ("mistral", 4096, 1024),
    "padding": ("llama", None, 1091),
    "documents": ("qwen3", None, 1091),
}


def _grads_on(backend, model, inputs, labels, monkeypatch):
    monkeypatch.setattr(_attention, "backend_for", lambda device: backend)
    model.zero_grad(set_to_none=True)
    loss = model(**inputs, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


TOLERANCES = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("case,dtype", [
    ("window", torch.float64), ("window", torch.bfloat16),
    ("padding", torch.float64), ("padding", torch.float32), ("padding", torch.bfloat16),
    ("documents", torch.float64), ("documents", torch.float32),
])
def test_every_mask_kind_runs_the_cuda_glue_through_the_strict_ops(monkeypatch, case, dtype):
    """Sliding window 4096 at T = 6000, batch 2 with left and right padding and prefixes over 2048
    keys with p % 8 != 0, packed documents; GQA throughout; float64 (stand-ins that take it, for an
    exact check), fp32 and bf16 (the real kernels' dtype rules): loss and every gradient as on the
    plain-PyTorch backend."""
    family, window, chunk = CASES[case]
    model = tiny_model(family, dtype=dtype, window=window, **ONE_LAYER)
    inputs, labels = _batch(case, model.config.vocab_size)
    leanbp.stream(model, chunk_size=chunk)
    ops = StrictCudaOps(float64=dtype == torch.float64)
    loss, grads = _grads_on(ops.backend(), model, inputs, labels, monkeypatch)
    assert ops.calls["efficient_fwd"] + ops.calls["flash_fwd"] > 0  # the CUDA ops really ran
    if case != "window" or dtype != torch.float64:  # (float64 runs the efficient kernel only)
        assert ops.calls["efficient_bwd"] > 0  # a bias in every case: window, padding, documents
    ref_loss, ref_grads = _grads_on(MATH, model, inputs, labels, monkeypatch)
    tol = TOLERANCES[dtype]
    assert abs(loss - ref_loss) <= tol * abs(ref_loss)
    for name, ref in ref_grads.items():
        err = ((grads[name].double() - ref.double()).norm() / ref.double().norm()).item()
        assert err <= tol, (name, err)


def test_soft_capped_attention_never_reaches_the_cuda_ops_and_stays_exact(monkeypatch):
    """Gemma2's soft-capped logits go to leanbp's block kernel on every device (SDPA cannot cap):
    with the CUDA backend installed, no CUDA op runs and the streamed step equals plain autograd."""
    from _helpers import compare_step, make_batch

    ops = StrictCudaOps(float64=True)
    monkeypatch.setattr(_attention, "backend_for", lambda device: ops.backend())
    model = tiny_model("gemma2", window=16)
    loss_err, _, errors = compare_step(model, dict(chunk_size=7), make_batch(vocab=model.config.vocab_size))
    assert sum(ops.calls.values()) == 0
    assert loss_err <= 1e-12 and max(errors.values()) <= 1e-10, (loss_err, errors)


# -- the review's findings -------------------------------------------------------------------------

def _chunk_call(backend, monkeypatch, *, dtype=torch.bfloat16, B=1, Hq=4, Hkv=2, D=16, start=40, end=49,
                key_begin=0, window=None, keep=None):
    """One chunk [start, end) against its prefix, as a layer's backward runs it (the prefix's K/V
    gradients into a sink): (out, dq, d prefix K, d prefix V, d own K, d own V)."""
    monkeypatch.setattr(_attention, "backend_for", lambda device: backend)
    g = torch.Generator().manual_seed(1)
    c, p = end - start, start - key_begin
    q = torch.randn(B, Hq, c, D, generator=g).to(dtype)
    pk, pv = (torch.randn(B, Hkv, p, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, Hkv, c, D, generator=g).to(dtype) for _ in range(2))
    masks = ChunkMasks(start, end, key_begin, window, None if keep is None else KeyKeep(keep), CPU)
    sink = PrefixGradSink(*(torch.zeros(B, Hkv, start, D, dtype=dtype) for _ in range(2)))
    leaves = [t.clone().requires_grad_() for t in (q, pk, pv, k, v)]
    out = chunk_attention(*leaves, masks, scale=0.25, sink=sink)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    dq, dk, dv = torch.autograd.grad(out, [leaves[0], leaves[3], leaves[4]], dout)
    return [out.detach(), dq, sink.dkey[:, :, key_begin:], sink.dvalue[:, :, key_begin:], dk, dv]


def _assert_close(got, want, tol):
    for a, b in zip(got, want):
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() <= tol


def test_finding_1_a_bias_block_sliced_from_a_wider_bias_is_realigned(monkeypatch):
    """A sliding window of 4096 on chunk [4096, 5120): the prefix bias is (1, 1, 1024, 4095), so its
    2048-key backward blocks keep a row stride of 4095; the efficient kernel needs multiples of
    8 (bf16) / 4 (fp32). Before the fix: "attn_bias is not correctly aligned (strideM)"."""
    for dtype in (torch.bfloat16, torch.float32):
        ops = StrictCudaOps()
        got = _chunk_call(ops.backend(), monkeypatch, dtype=dtype, Hq=2, Hkv=1, start=4096, end=5120,
                          key_begin=1, window=4096)
        # the prefix in two 2048-key blocks (+ the own block in fp32; bf16 takes flash there)
        assert ops.calls["efficient_bwd"] == 2 + (dtype == torch.float32)
        want = _chunk_call(MATH, monkeypatch, dtype=dtype, Hq=2, Hkv=1, start=4096, end=5120, key_begin=1,
                           window=4096)
        _assert_close(got, want, 1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_finding_2_rocm_lse_is_handed_back_compact(monkeypatch):
    """ROCm's efficient kernel returns a compact lse and its backward views it as (B * H, rows):
    a chunk of 9 rows (not a multiple of 32) must not be re-padded to 32. Before the fix the
    backward got width 32 ("logsumexp must be (B, H, 9)")."""
    keep = torch.ones(1, 49, dtype=torch.bool)
    keep[0, :3] = False  # a padding bias: the efficient kernel
    for rows_multiple in (32, 1):  # CUDA, ROCm
        ops = StrictCudaOps(lse_row_multiple=rows_multiple)
        got = _chunk_call(ops.backend(), monkeypatch, dtype=torch.float32, keep=keep)
        assert ops.calls["efficient_bwd"] > 0
        _assert_close(got, _chunk_call(MATH, monkeypatch, dtype=torch.float32, keep=keep), 1e-6)


@pytest.mark.parametrize("capability,dtype,head_dim,switch,want", [
    ((9, 0), torch.bfloat16, 16, None, "flash"),
    ((7, 5), torch.float16, 16, None, "efficient"),  # flash needs sm80+
    ((9, 0), torch.bfloat16, 264, None, "efficient"),  # flash takes head dims up to 256
    ((8, 6), torch.bfloat16, 200, None, "efficient"),  # ... and its backward up to 192 on sm86/sm89
    ((8, 6), torch.bfloat16, 192, None, "flash"),
    ((9, 0), torch.bfloat16, 12, None, "math"),  # half precision: both kernels need a multiple of 8
    ((9, 0), torch.bfloat16, 16, SDPBackend.EFFICIENT_ATTENTION, "efficient"),  # the user's choice
    ((9, 0), torch.bfloat16, 16, SDPBackend.MATH, "math"),
])
def test_finding_3_flash_only_where_eligible_and_as_the_user_chose(monkeypatch, capability, dtype, head_dim, switch,
                                                                   want):
    """Before the fix flash ran for any fp16/bf16 block without a bias: on a T4 (sm75), with a head
    dim over 256, or under sdpa_kernel(EFFICIENT_ATTENTION), the real kernel raised or the user's
    choice was ignored."""
    ops = StrictCudaOps(capability=capability)
    with sdpa_kernel([switch]) if switch is not None else contextlib.nullcontext():
        got = _chunk_call(ops.backend(), monkeypatch, dtype=dtype, D=head_dim)
    kernels = {k.split("_")[0] for k, n in ops.calls.items() if n}
    assert kernels == ({want} if want != "math" else set()), ops.calls
    _assert_close(got, _chunk_call(MATH, monkeypatch, dtype=dtype, D=head_dim), 1e-2)


def test_the_kernels_chosen_in_forward_also_run_the_backward(monkeypatch):
    """``with sdpa_kernel([EFFICIENT_ATTENTION]): loss = model(x)`` then ``loss.backward()`` outside
    the block: leanbp's backward recomputes the attention, and it must do so with the kernels the
    forward was allowed (as SDPA's backward does), not with whatever is enabled when backward runs."""
    model = tiny_model("llama", dtype=torch.bfloat16, **ONE_LAYER)
    leanbp.stream(model, chunk_size=16)  # (its probe on the CPU kernels, before the stand-ins count)
    ops = StrictCudaOps()
    monkeypatch.setattr(_attention, "backend_for", lambda device: ops.backend())
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert ops.calls["efficient_bwd"] > 0 and ops.calls["flash_fwd"] == ops.calls["flash_bwd"] == 0, ops.calls


def test_finding_3_a_block_no_enabled_kernel_takes_is_a_clear_error(monkeypatch):
    keep = torch.ones(1, 49, dtype=torch.bool)
    keep[0, :3] = False  # a bias: flash cannot take it, and only flash is enabled
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.raises(RuntimeError, match="no enabled attention kernel"):
        _chunk_call(StrictCudaOps().backend(), monkeypatch, keep=keep)


def test_finding_6_flash_takes_the_whole_prefix_in_one_call(monkeypatch):
    """Flash has no K/V heads to repeat: a prefix of 9000 keys is one forward call, not two of at
    most 8192 keys (each rounded to bf16 before the merge)."""
    ops = StrictCudaOps()
    _chunk_call(ops.backend(), monkeypatch, Hq=2, Hkv=1, start=9000, end=9016)
    assert ops.calls["flash_fwd"] == 2  # own block + the whole prefix
    assert ops.calls["flash_bwd"] == 1 + 5  # own + the prefix in the sink's 2048-key blocks (Memory)


def test_finding_6_dq_is_summed_in_fp32_over_the_prefix_blocks(monkeypatch):
    """bf16 dq over 40 prefix blocks (the sink's blocks, 8 keys here), against float64 arithmetic on
    the same bf16 inputs: summed in fp32 the error stays that of a few bf16 roundings (measured
    2.7e-3); summed in bf16, before the fix, it was 8.7e-3."""
    monkeypatch.setattr(PrefixGradSink, "block_rows", 8)
    monkeypatch.setattr(_attention, "backend_for", lambda device: MATH)
    g = torch.Generator().manual_seed(2)
    values = [torch.randn(shape, generator=g).bfloat16() for shape in
              ((1, 2, 10, 16), (1, 1, 320, 16), (1, 1, 320, 16), (1, 1, 10, 16), (1, 1, 10, 16))]
    dout = torch.randn(1, 2, 10, 16, generator=g).bfloat16()

    def dq(dtype):
        q, pk, pv, k, v = (t.to(dtype) for t in values)
        q.requires_grad_()
        sink = PrefixGradSink(pk, pv)
        masks = ChunkMasks(320, 330, 0, None, None, CPU)
        out = chunk_attention(q, pk.requires_grad_(), pv.requires_grad_(), k, v, masks, scale=0.25, sink=sink)
        return torch.autograd.grad(out, q, dout.to(dtype))[0]

    exact = dq(torch.float64)
    err = ((dq(torch.bfloat16).double() - exact).norm() / exact.norm()).item()
    assert err <= 4e-3, err


def test_finding_8_the_efficient_backward_gets_out_in_the_layout_it_assumes():
    """The kernel reads out's row stride as H * D: an out in another layout (a contiguous
    (B, H, c, D), as a merge of two blocks of other layouts gives) must be handed over as
    (B, c, H, D) rows. Before the fix it went as it came ("out must have the (B, M, H, K) rows")."""
    ops = StrictCudaOps(float64=True)
    backend = ops.backend()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.zeros(1, 1, 1, 9, dtype=torch.float64)
    out, lse = backend.forward(q, k, v, False, bias, 0.25)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = backend.backward(dout, q, k, v, out.contiguous(), lse, False, bias, 0.25)
    for a, b in zip(got, MATH.backward(dout, q, k, v, out, lse, False, bias, 0.25)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_stand_ins_refuse_what_the_real_kernels_refuse():
    """The strict ops fail where the real kernels fail: else the tests above could not."""
    ops = StrictCudaOps()
    q = torch.randn(1, 4, 8, 16)
    kv = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="as many K/V heads"):  # no GQA in the efficient kernel
        ops.efficient_fwd(q, kv, kv, None, True, 0.0, False, scale=1.0)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        ops.flash_fwd(q, kv, kv, 0.0, False, False, scale=1.0)
    wide = torch.zeros(1, 1, 8, 30)[..., :8].expand(1, 4, 8, 8)  # row stride 30: not a multiple of 4
    with pytest.raises(RuntimeError, match=r"not correctly aligned \(strideM\)"):
        ops.efficient_fwd(q, q, q, wide, True, 0.0, False, scale=1.0)
    with pytest.raises(RuntimeError, match="Ampere"):
        StrictCudaOps(capability=(7, 5)).flash_fwd(q.half(), kv.half(), kv.half(), 0.0, False, False, scale=1.0)
    out, lse, *_ = ops.efficient_fwd(q, q, q, None, True, 0.0, False, scale=1.0)
    assert lse.shape == (1, 4, 32) and torch.isposinf(lse[..., 8:]).all()  # padded to 32, +inf in the pad
    with pytest.raises(RuntimeError, match=r"\(B, M, H, K\) rows"):
        ops.efficient_bwd(torch.randn_like(q), q, q, q, None, out.contiguous(), lse, torch.zeros((), dtype=torch.long),
                          torch.zeros((), dtype=torch.long), 0.0, [True] * 3 + [False], False, scale=1.0)
    assert isinstance(ops.backend(), CudaKernels)


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts what makes a GPU's host wait, by what the CPU step calls: device values read to the
    host (``item``, ``bool``, ``tolist``, ``cpu``, ``numpy``, ``nonzero``, and ops whose output
    size depends on values) and host data put into a device tensor (``torch.tensor(data, device=...)``).
    On CPU none of them waits; on a GPU each is a device-to-host (or blocking host-to-device) sync."""

    SYNCING_OPS = ("_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "unique", "_unique2")

    def __init__(self, monkeypatch):
        super().__init__()
        self.counts = Counter()
        for name in ("tolist", "cpu", "numpy"):
            self._count_method(monkeypatch, torch.Tensor, name)
        plain_tensor = torch.tensor

        def tensor(data, *args, **kwargs):
            if kwargs.get("device") is not None:
                self.counts["torch.tensor(data, device=...)"] += 1
            return plain_tensor(data, *args, **kwargs)

        monkeypatch.setattr(torch, "tensor", tensor)

    def _count_method(self, monkeypatch, cls, name):
        plain = getattr(cls, name)

        def counted(t, *args, **kwargs):
            self.counts[name] += 1
            return plain(t, *args, **kwargs)

        monkeypatch.setattr(cls, name, counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.SYNCING_OPS:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["padding", "documents"])
def test_finding_5_no_device_read_inside_the_chunk_loops(monkeypatch, kind):
    """A streamed step reads the device a fixed number of times, however many chunks its layers
    run: the padding decisions come from a host copy made once per forward, the document masks
    from the device's own document ids. Before the fix each chunk read ``keep.all()`` (padding)
    and sent its documents' first rows to the device (packed rows), so 9 chunks made more reads
    than 3."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(4)
    T = 72
    ids = torch.randint(0, model.config.vocab_size, (2, T), generator=g)
    inputs = {"input_ids": ids}
    if kind == "padding":
        mask = torch.ones(2, T, dtype=torch.long)
        mask[0, :5] = 0
        mask[1, T - 9:] = 0
        inputs["attention_mask"] = mask
    else:
        inputs["position_ids"] = _packed_positions(T, [[30], [20, 50]])
    reads = {}
    for chunks in (3, 9):
        leanbp.stream(model, chunk_size=T // chunks)
        model.zero_grad(set_to_none=True)
        with HostReads(monkeypatch) as counter:
            model(**inputs, labels=ids).loss.backward()
        reads[chunks] = dict(counter.counts)
        monkeypatch.undo()
        leanbp.unstream(model)
    assert reads[3] == reads[9], reads
    assert sum(reads[9].values()) <= 8, reads  # per step: the mask or documents, the labels, the loss
