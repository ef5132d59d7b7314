"""What the sequence-parallel exchanges hold at their peak: each all-rows or local K/V tensor goes
as soon as its send buffer exists, and each send buffer as soon as it is sent. The group is the
planner's stand-in, whose all-to-all allocates its result as the real one does (values are not the point here:
tests/distributed/test_sequence_parallel.py checks them on real gloo groups)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leanbp.engine._ulysses import HeadSplit, gather_kv, scatter_kv_grads
from leanbp.memory import track
from leanbp.plan._planner import PlannedSequenceGroup


def _peak(fn) -> tuple[int, list]:
    with track(nn.Module()) as mem:
        result = fn()
    return mem.report.peak, result


@pytest.mark.parametrize("kv_heads", [2, 4])  # one K/V head per rank (views), two (copies)
def test_gathering_kv_holds_three_tensors_of_their_size_at_most(kv_heads):
    P, B, n, D = 2, 1, 64, 8
    group, heads = PlannedSequenceGroup(size=P), HeadSplit(4, kv_heads, P)
    one = B * kv_heads * n * D * 4  # bytes of one local K (float32); a send or receive buffer is as large

    def run():
        local = [torch.randn(B, kv_heads, n, D), torch.randn(B, kv_heads, n, D)]
        return gather_kv(group, heads, local)

    peak, (key, value) = _peak(run)
    assert key.shape == value.shape == (B, kv_heads // P, P * n, D)
    # (V waiting, K and its send buffer; then V, the send buffer and what came back; after K: its
    # result beside V, V's send buffer, and V's own receive buffer)
    assert peak <= 3 * one + (one if kv_heads // P > 1 else 0)


@pytest.mark.parametrize("kv_heads", [2, 4, 1])  # views; copies; a K/V head replicated on both ranks
def test_scattering_kv_gradients_holds_three_tensors_of_their_size_at_most(kv_heads):
    P, B, n, D = 2, 1, 64, 8
    group, heads = PlannedSequenceGroup(size=P), HeadSplit(4, kv_heads, P)
    per_rank = heads.kv_per_rank
    one = B * per_rank * P * n * D * 4  # bytes of one all-rows gradient (float32)

    def run():
        grads = [torch.randn(B, per_rank, P * n, D), torch.randn(B, per_rank, P * n, D)]
        return scatter_kv_grads(group, heads, grads, n)

    peak, (dkey, dvalue) = _peak(run)
    assert dkey.shape == dvalue.shape == (B, kv_heads, n, D)
    full = B * kv_heads * n * D * 4  # (a replicated head's sum is a tensor of its own)
    assert peak <= 3 * one + (one if per_rank > 1 else 0) + (2 * full if kv_heads < P else 0)


def test_the_exchanges_empty_the_lists_they_are_given():
    group, heads = PlannedSequenceGroup(size=2), HeadSplit(4, 2, 2)
    local = [torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4)]
    gather_kv(group, heads, local)
    grads = [torch.zeros(1, 1, 16, 4), torch.zeros(1, 1, 16, 4)]
    scatter_kv_grads(group, heads, grads, 8)
    assert local == [] and grads == []  # (nothing of the caller's keeps the big tensors alive)
