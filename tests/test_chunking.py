"""chunk_size="auto": the largest chunk (a multiple of 64 rows, at most T) whose working set fits the
budget; the budget is never exceeded, and the step stays exact."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from _helpers import compare_step, make_batch

import leanbp
from leanbp import memory
from leanbp.engine._chunking import DEFAULT_ROWS, ELEMENT_BYTES, chunk_rows
from leanbp.models import adapter_for


def _row_bytes(model, batch=1):
    return batch * adapter_for(model).row_working_set() * ELEMENT_BYTES


def test_auto_picks_the_largest_aligned_chunk_that_fits():
    model = tiny_model("qwen3", dtype=torch.float32)
    adapter, row = adapter_for(model), _row_bytes(model)
    hidden = torch.zeros(1, 5000, 64)
    assert chunk_rows(300, None, adapter, hidden) == 300  # a fixed size stays
    assert chunk_rows("auto", 200 * row + row - 1, adapter, hidden) == 192  # rounded down to 64 rows
    assert chunk_rows("auto", 40 * row, adapter, hidden) == 40  # below 64 rows: as many as fit
    assert chunk_rows("auto", 10 ** 15, adapter, hidden) == 5000  # at most T
    assert chunk_rows("auto", 1, adapter, hidden) == 1
    # default budget: the saved layer inputs, and never less than the fixed default's working set
    assert chunk_rows("auto", None, adapter, hidden) == DEFAULT_ROWS
    long = torch.zeros(1, 2_000_000, 64)
    saved_inputs = 2 * 2_000_000 * 64 * 4
    assert chunk_rows("auto", None, adapter, long) == saved_inputs // row // 64 * 64 > DEFAULT_ROWS


def test_bad_chunk_settings_are_refused():
    model = tiny_model("qwen3")
    for kwargs in (dict(chunk_size="big"), dict(chunk_size=0), dict(chunk_memory=0), dict(chunk_memory=1.5)):
        with pytest.raises(ValueError, match="chunk_"):
            leanbp.stream(model, **kwargs)


def _activations(model, ids, **stream_kwargs):
    leanbp.stream(model, **stream_kwargs)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with memory.track(model) as mem:
        model(input_ids=ids, labels=ids).loss.backward()
    return mem.report.activations, leanbp.chunk_size_used(model)


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
def test_auto_never_makes_the_chunk_exceed_its_budget(family):
    """What the chunk adds to the step's activation peak (against 8-row chunks) stays within the
    budget: the adapter's bytes per row are an upper bound of the real working set."""
    T = 512
    ids = torch.randint(0, 101, (1, T), generator=torch.Generator().manual_seed(0))
    smallest, _ = _activations(tiny_model(family, dtype=torch.float32), ids, chunk_size=8)
    budget = 300 * _row_bytes(tiny_model(family))
    used, rows = _activations(tiny_model(family, dtype=torch.float32), ids, chunk_size="auto", chunk_memory=budget)
    assert rows == 256
    assert 0 < used - smallest <= budget, (used - smallest, budget)


def test_auto_is_exact_and_reports_its_choice():
    model = tiny_model("qwen3", window=16)
    batch = make_batch()  # B=3, T=45
    budget = 20 * _row_bytes(model, batch=3)
    loss_err, _, errs = compare_step(model, dict(chunk_size="auto", chunk_memory=budget), batch)
    assert leanbp.chunk_size_used(model) == 20
    assert loss_err <= 1e-12 and max(errs.values()) <= 1e-12
