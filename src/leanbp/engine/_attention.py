"""Attention for one chunk of query rows against the keys it may see, without a chunk x T mask.

Rows [s, e) of a causal layer attend to keys [kb, e): kb is 0 for full attention and
max(0, s - window + 1) for a sliding window. The keys split into two blocks:

* the prefix [kb, s), visible to every row of the chunk (except padded keys, and keys a sliding
  window drops), so it needs no causal mask at all, and padding is a (B, 1, 1, p) bias;
* the chunk's own rows [s, e), a square block where bottom-right and top-left causal alignment
  coincide, so ``is_causal=True`` is right (PyTorch's is_causal is top-left aligned, which would be
  wrong for a q_len < kv_len call).

Each block runs a fused kernel that also returns its log-sum-exp (``_attention_backends.py``: the
CPU flash kernel, or CUDA's flash / memory-efficient kernels); the results are merged with their
log-sum-exps. Backward runs the kernel's backward once per block with the *merged* output and
log-sum-exp, which gives each block's exact share of the gradient. On other devices (or with the
attention mode "mask", ``StreamConfig.attention``) a single SDPA call with a boolean (B, 1, c, kv)
mask is used instead. Which keys each row sees is ``_masks.py``'s business.

Packed rows (several documents in one row, each attending only to itself, as transformers does
when ``position_ids`` restart and there is no attention mask) need no mask either: a chunk splits
at its document boundaries into segments, and each segment is the case above. Only the first
segment continues a document from before the chunk, so only it has a prefix, and that prefix
starts at its document's first row (rows of a batch whose document starts later mask the keys
before it, like padding).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ._attention_backends import FUSED_DEVICES, backend_for
from ._masks import ChunkMasks, PrefixGradSink
from ._softcap_attention import softcap_chunk_attention


def _bias(allowed: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """Boolean mask -> additive bias (0 / -inf) in the attention dtype."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _visible(allowed: torch.Tensor | None) -> torch.Tensor | None:
    """(B|1, 1, c|1) bool: does the row see any key of the block (None: every row does)."""
    if allowed is None:
        return None
    return allowed.any(-1)


def _key_blocks(keys: int, block_rows: int | None) -> list[tuple[int, int]]:
    step = block_rows or max(keys, 1)
    return [(b0, min(b0 + step, keys)) for b0 in range(0, keys, step)]


class _TwoBlockAttention(torch.autograd.Function):
    """The chunk's own rows and its prefix as separate key blocks of one attention, merged by their
    log-sum-exps (the prefix in pieces of ``backend.key_block_rows`` keys where the backend bounds them)."""

    @staticmethod
    def forward(ctx, query, prefix_key, prefix_value, key, value, prefix_allowed, own_allowed, scale, backend,
                sink=None, sink_start=0, sink_rows=slice(None)):
        dtype = query.dtype
        own_bias = _bias(own_allowed, dtype)
        own_out, own_lse = backend.forward(query, key, value, own_bias is None, own_bias, scale)
        blocks = [(own_out, own_lse, _visible(own_allowed))]
        pre_bias = None
        if prefix_key is not None:
            pre_bias = _bias(prefix_allowed, dtype)
            per_call = backend.key_block_rows(query, prefix_key.shape[1], pre_bias is not None)
            for b0, b1 in _key_blocks(prefix_key.shape[2], per_call):
                blocks.append((*backend.forward(query, prefix_key[:, :, b0:b1], prefix_value[:, :, b0:b1], False,
                                                None if pre_bias is None else pre_bias[..., b0:b1], scale),
                               _visible(None if prefix_allowed is None else prefix_allowed[..., b0:b1])))
        if len(blocks) == 1:  # (rows that see nothing: lse 0, as the merge below gives them)
            out, lse = own_out, own_lse.masked_fill(torch.isinf(own_lse), 0.0)
        else:
            # a block that a row cannot see contributes nothing (a kernel may report any lse there)
            lses = [l if vis is None else l.masked_fill(~vis, float("-inf")) for _, l, vis in blocks]
            lse = torch.logsumexp(torch.stack(lses), dim=0)  # (B, H, c)
            lse = lse.masked_fill(torch.isinf(lse), 0.0)  # rows that see nothing: output 0, as SDPA
            acc = torch.promote_types(dtype, torch.float32)
            out = sum(o.to(acc) * torch.exp(l - lse).unsqueeze(-1) for (o, _, _), l in zip(blocks, lses))
            out = out.to(dtype)
        ctx.scale, ctx.backend = scale, backend
        ctx.sink, ctx.sink_start, ctx.sink_rows = sink, sink_start, sink_rows
        ctx.own_causal = own_bias is None
        ctx.save_for_backward(query, out, lse, key, value, own_bias, prefix_key, prefix_value, pre_bias)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, out, lse, key, value, own_bias, pk, pv, pbias = ctx.saved_tensors
        backend, scale = ctx.backend, ctx.scale
        grad_out = grad_out.contiguous()
        dq, dk, dv = backend.backward(grad_out, query, key, value, out, lse, ctx.own_causal, own_bias, scale)
        dpk = dpv = None
        if pk is not None:
            # any split of the keys is exact given the merged output and log-sum-exp; with a sink
            # the prefix gradients go straight into it, one key block at a time
            step = PrefixGradSink.block_rows if ctx.sink is not None else None
            step = min(filter(None, (step, backend.key_block_rows(query, pk.shape[1], pbias is not None))), default=None)
            # the blocks' dq summed in at least fp32 (a bf16 sum over T / 2048 blocks would round each)
            dq = dq.to(torch.promote_types(dq.dtype, torch.float32))
            pieces = []
            for b0, b1 in _key_blocks(pk.shape[2], step):
                dq_b, dk_b, dv_b = backend.backward(grad_out, query, pk[:, :, b0:b1], pv[:, :, b0:b1], out, lse,
                                                    False, None if pbias is None else pbias[..., b0:b1], scale)
                dq += dq_b
                if ctx.sink is not None:
                    ctx.sink.add(ctx.sink_start + b0, ctx.sink_start + b1, dk_b, dv_b, ctx.sink_rows)
                else:
                    pieces.append((dk_b, dv_b))
                del dk_b, dv_b
            if pieces:
                dpk = torch.cat([k for k, _ in pieces], dim=2) if len(pieces) > 1 else pieces[0][0]
                dpv = torch.cat([v for _, v in pieces], dim=2) if len(pieces) > 1 else pieces[0][1]
            dq = dq.to(query.dtype)
        return dq, dpk, dpv, dk, dv, None, None, None, None, None, None, None


_forced = []  # the backend ``forced_backend`` put in place of each device's own, innermost last


@contextlib.contextmanager
def forced_backend(backend):
    """Run every two-block chunk attention inside on ``backend`` instead of the device's own (e.g.
    ``MATH``, the plain-PyTorch reference, for an exactness check on a GPU)."""
    _forced.append(backend)
    try:
        yield
    finally:
        _forced.pop()


def _backend(device: torch.device):
    return _forced[-1] if _forced else backend_for(device)


def uses_two_block_attention(device: torch.device, attention: str = "blocks") -> bool:
    """Chunk attention on ``device`` runs key blocks through fused kernels with their log-sum-exp
    (CPU and CUDA, attention mode "blocks"; else one SDPA call with a mask)."""
    return device.type in FUSED_DEVICES and attention != "mask"


