"""chunk_size="auto": the largest chunk (a multiple of 64 rows, at most T) whose working set fits the
budget; the budget is never exceeded, and the step stays exact."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from _helpers import compare_step, make_batch

import leanbp
from leanbp import memory
from leanbp.engine import DEFAULT_ROWS, pick_chunk_rows, row_bytes
from leanbp.models import adapter_for


def _row_bytes(model, hidden, batch=1):
    return batch * row_bytes(adapter_for(model), hidden)


def test_auto_picks_the_largest_aligned_chunk_that_fits():
    model = tiny_model("qwen3", dtype=torch.float32)
    adapter = adapter_for(model)
    hidden = torch.empty(1, 1, 1).expand(1, 5000, 64)  # (only its shape and dtype are read)
    row = _row_bytes(model, hidden)
    assert pick_chunk_rows(300, None, adapter, hidden) == 300  # a fixed size stays
    assert pick_chunk_rows(9000, None, adapter, hidden) == 5000  # (at most T)
    assert pick_chunk_rows("auto", 200 * row + row - 1, adapter, hidden) == 192  # rounded down to 64 rows
    assert pick_chunk_rows("auto", 40 * row, adapter, hidden) == 40  # below 64 rows: as many as fit
    assert pick_chunk_rows("auto", 10 ** 15, adapter, hidden) == 5000  # at most T
    assert pick_chunk_rows("auto", 1, adapter, hidden) == 1
    # default budget: one layer input, and never less than the fixed default's working set
    assert pick_chunk_rows("auto", None, adapter, hidden) == DEFAULT_ROWS
    long = torch.empty(1, 1, 1).expand(1, 20_000_000, 64)
    layer_input = 20_000_000 * 64 * 4
    assert pick_chunk_rows("auto", None, adapter, long) == layer_input // row // 64 * 64 > DEFAULT_ROWS
    # float64 counts 8 bytes per element; off the CPU two-block path the (c x T) scores count too
    assert row_bytes(adapter, hidden.double()) == 2 * row
    assert row_bytes(adapter, torch.empty(1, 1, 1, device="meta").expand(1, 5000, 64)) == \
        row + 2 * 4 * 5000 * 4


def test_bad_chunk_settings_are_refused():
    model = tiny_model("qwen3")
    for kwargs in (dict(chunk_size="big"), dict(chunk_size=0), dict(chunk_size="auto", chunk_memory=0),
                   dict(chunk_size="auto", chunk_memory=1.5), dict(chunk_size=64, chunk_memory=10 ** 6)):
        with pytest.raises(ValueError, match="chunk_"):
            leanbp.stream(model, **kwargs)


def _activations(model, ids, **stream_kwargs):
    leanbp.stream(model, **stream_kwargs)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with memory.track(model) as mem:
        model(input_ids=ids, labels=ids).loss.backward()
    return mem.report.activations, leanbp.chunk_size_used(model)


@pytest.mark.parametrize("family,dtype,T", [("llama", torch.float32, 512), ("llama", torch.float64, 512),
                                            ("gemma2", torch.float32, 1536), ("qwen3_moe", torch.float32, 512)])
def test_auto_never_makes_the_chunk_exceed_its_budget(family, dtype, T):
    """What 256-row chunks add to the step's activation peak over 8-row chunks stays within the
    bound for those 248 rows: the adapter's bytes per row bound the real working set (Gemma2's
    soft-capped attention at T > 1024, so its score blocks are full)."""
    ids = torch.randint(0, 101, (1, T), generator=torch.Generator().manual_seed(0))
    smallest, _ = _activations(tiny_model(family, dtype=dtype), ids, chunk_size=8)
    model = tiny_model(family, dtype=dtype)
    row = _row_bytes(model, torch.empty(1, T, model.config.hidden_size, dtype=dtype))
    used, rows = _activations(model, ids, chunk_size="auto", chunk_memory=256 * row + row - 1)
    assert rows == 256
    assert 0 < used - smallest <= (rows - 8) * row, (used - smallest, (rows - 8) * row)


def test_auto_is_exact_and_reports_its_choice():
    model = tiny_model("qwen3", window=16)
    batch = make_batch()  # B=3, T=45
    budget = 20 * _row_bytes(model, torch.empty(3, 45, 64, dtype=torch.float64), batch=3)
    loss_err, _, errs = compare_step(model, dict(chunk_size="auto", chunk_memory=budget), batch)
    assert leanbp.chunk_size_used(model) == 20
    assert loss_err <= 1e-12 and max(errs.values()) <= 1e-12


def test_chunk_size_used_reports_streamed_calls_only():
    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match="not streamed"):
        leanbp.chunk_size_used(model)
    leanbp.stream(model, chunk_size="auto")
    assert leanbp.chunk_size_used(model) is None  # before the first call
    ids, mask, _ = make_batch()
    model.model(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()  # a backbone call
    assert leanbp.chunk_size_used(model) == 45  # min(1024, T)
    head_only = tiny_model("qwen3")
    leanbp.stream(head_only, layers=False)
    head_only(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert leanbp.chunk_size_used(head_only) is None
