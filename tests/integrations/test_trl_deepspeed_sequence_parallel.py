"""TRL's own sequence parallelism, streamed: SFT with accelerate's ``ParallelismConfig(sp_size=2,
sp_backend="deepspeed")`` (DeepSpeed's Ulysses data loader hands each rank its slice of every
sequence, ZeRO-1) on 2 CPU processes, and ``stream_trainer(trainer)`` following that split. One
torchrun launch trains it as TRL does (DeepSpeed's Ulysses attention) and streamed, and
transformers' Trainer (labels calls) streamed, two optimizer steps each in float64. The gradients the two ranks' backwards leave, summed, must equal one
process's streamed run at step 1 to 1e-12, and DeepSpeed's own Ulysses at both steps; each rank's
layers ran T/2 rows. (Step 2 is not compared with one process: ZeRO keeps float32 master weights,
so both sequence-parallel runs start step 2 from weights rounded to float32.)"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("deepspeed")

import test_trl as t  # noqa: E402
from _helpers import torchrun  # noqa: E402
from _trl_deepspeed_sp_rank import LENGTH, collate, sft_config, trainer_config, trainer_data  # noqa: E402

WORLD = 2


@functools.cache
def _launch(out: str) -> str:
    """One torchrun launch of WORLD ranks for every case; returns its output."""
    return torchrun(Path(__file__).parent / "_trl_deepspeed_sp_rank.py", out, WORLD)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl_ds_sp")
    log = _launch(str(out))
    runs = {}
    for name in ("deepspeed", "leanbp", "trainer"):
        ranks = []
        for rank in range(WORLD):
            error = Path(out, name, f"rank{rank}.error")
            assert not error.exists(), error.read_text()
            saved = Path(out, name, f"rank{rank}.pt")
            assert saved.exists(), f"rank {rank} saved nothing for {name}:\n{log}"
            ranks.append(torch.load(saved))
        runs[name] = ranks
    return runs


def _summed(ranks: list, step: int) -> dict:
    """The step's gradient of the whole batch: the ranks' shares added (as DeepSpeed reduces them)."""
    assert all(len(r["grads"]) == 2 for r in ranks), [len(r["grads"]) for r in ranks]
    return {name: sum(r["grads"][step][name] for r in ranks) for name in ranks[0]["grads"][step]}


def _worst(expected: dict, got: dict) -> float:
    assert expected and set(expected) == set(got)
    assert any(g.abs().max() > 0 for g in expected.values())
    return max(((got[n] - g).norm() / g.norm().clamp(min=1e-300)).item() for n, g in expected.items())


def _one_process(tmp_path, name: str) -> list:
    """The same run streamed in one process (no DeepSpeed; the gradients as the backward left them:
    no clipping): its gradients at each step."""
    import transformers

    from leanbp.integrations.trl import stream_trainer
    from leanbp.testing import exact_trl_head, full_precision_norms

    grads = t._Grads()
    if name == "trainer":
        trainer = transformers.Trainer(model=t.tiny_model(), args=trainer_config(tmp_path, sequence_parallel=False),
                                       train_dataset=trainer_data(), data_collator=collate, callbacks=[grads])
    else:
        trainer = trl.SFTTrainer(model=t.tiny_model(), args=sft_config(tmp_path, sequence_parallel=False),
                                 train_dataset=t._text_data(), processing_class=t.byte_tokenizer(), callbacks=[grads])
    assert trainer.args.max_grad_norm == 0.0
    stream_trainer(trainer, **t.CHUNKS)
    with full_precision_norms(trainer.model), exact_trl_head():
        trainer.train()
    return grads.steps


@pytest.mark.parametrize("name", ["leanbp", "trainer"])
def test_streamed_under_the_trainers_sequence_parallelism_equals_one_process(launched, tmp_path, name):
    """TRL's SFT (fused-head calls) and transformers' Trainer (labels calls)."""
    ranks = launched[name]
    for r in ranks:  # every streamed layer call ran this rank's half of the 32 tokens
        assert r["rows"] and set(r["rows"]) == {LENGTH // WORLD}, r["rows"]
    reference = _one_process(tmp_path, name)
    assert _worst(reference[0], _summed(ranks, 0)) <= t.TOL


def test_streamed_under_trls_sequence_parallelism_equals_deepspeeds_own_ulysses(launched):
    ulysses, streamed = launched["deepspeed"], launched["leanbp"]
    assert not any(r["rows"] for r in ulysses)  # (DeepSpeed's run streamed nothing)
    for step in range(2):
        assert _worst(_summed(ulysses, step), _summed(streamed, step)) <= t.TOL
    assert [r["losses"] for r in streamed] == [r["losses"] for r in ulysses]
