"""``chunk_size="auto"``: the largest chunk whose working set fits a memory budget.

In a streamed step, what grows with the chunk size is the graph of the chunk a layer's backward
recomputes (its normed rows, q/k/v before and after RoPE, the attention output, the MLP's
intermediates, the residual sums) and the gradients flowing through it, one chunk at a time (plus,
with padding or a window, a (c x c) mask of the chunk's own block). Larger chunks mean fewer and
larger matmuls and fewer calls, so "auto" takes the largest chunk whose working set fits the budget:

    rows = budget // (B x bytes per row),  rounded down to a multiple of 64 rows, at most T

The budget is ``chunk_memory`` when given; by default it is the size of one layer input
(B x T x H), a fraction of the activations leanbp keeps anyway, but never less than the working
set of the fixed default chunk (``DEFAULT_ROWS``, 1024 rows, also ``StreamConfig``'s default): so
without ``chunk_memory`` "auto" picks at least min(1024, T) rows, and more only for sequences long
enough that one layer input holds more, and the activation memory stays linear in T.

The bytes per row are the family adapter's upper bound (``DecoderFamily.row_working_set``),
counted at least at 4 bytes per element (norms, softmax and accumulations upcast to fp32). Off the
CPU two-block attention path, chunk attention is a single SDPA call with a (c x kv) mask, which may
build the (B, Hq, c, kv) scores: they are counted too (``row_bytes``).
``tests/engine/test_chunking.py`` checks the bound against measured working sets.
"""

from __future__ import annotations

import torch

from ._adapter import DecoderFamily
from ._attention import uses_two_block_attention

AUTO = "auto"
ROW_ALIGN = 64  # rows: matmul-friendly multiples
DEFAULT_ROWS = 1024  # the fixed default chunk size, and the least "auto" picks unless given a budget


def row_bytes(adapter: DecoderFamily, hidden: torch.Tensor, attention: str = "blocks") -> int:
    """Upper bound of the bytes one row of one batch element of a chunk keeps alive in backward."""
    B, T, H = hidden.shape
    elements = adapter.row_working_set()
    if not uses_two_block_attention(hidden.device, attention):  # scores and probabilities against every key
        elements += 2 * adapter.config.num_attention_heads * T
    return elements * max(4, hidden.element_size())


def pick_chunk_rows(chunk_size: int | str, chunk_memory: int | None, adapter: DecoderFamily, hidden: torch.Tensor,
                    attention: str = "blocks") -> int:
    """The rows per chunk of a streamed forward over ``hidden`` (B, T, H): ``chunk_size`` (at most
    T), or the rows "auto" picks from the budget."""
    B, T, H = hidden.shape
    if chunk_size != AUTO:
        return max(1, min(chunk_size, T))
    per_row = B * row_bytes(adapter, hidden, attention)
    budget = chunk_memory
    if budget is None:
        budget = max(B * T * H * hidden.element_size(), DEFAULT_ROWS * per_row)
    rows = budget // per_row
    if rows >= ROW_ALIGN:
        rows -= rows % ROW_ALIGN
    return int(max(1, min(rows, T)))
