"""Attention for one chunk of query rows against the keys it may see.

Rows [s, e) of a causal layer attend to keys [ks, e), where ks is 0 for full attention and
max(0, s - window + 1) for a sliding window. The alignment is bottom-right: the query at absolute
position p sees keys at absolute positions <= p (PyTorch's ``is_causal=True`` is top-left aligned
and would be wrong for every chunk but the first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def key_start(start: int, window: int | None) -> int:
    """First key position visible to query row ``start`` (HF: key kv visible iff kv > q - window)."""
    if window is None:
        return 0
    return max(0, start - window + 1)


def chunk_mask(
    start: int,
    end: int,
    key_begin: int,
    window: int | None,
    key_keep: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """Boolean mask (B or 1, 1, end-start, end-key_begin), True where a query may attend a key.

    Only this chunk's rows are built: the mask is chunk x visible-keys, never T x T.
    """
    q_pos = torch.arange(start, end, device=device)[:, None]  # (c, 1)
    k_pos = torch.arange(key_begin, end, device=device)[None, :]  # (1, kv)
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    allowed = allowed[None, None]  # (1, 1, c, kv)
    if key_keep is not None:
        # padding: a padded key is invisible to every query; a fully masked (padded) query row
        # gets an all-zero output, the same as the unmodified model's SDPA call gives it.
        allowed = allowed & key_keep[:, None, None, key_begin:end]  # (B, 1, c, kv)
    return allowed


def chunk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query (B, Hq, c, D), key/value (B, Hkv, kv, D) -> (B, Hq, c, D).

    GQA is handled by SDPA (``enable_gqa``) so K/V are never repeated per query head in memory.
    """
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )
