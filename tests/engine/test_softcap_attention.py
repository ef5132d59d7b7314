"""Soft-capped chunk attention (Gemma2) against a plain full-score reference, float64."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from leanbp.engine import _attention
from leanbp.engine import _softcap_attention as sca
from leanbp.engine import ChunkMasks, Documents, KeyKeep, PrefixGradSink, chunk_attention, key_start
from leanbp.engine._softcap_attention import softcap_chunk_attention

T = 23


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(sca, "BLOCK_ROWS", 5)


def packed_positions(B):
    """Restarting position ids: row 0 holds documents of 9, 8, 6 rows, row 1 of 5 and 18."""
    rows = [[*range(9), *range(8), *range(6)], [*range(5), *range(18)]]
    return torch.tensor(rows[:B])


def make_case(B=2, Hq=2, Hkv=2, D=8, start=9, end=16, window=None, pad=None, packed=False, seed=0):
    """(inputs, masks, spec): the leaves of one chunk, its ChunkMasks as the engine builds them, and
    what the reference needs to build its own mask."""
    g = torch.Generator().manual_seed(seed)
    Q = 3 * torch.randn(B, Hq, T, D, generator=g, dtype=torch.float64)  # large enough to bend the tanh
    K = torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64)
    V = torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64)
    keep = None
    if pad is not None:
        keep = torch.ones(B, T, dtype=torch.bool)
        for b, n in enumerate(pad):
            keep[b, :n] = False
    pos = packed_positions(B) if packed else None
    docs = Documents(pos, B) if packed else None
    kb = key_start(start, window)
    if docs is not None:  # as LayerCall.key_begin
        kb = max(kb, min(docs.start_of(b, start) for b in range(B)))
    masks = ChunkMasks(start, end, kb, window, None if keep is None else KeyKeep(keep), torch.device("cpu"), docs)
    leaf = lambda x: x.clone().requires_grad_()
    prefix = (leaf(K[:, :, kb:start]), leaf(V[:, :, kb:start])) if kb < start else (None, None)
    inputs = (leaf(Q[:, :, start:end]), *prefix, leaf(K[:, :, start:end]), leaf(V[:, :, start:end]))
    spec = dict(start=start, end=end, kb=kb, window=window, keep=keep, pos=pos)
    return inputs, masks, spec


def reference_mask(spec, B):
    """(B, 1, c, kv) bool, built from scratch (transformers' rules)."""
    q = torch.arange(spec["start"], spec["end"])[:, None]
    k = torch.arange(spec["kb"], spec["end"])[None, :]
    allowed = (k <= q).expand(B, -1, -1)
    if spec["window"] is not None:
        allowed = allowed & (k > q - spec["window"])
    if spec["keep"] is not None:
        allowed = allowed & spec["keep"][:, None, spec["kb"]:spec["end"]]
    if spec["pos"] is not None:
        pos = spec["pos"]
        new = torch.ones_like(pos, dtype=torch.bool)
        new[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        doc = new.cumsum(-1)
        allowed = allowed & (doc[:, spec["start"]:spec["end"], None] == doc[:, None, spec["kb"]:spec["end"]])
    return allowed[:, None]


def reference(query, prefix_key, prefix_value, key, value, spec, scale, softcap):
    if prefix_key is not None:
        key, value = torch.cat([prefix_key, key], 2), torch.cat([prefix_value, value], 2)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    s = scale * query @ key.transpose(-1, -2)  # (B, H, c, kv)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    allowed = reference_mask(spec, query.shape[0])
    seen = allowed.any(-1, keepdim=True)
    s = torch.where(seen, s.masked_fill(~allowed, float("-inf")), 0.0)  # rows that see nothing: no NaN
    return (torch.softmax(s, -1) * allowed) @ value


def out_and_grads(fn, inputs, seed=1):
    out = fn(*inputs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    leaves = [x for x in inputs if x is not None]
    return out, torch.autograd.grad((out * w).sum(), leaves)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


CASES = {
    "no_prefix": dict(start=0, end=7),
    "prefix": dict(),
    "padding": dict(pad=(12, 3)),  # batch 0, rows 9-11: every visible key is padded
    "window": dict(start=14, end=21, window=6),
    "window_padding": dict(start=14, end=21, window=8, pad=(16, 2)),
    "packed": dict(start=10, end=17, packed=True),
    "packed_window": dict(start=10, end=17, packed=True, window=4),
    "gqa": dict(Hq=4, Hkv=2, window=7, pad=(4, 0)),
    "gqa_packed": dict(Hq=4, Hkv=2, start=16, end=23, packed=True),
}


@pytest.mark.parametrize("softcap", [2.0, 50.0])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, softcap):
    inputs, masks, spec = make_case(**CASES[name])
    scale = inputs[0].shape[-1] ** -0.5
    out, grads = out_and_grads(lambda *x: softcap_chunk_attention(*x, masks, scale, softcap), inputs)
    ref, ref_grads = out_and_grads(lambda *x: reference(*x, spec, scale, softcap), inputs)
    assert out.shape == inputs[0].shape and out.dtype == torch.float64
    assert rel(out, ref) < 1e-12
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all() and rel(g, r) < 1e-12


def test_rows_that_see_nothing_output_zero():
    inputs, masks, spec = make_case(**CASES["padding"])
    out, (dq, dpk, dpv, dk, dv) = out_and_grads(lambda *x: softcap_chunk_attention(*x, masks, 0.3, 2.0), inputs)
    blind = ~reference_mask(spec, 2).any(-1)[:, 0]  # (B, c)
    assert blind.sum() == 3 and bool(blind[0, :3].all())
    assert (out[0, :, :3] == 0).all() and (dq[0, :, :3] == 0).all()
    assert (dpk[0, :, :] == 0).all() and (dpv[0, :, :] == 0).all()  # batch 0's prefix is all padding
    assert all(torch.isfinite(g).all() for g in (out, dq, dpk, dpv, dk, dv))


@pytest.mark.parametrize("block", [1, 3, 1024])
def test_block_size_does_not_matter(monkeypatch, block):
    inputs, masks, spec = make_case(**CASES["gqa"])
    monkeypatch.setattr(sca, "BLOCK_ROWS", block)
    out, grads = out_and_grads(lambda *x: softcap_chunk_attention(*x, masks, 0.35, 2.0), inputs)
    ref, ref_grads = out_and_grads(lambda *x: reference(*x, spec, 0.35, 2.0), inputs)
    assert rel(out, ref) < 1e-12 and all(rel(g, r) < 1e-12 for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("name", ["window", "gqa", "packed"])
def test_prefix_grads_go_to_sink(name):
    inputs, masks, spec = make_case(**CASES[name])
    q, pk, pv, k, v = inputs
    kb, s = spec["kb"], spec["start"]
    # the engine's buffers: K/V of every row that is some chunk's prefix
    buffer = torch.zeros(*pk.shape[:2], T, pk.shape[3], dtype=pk.dtype)
    sink = PrefixGradSink(buffer, buffer)
    ref, ref_grads = out_and_grads(lambda *x: reference(*x, spec, 0.35, 2.0), inputs)
    out, grads = out_and_grads(lambda *x: softcap_chunk_attention(*x[:1], pk, pv, *x[1:], masks, 0.35, 2.0, sink),
                               (q, k, v))
    assert rel(out, ref) < 1e-12
    for g, r in zip(grads, (ref_grads[0], *ref_grads[3:])):
        assert rel(g, r) < 1e-12
    assert pk.grad is None and pv.grad is None
    assert rel(sink.dkey[:, :, kb:s], ref_grads[1]) < 1e-12 and rel(sink.dvalue[:, :, kb:s], ref_grads[2]) < 1e-12
    rest = torch.ones(T, dtype=torch.bool)
    rest[kb:s] = False
    assert (sink.dkey[:, :, rest] == 0).all() and (sink.dvalue[:, :, rest] == 0).all()


def test_huge_softcap_is_plain_attention():
    """softcap 1e6: s = raw - raw^3 / (3e12) + ..., so SDPA agrees to ~1e-11, not to the last bit."""
    inputs, masks, spec = make_case(**CASES["gqa"])
    mask = reference_mask(spec, 2)

    def sdpa(q, pk, pv, k, v):
        k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.35, enable_gqa=True)

    out, grads = out_and_grads(lambda *x: softcap_chunk_attention(*x, masks, 0.35, 1e6), inputs)
    ref, ref_grads = out_and_grads(sdpa, inputs)
    assert rel(out, ref) < 1e-9 and all(rel(g, r) < 1e-9 for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("mode", ["blocks", "mask"])
def test_chunk_attention_dispatches_softcap(mode):
    inputs, masks, spec = make_case(**CASES["packed"])
    masks = dataclasses.replace(masks, attention=mode)  # the single-SDPA fallback cannot cap either
    out, grads = out_and_grads(lambda *x: chunk_attention(*x, masks, 0.35, softcap=2.0), inputs)
    direct, direct_grads = out_and_grads(lambda *x: softcap_chunk_attention(*x, masks, 0.35, 2.0), inputs)
    assert torch.equal(out, direct) and all(torch.equal(g, d) for g, d in zip(grads, direct_grads))
    ref = reference(*inputs, spec, 0.35, 2.0)
    assert rel(out, ref) < 1e-12
    with torch.no_grad():  # the engine's forward pass
        assert torch.equal(chunk_attention(*inputs, masks, 0.35, softcap=2.0), out)


@pytest.mark.parametrize("name", ["prefix", "window_padding", "packed", "gqa"])
def test_no_softcap_keeps_the_old_path(monkeypatch, name):
    inputs, masks, spec = make_case(**CASES[name])
    out, grads = out_and_grads(lambda *x: chunk_attention(*x, masks, 0.35), inputs)

    def refuse(*args, **kwargs):
        raise AssertionError("softcap path taken without a softcap")

    monkeypatch.setattr(_attention, "softcap_chunk_attention", refuse)
    again, again_grads = out_and_grads(lambda *x: chunk_attention(*x, masks, 0.35, softcap=None), inputs)
    assert torch.equal(out, again) and all(torch.equal(g, a) for g, a in zip(grads, again_grads))
    if _attention._document_pieces(masks) is None:  # one two-block call, bit for bit
        assert torch.equal(out, _attention._two_block(*inputs, masks, 0.35, None))
    ref, ref_grads = out_and_grads(lambda *x: reference(*x, spec, 0.35, None), inputs)
    assert rel(out, ref) < 1e-12 and all(rel(g, r) < 1e-12 for g, r in zip(grads, ref_grads))


def test_autocast_runs_in_the_autocast_dtype():
    inputs, masks, spec = make_case(**CASES["gqa"])
    inputs = [x.detach().float().requires_grad_() for x in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads = out_and_grads(lambda *x: softcap_chunk_attention(*x, masks, 0.35, 2.0), inputs)
    ref, ref_grads = out_and_grads(lambda *x: reference(*x, spec, 0.35, 2.0), inputs)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads)
    assert rel(out.float(), ref) < 2e-2 and all(rel(g, r) < 5e-2 for g, r in zip(grads, ref_grads))


def test_large_logits_do_not_overflow():
    """Scores spread over thousands: exp(s) overflows unless every block is shifted by the running max."""
    inputs, masks, spec = make_case(**CASES["gqa"])
    inputs = [(100 * x).detach().requires_grad_() for x in inputs]
    out, grads = out_and_grads(lambda *x: softcap_chunk_attention(*x, masks, 0.35, 3000.0), inputs)
    ref, ref_grads = out_and_grads(lambda *x: reference(*x, spec, 0.35, 3000.0), inputs)
    assert rel(out, ref) < 1e-12 and all(rel(g, r) < 1e-12 for g, r in zip(grads, ref_grads))


def test_very_negative_scores_after_blind_blocks():
    """Every score near -1100, and some rows see no key of the first blocks (padding): the running
    max must stay -inf until a row sees a key, not 0, or exp(s - 0) underflows to a blind row."""
    inputs, masks, spec = make_case(**CASES["padding"])
    q, pk, pv, k, v = (x.detach() for x in inputs)
    # q near +20, k near -20 in every dimension: scale * q.k = -1120 +- a few for every pair
    inputs = [x.requires_grad_() for x in (20 + q / 10, -20 + pk / 3, pv, -20 + k / 3, v)]
    out, grads = out_and_grads(lambda *x: softcap_chunk_attention(*x, masks, 0.35, 3000.0), inputs)
    ref, ref_grads = out_and_grads(lambda *x: reference(*x, spec, 0.35, 3000.0), inputs)
    assert rel(out, ref) < 1e-12 and all(rel(g, r) < 1e-12 for g, r in zip(grads, ref_grads))
