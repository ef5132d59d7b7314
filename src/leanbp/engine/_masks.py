"""Which keys each query row of a chunk may see: causal order, a sliding window, padding, and the
documents of packed rows; and where the prefix's K/V gradients go.

A chunk of rows [start, end) attends to keys [key_begin, end). ``ChunkMasks`` answers, for any
block of those keys, which (row, key) pairs are visible, as boolean tensors of at most
(B, 1, chunk, keys) for the keys of one block: never a T x T mask. The values it needs (padded keys,
document starts) are read to the host once per forward (``KeyKeep``, ``Documents``), so no chunk
reads the device.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ._value_reads import has_values

# How a chunk's attention applies its masks: "blocks" runs the prefix and the chunk's own rows as
# key blocks through fused kernels merged by their log-sum-exps (CPU and CUDA); "mask" runs one
# SDPA call with the chunk's boolean (B, 1, c, keys) mask (what other devices always do)
ATTENTION_MODES = ("blocks", "mask")


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
    """Masks of one chunk [start, end) with visible keys [key_begin, end); True = may attend.
    ``attention`` says how the chunk attention applies them (one of ``ATTENTION_MODES``)."""

    start: int
    end: int
    key_begin: int
    window: int | None
    key_keep: KeyKeep | None  # None when nothing is padded
    device: torch.device
    documents: Documents | None = None
    attention: str = "blocks"
    # sequence parallelism: the chunk's attention runs through the layer's head exchange
    # (``_ulysses.Exchange``), its rows local, every mask by global position
    exchange: object = None

    def segment(self, start: int, end: int, key_begin: int, rows: slice = slice(None)) -> "ChunkMasks":
        """The masks of rows [start, end) of this chunk (in batch rows ``rows``), a piece that lies in
        one document per batch row."""
        keep = self.key_keep.rows(rows) if self.key_keep is not None else None
        docs = None
        if self.documents is not None and key_begin < start:
            docs = _RowSubset(self.documents, rows)
        return ChunkMasks(start, end, key_begin, self.window, keep, self.device, docs, self.attention)

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
