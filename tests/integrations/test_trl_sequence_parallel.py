"""TRL's trainers with sequence parallelism: ``stream_trainer(trainer, sequence_parallel=True)`` on
2 CPU processes (gloo), launched once by torchrun for every case. SFT (padded, packed), DPO (with
a reference model, streamed too) and GRPO (sampled completions; beta = 0, and beta > 0 with the
reference model TRL loads from the policy's folder) each train two optimizer steps in float64;
every rank's gradients (at both steps, as the trainer's DDP averaged them) and its parameters
after step 2 must equal one process's streamed run to 1e-12. The same launch checks that ranks
handed different sequences are refused."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

import test_trl as t  # noqa: E402
from _helpers import torchrun  # noqa: E402

WORLD = 2
TOL = t.TOL

# name: (trainer, config, data, the trainer's settings)
CASES = {
    "sft-padded": (trl.SFTTrainer, trl.SFTConfig, t._text_data, dict(per_device_train_batch_size=3)),
    "sft-packed": (trl.SFTTrainer, trl.SFTConfig, t._completion_data,
                   dict(per_device_train_batch_size=4, packing=True, max_length=64)),
    "dpo": (trl.DPOTrainer, trl.DPOConfig, t._preference_data, dict(ref=True, per_device_train_batch_size=2)),
    "grpo": (trl.GRPOTrainer, trl.GRPOConfig, t._prompt_data,
             dict(reward_funcs=t._digit_reward, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=6, beta=0.0, temperature=0.9)),
    # the KL term's gradient is 0 at step 1 (policy = reference) and 2% of the gradient at step 2
    "grpo-kl": (trl.GRPOTrainer, trl.GRPOConfig, t._prompt_data,
                dict(reward_funcs=t._digit_reward, per_device_train_batch_size=4, num_generations=4,
                     max_completion_length=6, beta=0.04, temperature=0.9)),
}


def run_case(name: str, folder: Path, sequence_parallel=None):
    """(gradients per step, final parameters) of one case, streamed after the trainer is built."""
    trainer_cls, config_cls, data, settings = CASES[name]
    return t._train(trainer_cls, config_cls, data(), folder, leanbp_order="after", sequence_parallel=sequence_parallel,
                    **settings)


@functools.cache
def _launch(out: str) -> str:
    """One torchrun launch of WORLD ranks for every case; returns its output."""
    return torchrun(Path(__file__).parent / "_trl_sequence_rank.py", out, WORLD)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl_sp")
    return out, _launch(str(out))


def test_ranks_of_a_group_given_different_sequences_are_refused(launched):
    out, log = launched
    for rank in range(WORLD):
        saved = Path(out, "refusal", f"rank{rank}.txt")
        assert saved.exists(), log
        assert "were given different input_ids" in saved.read_text()


def test_a_whole_sequence_labels_call_has_the_loss_and_gradients_of_one_process(launched):
    """transformers' Trainer's call (labels): padded to a multiple of P, left padding, DDP's average."""
    out, log = launched
    for rank in range(WORLD):
        saved = Path(out, "labels", f"rank{rank}.txt")
        assert saved.exists(), log
        loss_error, grad_error = map(float, saved.read_text().split())
        assert loss_error <= TOL and grad_error <= TOL, (loss_error, grad_error)


@pytest.mark.parametrize("split, sequence_parallel, refusal", [
    (dict(sp_size=2), True, "leave sequence_parallel out"),
    (dict(cp_size=2), None, "cp_size > 1"),
    (dict(sp_size=2, sp_handler="sliced eval"), None, "sp_disable_in_eval=False"),
    (dict(sp_size=2), None, None)])
def test_a_trainer_whose_parallelism_config_splits_the_sequence_is_followed_or_refused(split, sequence_parallel,
                                                                                       refusal):
    """TRL's own split (accelerate's ParallelismConfig(sp_size=P), DeepSpeed's Ulysses loader) is
    followed by stream_trainer(trainer); what leanbp does not follow is refused before the model is
    touched (the run itself: test_trl_deepspeed_sequence_parallel.py)."""
    from types import SimpleNamespace

    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    import leanbp
    from leanbp.integrations.trl import stream_trainer
    from leanbp.streaming import state_of

    if split.get("sp_handler"):
        split["sp_handler"] = DeepSpeedSequenceParallelConfig(sp_disable_in_eval=False)
    model = t.tiny_model()
    trainer = SimpleNamespace(model=model, args=SimpleNamespace(gradient_checkpointing=True),
                              accelerator=SimpleNamespace(parallelism_config=ParallelismConfig(**split)))
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            stream_trainer(trainer, sequence_parallel=sequence_parallel)
        assert not leanbp.is_streamed(model) and trainer.args.gradient_checkpointing
    else:
        stream_trainer(trainer)
        assert state_of(model).presliced and state_of(model).sequence is None  # (DeepSpeed's group: at the first call)


def test_a_fused_head_call_under_sequence_parallelism_outside_stream_trainer_is_refused_with_the_fix():
    from trl.trainer.utils import add_fused_lm_head

    import leanbp
    from leanbp.engine import SequenceGroup
    from leanbp.streaming import state_of

    model = t.tiny_model()
    add_fused_lm_head(model)
    leanbp.stream(model)
    state_of(model).sequence = SequenceGroup(group=None, rank=0, size=2)  # (as a group of 2 would hold it)
    ids = torch.arange(8).unsqueeze(0)
    with pytest.raises(NotImplementedError, match="stream_trainer"):
        model(input_ids=ids, labels=ids, fused_lm_head=True)


@pytest.mark.parametrize("name", list(CASES))
def test_trl_trainer_with_sequence_parallel_equals_one_process(launched, tmp_path, name):
    out, log = launched
    results = []
    for rank in range(WORLD):
        error = Path(out, name, f"rank{rank}.error")
        assert not error.exists(), error.read_text()
        saved = Path(out, name, f"rank{rank}.pt")
        assert saved.exists(), f"rank {rank} saved nothing for {name}:\n{log}"
        results.append(torch.load(saved))
    for got in results:  # every training call split its sequences: each rank ran T/P rows (T padded to 2)
        assert got["splits"] and all(local == -(-whole // WORLD) for whole, local in got["splits"]), got["splits"]
    reference = run_case(name, tmp_path)
    for rank, got in enumerate(results):
        t._assert_same(reference, (got["grads"], got["params"]))
