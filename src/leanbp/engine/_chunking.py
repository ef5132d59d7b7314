"""``chunk_size="auto"``: the largest chunk whose working set fits a memory budget.

In a streamed step only one thing grows with the chunk size: the graph of the chunk a layer's
backward recomputes (its normed rows, q/k/v before and after RoPE, the attention output, the MLP's
intermediates, the residual sums) and the gradients flowing through it, one chunk at a time.
Larger chunks run faster (fewer and larger matmuls, fewer calls, fewer prefix blocks), so "auto"
takes the largest chunk whose working set fits the budget:

    rows = budget // (B x bytes per row),  rounded down to a multiple of 64 rows, at most T

The budget is ``chunk_memory`` when given; by default it is what the saved layer inputs take
anyway (L x B x T x H elements), but never less than the working set of the fixed default chunk
(1024 rows), so that "auto" is never slower than the default: the activation memory stays linear
in T, at most about twice the layer inputs (plus the head's and the K/V's fixed parts).

The bytes per row are the family adapter's upper bound (``FamilyAdapter.row_working_set``), counted
at 4 bytes per element whatever the dtype (norms, softmax and accumulations upcast to fp32);
``tests/test_chunking.py`` checks the bound against measured working sets.
"""

from __future__ import annotations

import torch

AUTO = "auto"
ROW_ALIGN = 64  # rows: matmul-friendly multiples
DEFAULT_ROWS = 1024  # the fixed default, the least "auto" picks unless given a budget
ELEMENT_BYTES = 4


def chunk_rows(chunk_size, chunk_memory: int | None, adapter, hidden: torch.Tensor) -> int:
    """The chunk size of a streamed forward over ``hidden`` (B, T, H): ``chunk_size`` itself, or the
    rows "auto" picks from the budget."""
    if chunk_size != AUTO:
        return chunk_size
    B, T, H = hidden.shape
    row_bytes = B * adapter.row_working_set() * ELEMENT_BYTES
    budget = chunk_memory
    if budget is None:
        saved_inputs = len(adapter.layers()) * B * T * H * hidden.element_size()
        budget = max(saved_inputs, DEFAULT_ROWS * row_bytes)
    rows = budget // row_bytes
    if rows >= ROW_ALIGN:
        rows -= rows % ROW_ALIGN
    return int(min(max(rows, 1), T))
