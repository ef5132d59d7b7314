"""Sequence parallelism (``leanbp.stream(model, sequence_parallel=group)``): one sequence over 2 and 4
CPU processes (gloo), float64. Every rank's loss and the gradients summed over the group equal plain
autograd on the whole sequence in one process, for the causal-LM loss and for a loss nonlinear in
per-sequence sums (DPO's shape), across families, padding, packed documents, sliding windows
(Mistral's on every layer, Gemma 3's on some), soft-capping, a mixture of experts (with and without
its load-balancing loss), replicated K/V
heads (P = 4 > 2 K/V heads), chunks that do not divide a rank's rows, sequences that do not
divide over P (padded by ``sequence_batch``), and host offload of the layer boundaries; on 4
processes, ``sequence_parallel=True`` takes the groups of 2 that DeepSpeed set up (each group its
own sequences). Each world size is spawned once for all its cases."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

import leanbp
from leanbp.engine import SequenceGroup
from leanbp.engine._ulysses import HeadSplit
from leanbp.testing._sequence_parallel import SequenceCase, check_sequence_parallel
from conftest import tiny_model

TOL = 1e-12

CASES = {
    2: [SequenceCase(),
        SequenceCase(padding="left", objective="pairwise"),
        SequenceCase(family="qwen3", documents=True),
        SequenceCase(family="mistral", window=6, padding="right"),
        SequenceCase(family="gemma2", padding="left"),  # soft-capped attention, its own block path
        SequenceCase(family="gemma3_text", window=6, padding="right"),  # sliding-window and global layers
        SequenceCase(family="qwen3_moe"),
        SequenceCase(family="qwen3_moe", router_loss=True, padding="left", seq_len=40, chunk_size=6),
        SequenceCase(seq_len=40, chunk_size=6, documents=True, objective="pairwise"),  # 20 rows: chunks of 6, 6, 6, 2
        SequenceCase(seq_len=33, padding="left"),  # padded to 34 by sequence_batch
        SequenceCase(padding="left", offload=True, objective="pairwise"),
        SequenceCase(family="qwen3", seq_len=40, chunk_size=6, documents=True, offload=True)],
    4: [SequenceCase(padding="right", chunk_size=3),
        SequenceCase(family="qwen3", documents=True, objective="pairwise"),
        SequenceCase(seq_len=30, chunk_size=3, documents=True),  # padded to 32
        SequenceCase(padding="right", chunk_size=3, offload=True),
        SequenceCase(family="gemma3_text", window=6, padding="left", chunk_size=3),  # windows cross 2 ranks' rows
        SequenceCase(family="qwen3_moe", router_loss=True, padding="right", chunk_size=3)],
}
# DeepSpeed's sequence-parallel groups (accelerate's ParallelismConfig(sp_size=2, sp_backend="deepspeed")
# has them made): 2 groups of 2 in the world of 4
DEEPSPEED_GROUPS = SequenceCase(family="qwen3", padding="left", deepspeed_groups=2)
if importlib.util.find_spec("deepspeed") is not None:
    CASES[4].append(DEEPSPEED_GROUPS)


@functools.cache
def _runs(world: int) -> dict:
    """Every case of one world size, from one spawn: {case name: [each rank's result]}."""
    return dict(zip((c.name for c in CASES[world]), check_sequence_parallel(CASES[world], world)))


@pytest.mark.parametrize("world, name", [pytest.param(world, case.name, id=f"P{world}-{case.name}")
                                         for world in CASES for case in CASES[world]])
def test_every_rank_has_the_whole_sequences_loss_and_the_summed_gradients_are_plain_autograds(world, name):
    per_rank = _runs(world)[name]
    assert len(per_rank) == world
    for result in per_rank:
        assert "error" not in result, result["error"]
        assert abs(result["loss"] - result["reference_loss"]) <= TOL * abs(result["reference_loss"])
        assert result["worst_grad_error"] <= TOL


def test_sequence_parallel_true_takes_the_groups_deepspeed_set_up():
    pytest.importorskip("deepspeed")
    per_rank = _runs(4)[DEEPSPEED_GROUPS.name]  # (exact: the test above)
    assert all(r.get("deepspeeds_group") for r in per_rank), per_rank
    assert [(r["group_size"], r["group_rank"]) for r in per_rank] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    losses = [r["loss"] for r in per_rank]
    assert losses[0] == losses[1] and losses[2] == losses[3] and losses[0] != losses[2]  # (each group its sequences)


def test_a_model_streamed_without_sequence_parallel_under_deepspeeds_ulysses_is_refused(monkeypatch):
    """DeepSpeed's groups set up (as accelerate's ParallelismConfig(sp_size) does) mean each rank holds
    a slice of the sequence; streamed layers without the exchange would attend within the slice."""
    import sys
    import types

    model = tiny_model("llama")
    leanbp.stream(model)
    ids = torch.arange(8).unsqueeze(0)
    model(input_ids=ids, labels=ids).loss.backward()  # (no groups: trains)
    state = types.ModuleType("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    state._SEQUENCE_PARALLEL_GROUP = object()
    monkeypatch.setitem(sys.modules, state.__name__, state)
    with pytest.raises(RuntimeError, match="DeepSpeed's Ulysses sequence parallelism is set up"):
        model(input_ids=ids, labels=ids)
    with torch.no_grad():
        model(input_ids=ids, labels=ids)  # (no graph: evaluation runs whole sequences, DeepSpeed's default)


def test_pre_shifted_labels_under_sequence_parallelism_are_refused():
    """DeepSpeed's data loader hands each rank shift_labels (and transformers copies them to labels):
    leanbp would shift them again."""
    model = tiny_model("llama")
    leanbp.stream(model)
    from leanbp.streaming._state import state_of
    state_of(model).sequence = SequenceGroup(group=None, rank=0, size=2)  # (as a group of 2 would hold it)
    ids = torch.arange(8).unsqueeze(0)
    with pytest.raises(ValueError, match="shift_labels under sequence parallelism"):
        model(input_ids=ids, labels=ids, shift_labels=ids)


def test_the_heads_must_split_over_the_group():
    with pytest.raises(ValueError, match="divide the number of query heads"):
        HeadSplit(q_heads=6, kv_heads=2, size=4)
    with pytest.raises(ValueError, match="K/V heads"):
        HeadSplit(q_heads=12, kv_heads=4, size=6)
    assert HeadSplit(q_heads=8, kv_heads=2, size=4).kv_of(3) == slice(1, 2)  # (replicated: ranks 2 and 3 share head 1)


def test_sequence_parallel_needs_a_process_group_and_the_streamed_layers():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="torch.distributed initialized"):
        leanbp.stream(model, sequence_parallel=True)
    with pytest.raises(ValueError, match="needs layers=True"):
        leanbp.stream(model, layers=False, sequence_parallel=True)
    assert not leanbp.is_streamed(model)  # (a refusal installs nothing)


def test_a_sequence_that_does_not_split_evenly_is_refused_with_the_fix(monkeypatch):
    model = tiny_model("llama")
    leanbp.stream(model)
    with pytest.raises(ValueError, match="not sequence-parallel"):
        leanbp.sequence_rows(model, torch.zeros(1, 8))
    from leanbp.streaming._state import state_of
    state_of(model).sequence = SequenceGroup(group=None, rank=1, size=3)  # (as a group of 3 would hold it)
    with pytest.raises(ValueError, match="pad it to a multiple of 3"):
        leanbp.sequence_rows(model, torch.zeros(1, 8))
    assert leanbp.sequence_rows(model, torch.arange(9).unsqueeze(0)).tolist() == [[3, 4, 5]]


def test_sequence_batch_pads_to_a_multiple_of_the_group_with_rows_that_change_nothing():
    model = tiny_model("llama")
    leanbp.stream(model)
    from leanbp.streaming._state import state_of
    state_of(model).sequence = SequenceGroup(group=None, rank=2, size=3)  # (the last rank of a group of 3)
    ids = torch.arange(1, 9)[None]  # T = 8 -> 9
    rows = leanbp.sequence_batch(model, input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids),
                                 position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]), inputs_embeds=None)
    assert rows["input_ids"].tolist() == [[7, 8, 0]] and rows["labels"].tolist() == [[7, 8, -100]]
    assert rows["attention_mask"].tolist() == [[1, 1, 0]] and rows["position_ids"].tolist() == [[3, 4, 5]]
    assert rows["inputs_embeds"] is None
    with pytest.raises(ValueError, match="does not know how to pad"):
        leanbp.sequence_batch(model, input_ids=ids, token_type_ids=ids)
    with pytest.raises(ValueError, match="different lengths"):
        leanbp.sequence_batch(model, input_ids=ids, labels=ids[:, :4])