def chunk_attention(query, prefix_key, prefix_value, key, value, masks: ChunkMasks, scale: float,
                    sink: PrefixGradSink | None = None, softcap: float | None = None):
    """query (B, Hq, c, D); prefix_key/value (B, Hkv, p, D) or None; key/value (B, Hkv, c, D), the
    chunk's own rows -> (B, Hq, c, D). GQA needs no repeated K/V.

    With a ``sink``, the prefix's K/V gradients are added into it (rows key_begin..start) rather
    than returned through autograd (the single-SDPA path, off CPU, still returns them).
    A ``softcap`` (Gemma2's attention-logit soft-capping) goes to the block-by-block kernel on
    every device: SDPA cannot cap its logits."""
    if masks.exchange is not None:  # sequence parallel: every rank's chunk, this rank's heads
        return masks.exchange.attention(query, masks.start, masks.end, scale, softcap)
    if softcap is not None:
        return softcap_chunk_attention(query, prefix_key, prefix_value, key, value, masks, scale, softcap, sink)
    if not uses_two_block_attention(query.device, masks.attention):
        return _single_call(query, prefix_key, prefix_value, key, value, masks, scale)
    if torch.is_autocast_enabled(query.device.type) and query.dtype != torch.float64:
        # what SDPA does under autocast: attention runs in the autocast dtype (float64 is never cast)
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        if prefix_key is not None:
            prefix_key, prefix_value = prefix_key.to(dtype), prefix_value.to(dtype)
    pieces = _document_pieces(masks)
    if pieces is None:
        return _two_block(query, prefix_key, prefix_value, key, value, masks, scale, sink)
    s = masks.start
    per_rows = []
    for rows, bounds in pieces:
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            own = slice(a - s, b - s)
            prefix = (None, None)
            key_begin = a  # a segment that starts a document sees no earlier rows
            if a == s and prefix_key is not None:
                key_begin = masks.key_begin
                if rows != slice(None):  # one batch row: its prefix starts at its own document
                    key_begin = max(key_begin, masks.documents.start_of(rows.start, s))
                skip = key_begin - masks.key_begin
                if key_begin < s:
                    prefix = (prefix_key[rows, :, skip:], prefix_value[rows, :, skip:])
                else:
                    key_begin = s
            outs.append(_two_block(query[rows, :, own], *prefix, key[rows, :, own], value[rows, :, own],
                                   masks.segment(a, b, key_begin, rows), scale, sink, rows))
        per_rows.append(torch.cat(outs, dim=2) if len(outs) > 1 else outs[0])
    return torch.cat(per_rows, dim=0) if len(per_rows) > 1 else per_rows[0]


def _document_pieces(masks: ChunkMasks):
    """None when no document starts inside the chunk; else [(batch rows, segment bounds)]: all rows
    at once when they split alike, one row at a time otherwise."""
    docs = masks.documents
    if docs is None:
        return None
    splits = [docs.splits(b, masks.start, masks.end) for b in range(len(docs.starts))]
    if not any(splits):
        return None
    bounds = [[masks.start, *sp, masks.end] for sp in splits]
    if all(b == bounds[0] for b in bounds):
        return [(slice(None), bounds[0])]
    return [(slice(b, b + 1), bd) for b, bd in enumerate(bounds)]


def _two_block(query, prefix_key, prefix_value, key, value, masks: ChunkMasks, scale, sink, rows=slice(None)):
    prefix_allowed = masks.prefix() if prefix_key is not None else None
    use_sink = sink is not None and prefix_key is not None and prefix_key.requires_grad
    if use_sink:
        prefix_key, prefix_value = prefix_key.detach(), prefix_value.detach()
    # strided views go in as they are: the CPU flash kernel takes them without a copy
    return _TwoBlockAttention.apply(
        query, prefix_key, prefix_value, key, value, prefix_allowed, masks.own(), scale, _backend(query.device),
        sink if use_sink else None, masks.key_begin, rows,
    )


def _single_call(query, prefix_key, prefix_value, key, value, masks: ChunkMasks, scale):
    if prefix_key is not None:
        key = torch.cat([prefix_key, key], dim=2)
        value = torch.cat([prefix_value, value], dim=2)
    mask = masks.full()
    if mask is None:  # no padding, no window: plain causal over a square block
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril(
            key.shape[2] - query.shape[2])
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                          enable_gqa=query.shape[1] != key.shape[1])
