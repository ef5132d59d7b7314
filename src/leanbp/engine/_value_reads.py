"""The few decisions a streamed step takes from tensor values, and what a planned step assumes.

A streamed step reads three things to the host, each once per forward: which keys an attention
mask hides (``KeyKeep``), where the documents of packed rows start, and which rows carry a label.
``leanbp plan`` runs the real step on fake tensors (``FakeTensorMode``: shapes and dtypes, no
values), where no value can be read; there
each read takes the planner's assumption instead, which is also the worst case for memory: nothing
padded, one document per row, every row labelled.
"""

from __future__ import annotations

import torch


def has_values(t: torch.Tensor) -> bool:
    """False for a fake tensor (a planned step), whose values do not exist."""
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor)


def labelled_rows(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Flat indices (into B*T) of the rows whose target is not ``ignore_index`` (with fake targets:
    every row)."""
    flat = targets.reshape(-1)
    if not has_values(flat):
        return torch.arange(flat.numel(), device=flat.device)
    return torch.nonzero(flat != ignore_index).squeeze(1)
