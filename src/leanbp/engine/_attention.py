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
log-sum-exp, which gives each block's exact share of the gradient. On other devices (or with
``LEANBP_ATTENTION=mask``) a single SDPA call with a boolean (B, 1, c, kv) mask is used instead.

Packed rows (several documents in one row, each attending only to itself, as transformers does
when ``position_ids`` restart and there is no attention mask) need no mask either: a chunk splits
at its document boundaries into segments, and each segment is the case above. Only the first
segment continues a document from before the chunk, so only it has a prefix, and that prefix
starts at its document's first row (rows of a batch whose document starts later mask the keys
before it, like padding).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ._attention_backends import FUSED_DEVICES, backend_for
from ._values import has_values


def key_start(start: int, window: int | None) -> int:
    """First key visible to query row ``start`` (transformers: key kv visible iff kv > q - window)."""
    if window is None:
        return 0
    return max(0, start - window + 1)


class Documents:
    """Where the documents of packed rows start: transformers' rule, a new document wherever
    ``position_ids`` does not increase by exactly 1 (``find_packed_sequence_indices``).

    The starts are read to the host once per forward (every chunk of every layer needs them as
    Python ints to pick its key range and segments)."""

    def __init__(self, position_ids: torch.Tensor, batch: int):
        position_ids = position_ids.expand(batch, -1)  # (B, T)
        new_doc = torch.ones_like(position_ids, dtype=torch.bool)
        new_doc[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
        self.doc_id = new_doc.cumsum(-1)  # (B, T): equal ids = same document
        self.starts: list[list[int]] = [torch.nonzero(row).flatten().tolist() for row in new_doc.cpu()]

    @staticmethod
    def from_position_ids(position_ids: torch.Tensor | None, batch: int) -> "Documents | None":
        """None unless some row holds more than one document (fake ids, in a planned step: one per row)."""
        if position_ids is None or position_ids.shape[-1] < 2 or not has_values(position_ids):
            return None
        docs = Documents(position_ids, batch)
        return docs if any(len(s) > 1 for s in docs.starts) else None

    def start_of(self, b: int, row: int) -> int:
        """First row of the document that holds ``row`` in batch row ``b``."""
        starts = self.starts[b]
        return starts[bisect.bisect_right(starts, row) - 1]

    def splits(self, b: int, start: int, end: int) -> list[int]:
        """Document starts strictly inside (start, end) in batch row ``b``."""
        starts = self.starts[b]
        return starts[bisect.bisect_right(starts, start): bisect.bisect_left(starts, end)]


class KeyKeep:
    """The keys a padded batch lets its rows attend to: the (B, T) bool mask on the device, and on
    the host, read once per forward, each row's count of hidden keys before every position. Every
    chunk of every layer asks whether its key range hides anything; the host counts answer without
    reading the device (a device-to-host sync per chunk on a GPU)."""

    def __init__(self, mask: torch.Tensor, hidden_before: np.ndarray | None = None):
        self.mask = mask  # (B, T) bool, True = may be attended to
        if hidden_before is None:  # (B, T + 1) int32 host array: the one read
            hidden_before = F.pad((~mask).to(torch.int32).cumsum(-1), (1, 0)).cpu().numpy()
        self._hidden_before = hidden_before

    @staticmethod
    def from_attention_mask(attention_mask: torch.Tensor | None, device: torch.device) -> "KeyKeep | None":
        """None when the mask hides no key (or is fake, in a planned step: nothing padded)."""
        if attention_mask is None or not has_values(attention_mask):
            return None
        keep = KeyKeep(attention_mask.to(device=device, dtype=torch.bool))
        return keep if keep.hides_any(0, attention_mask.shape[-1]) else None

    def hides_any(self, k0: int, k1: int) -> bool:
        """Whether any row hides a key in [k0, k1) (host arithmetic only)."""
        return bool((self._hidden_before[:, k1] != self._hidden_before[:, k0]).any())

    def rows(self, rows: slice) -> "KeyKeep":
        return KeyKeep(self.mask[rows], self._hidden_before[rows])


@dataclass
class ChunkMasks:
    """Masks of one chunk [start, end) with visible keys [key_begin, end); True = may attend."""

    start: int
    end: int
    key_begin: int
    window: int | None
    key_keep: KeyKeep | None  # None when nothing is padded
    device: torch.device
    documents: Documents | None = None

    def segment(self, start: int, end: int, key_begin: int, rows: slice = slice(None)) -> "ChunkMasks":
        """The masks of rows [start, end) of this chunk (in batch rows ``rows``), a piece that lies in
        one document per batch row."""
        keep = self.key_keep.rows(rows) if self.key_keep is not None else None
        docs = None
        if self.documents is not None and key_begin < start:
            docs = _RowSubset(self.documents, rows)
        return ChunkMasks(start, end, key_begin, self.window, keep, self.device, docs)

    def _document_keep(self, k0: int, k1: int) -> torch.Tensor | None:
        """(B, 1, 1, k1-k0) bool: prefix keys in the document of each row's first query (None: all)."""
        if self.documents is None or k0 >= k1:
            return None
        firsts = [self.documents.start_of(b, self.start) for b in range(len(self.documents.starts))]
        if max(firsts) <= k0:
            return None
        # the prefix keys [k0, k1) end at the chunk's first row, so a key is in that row's document
        # iff it has its document id (device arithmetic: no host list sent per chunk)
        ids = self.documents.doc_id
        return (ids[:, k0:k1] == ids[:, self.start:self.start + 1])[:, None, None]  # (B, 1, 1, kv)

    def _allowed(self, k0: int, k1: int, per_row: bool) -> torch.Tensor | None:
        """(B|1, 1, c|1, k1-k0) bool, or None when every key is visible to every row."""
        device = self.device
        allowed = None
        q = torch.arange(self.start, self.end, device=device)[:, None]  # (c, 1)
        k = torch.arange(k0, k1, device=device)[None, :]  # (1, kv)
        if per_row:
            allowed = k <= q
        if self.window is not None and (self.end - 1 - self.window) >= k0:
            window_ok = k > q - self.window
            allowed = window_ok if allowed is None else allowed & window_ok
        if allowed is not None:
            allowed = allowed[None, None]  # (1, 1, c, kv)
        if self.key_keep is not None and self.key_keep.hides_any(k0, k1):
            keep = self.key_keep.mask[:, None, None, k0:k1]  # (B, 1, 1, kv)
            allowed = keep if allowed is None else allowed & keep
        return allowed

    def prefix(self):
        allowed = self._allowed(self.key_begin, self.start, per_row=False)
        doc_keep = self._document_keep(self.key_begin, self.start)
        if doc_keep is not None:
            allowed = doc_keep if allowed is None else allowed & doc_keep
        return allowed

    def own(self):
        """None means plain causal (is_causal=True is exact for the square own block)."""
        own = self._allowed(self.start, self.end, per_row=False)
        if own is None:
            return None
        causal = torch.ones(self.end - self.start, self.end - self.start, dtype=torch.bool,
                            device=own.device).tril()
        return own & causal

    def block(self, k0: int, k1: int) -> torch.Tensor:
        """(B|1, 1, c, k1-k0) bool: may the chunk's query rows attend key rows [k0, k1) (causal,
        window, padding, documents)."""
        allowed = self._allowed(k0, k1, per_row=True)
        if self.documents is not None:
            ids = self.documents.doc_id
            allowed = allowed & (ids[:, None, self.start:self.end, None] == ids[:, None, None, k0:k1])  # (B, 1, c, kv)
        return allowed

    def full(self):
        """(B|1, 1, c, e - key_begin) bool for the single-call fallback."""
        return self.block(self.key_begin, self.end)


class _RowSubset:
    """The documents of some batch rows (a segment's view of ``Documents``)."""

    def __init__(self, documents: Documents, rows: slice):
        self.starts = documents.starts[rows]
        self.doc_id = documents.doc_id[rows]

    start_of = Documents.start_of


class PrefixGradSink:
    """Running dL/dK and dL/dV of the prefix rows of a layer, (B, Hkv, P, D) each, zero until the
    first gradient arrives. The two-block attention adds its prefix gradients straight into it, one
    key block at a time, instead of returning a fresh (B, Hkv, p, D) pair per chunk."""

    block_rows = 2048  # Memory: the largest prefix-gradient temporary is this many rows

    def __init__(self, key: torch.Tensor, value: torch.Tensor):
        self._like = (key, value)
        self.dkey: torch.Tensor | None = None
        self.dvalue: torch.Tensor | None = None

    def add(self, start: int, end: int, dkey: torch.Tensor, dvalue: torch.Tensor, rows: slice = slice(None)) -> None:
        if self.dkey is None:
            self.dkey, self.dvalue = torch.zeros_like(self._like[0]), torch.zeros_like(self._like[1])
        self.dkey[rows, :, start:end] += dkey
        self.dvalue[rows, :, start:end] += dvalue


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


def uses_two_block_attention(device: torch.device) -> bool:
    """Chunk attention on ``device`` runs key blocks through fused kernels with their log-sum-exp
    (CPU and CUDA; else, or with ``LEANBP_ATTENTION=mask``, one SDPA call with a mask)."""
    return device.type in FUSED_DEVICES and os.environ.get("LEANBP_ATTENTION", "blocks") != "mask"


def chunk_attention(query, prefix_key, prefix_value, key, value, masks: ChunkMasks, scale: float,
                    sink: PrefixGradSink | None = None, softcap: float | None = None):
    """query (B, Hq, c, D); prefix_key/value (B, Hkv, p, D) or None; key/value (B, Hkv, c, D), the
    chunk's own rows -> (B, Hq, c, D). GQA needs no repeated K/V.

    With a ``sink``, the prefix's K/V gradients are added into it (rows key_begin..start) rather
    than returned through autograd (the single-SDPA path, off CPU, still returns them).
    A ``softcap`` (Gemma2's attention-logit soft-capping) goes to the block-by-block kernel on
    every device: SDPA cannot cap its logits."""
    if softcap is not None:
        from ._softcap_attention import softcap_chunk_attention  # imports this module

        return softcap_chunk_attention(query, prefix_key, prefix_value, key, value, masks, scale, softcap, sink)
    if not uses_two_block_attention(query.device):
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
        query, prefix_key, prefix_value, key, value, prefix_allowed, masks.own(), scale, backend_for(query.device),
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
