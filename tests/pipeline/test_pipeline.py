"""Pipelines (``leanbp.pipeline.Pipeline``) on 2 and 4 CPU processes (gloo), float64, 1F1B and 2BP:
every stage's gradients of the first step and its weights after 3 AdamW steps equal the streamed
model trained on the whole batch in one process; 2BP's stages after the first split every backward
into input and weight passes. Each stage count is spawned once for all its cases."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import leanbp
from leanbp.pipeline import Pipeline, split_layers
from leanbp.testing._pipeline import PipelineCase, check_pipeline
from conftest import tiny_model

TOL = 1e-12

CASES = {
    2: [PipelineCase(schedule="1f1b"), PipelineCase(schedule="2bp"),
        PipelineCase(schedule="2bp", family="qwen3", padding=True, layers=3, microbatches=2),
        PipelineCase(schedule="2bp", streamed=False)],  # transformers' layers: torch splits their graphs
    4: [PipelineCase(schedule="1f1b", chunk_size=4), PipelineCase(schedule="2bp", padding=True)],
}


@functools.cache
def _runs(stages: int) -> dict:
    return dict(zip((c.name for c in CASES[stages]), check_pipeline(CASES[stages], stages)))


@pytest.mark.parametrize("stages, case", [pytest.param(s, c, id=f"S{s}-{c.name}") for s in CASES for c in CASES[s]])
def test_every_stage_trains_as_one_process_does(stages, case):
    per_stage = _runs(stages)[case.name]
    assert len(per_stage) == stages
    for stage, result in enumerate(per_stage):
        assert "error" not in result, result["error"]
        assert len(result["losses"]) == case.steps
        for loss, ref in zip(result["losses"], result["reference_losses"]):
            assert abs(loss - ref) <= TOL * abs(ref)
        assert result["missing"] == []  # every trainable parameter of the stage got its gradient
        assert result["worst_grad_error"] <= TOL
        assert result["worst_weight_error"] <= TOL
        split = case.schedule == "2bp" and stage > 0  # (torch runs the first stage's backward whole)
        expected = {"input", "weight"} if split else {"full"}
        assert set(result["passes"]) == expected
        assert all(n == case.steps * case.microbatches for n in result["passes"].values())
    model = tiny_model(case.family, num_hidden_layers=case.layers, tie_word_embeddings=False)
    assert sum(r["params"] for r in per_stage) == len(list(model.parameters()))  # each in exactly one stage


def test_layers_split_evenly_with_the_extra_ones_first():
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError, match="at least 4 decoder layers"):
        split_layers(3, 4)


def test_a_pipeline_needs_a_process_group_and_a_known_schedule():
    model = tiny_model("llama", tie_word_embeddings=False)
    with pytest.raises(RuntimeError, match="torch.distributed initialized"):
        Pipeline(leanbp.stream(model), microbatches=2)
    with pytest.raises(ValueError, match="schedule must be one of"):
        Pipeline(model, schedule="gpipe", microbatches=2)


def test_uneven_micro_batches_and_head_only_streaming_are_refused(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="without layers=False"):
            Pipeline(leanbp.stream(tiny_model("llama", tie_word_embeddings=False), layers=False), microbatches=2)
        pipe = Pipeline(leanbp.stream(tiny_model("llama", tie_word_embeddings=False), chunk_size=4), microbatches=2)
        ids = torch.randint(0, 50, (3, 9))
        with pytest.raises(ValueError, match="3 rows do not split into 2"):
            pipe.step(ids, ids)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stages, microbatches", [(4, 4), (4, 8), (8, 16), (8, 32)])
def test_idle_fraction_of_1f1b_is_the_textbook_bubble(stages, microbatches):
    from leanbp.pipeline import Costs, idle_fraction

    expected = (stages - 1) / (microbatches + stages - 1)  # with a backward twice a forward
    assert idle_fraction("1f1b", stages, microbatches, Costs(F=1, B=2)) == pytest.approx(expected, abs=1e-12)


def test_2bp_fills_two_thirds_of_the_bubble_when_the_passes_cost_alike():
    """ZB-H1 (the zero-bubble paper): with F = I = W = 1 its bubble is (S - 1) units against 1F1B's
    3 (S - 1). torch's first stage runs its backward whole in its W slots (its input needs no
    gradient), as the simulation does."""
    from leanbp.pipeline import Costs, one_f_one_b_order, simulate, zero_bubble_order

    S, M = 4, 8
    costs = Costs(F=1, B=2, I=1, W=1)
    one = simulate(one_f_one_b_order(S, M), costs)
    zb = simulate(zero_bubble_order(S, M), costs)
    assert one.makespan == M * 3 + 3 * (S - 1)
    assert one.busy == zb.busy == S * M * 3
    assert zb.makespan == M * 3 + (S - 1)  # (here the first stage's whole backward fits its slots)
