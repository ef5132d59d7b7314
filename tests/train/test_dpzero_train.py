"""``leanbp train --optimizer dpzero``: it trains and logs the privacy it spends, a resumed run
continues the accounting and the directions exactly (bit-identical weights to an uninterrupted
run, with reproducible noise), it stops where the budget ends, its noise is not reproducible by
default, it runs on the built-in classification task and another family, and it refuses
settings it cannot honour in one line."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from safetensors.torch import load_file

import leanbp.train._zo as zo_run
from leanbp.cli import main
from leanbp.models import tiny_config
from leanbp.train import TokenData, byte_tokenizer
from leanbp.zo import SeededRandom

pytest.importorskip("opacus", reason="needs the dp extra (pip install -e '.[dp]')")

TINY = ["train", "--optimizer", "dpzero", "--seq-len", "32", "--chunk-size", "16", "--head-chunk-size", "24",
        "--batch-size", "2", "--lr", "1e-4"]


def _weights(out) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoint" / "model.safetensors")


def _log(out) -> list[dict]:
    return list(csv.DictReader((out / "train_log.csv").open()))


def _state(out) -> dict:
    return json.loads((out / "checkpoint" / "trainer_state.json").read_text())


def test_dpzero_trains_resumes_exactly_and_stops_at_its_budget(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(zo_run, "SecureRandom", lambda: SeededRandom(0))  # (reproducible noise, to compare runs)
    a, b = tmp_path / "a", tmp_path / "b"
    assert main([*TINY, "--steps", "3", "--out", str(a)]) == 0
    assert "privacy: epsilon" in capsys.readouterr().out
    rows = _log(a)
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    epsilons = [float(r["epsilon"]) for r in rows]
    privacy = _state(a)["privacy"]
    assert 0 < epsilons[0] < epsilons[1] < epsilons[2] <= 8.0 and epsilons[2] == pytest.approx(privacy["epsilon"],
                                                                                               abs=1e-4)
    assert privacy["sampling"] == "poisson" and privacy["records"] == TokenData(byte_tokenizer(), None, 32).records
    assert privacy["delta"] == 1e-5 and privacy["noise_multiplier"] > 0

    # the same run killed after its second step (checkpointed), then resumed
    step = zo_run.PrivateRun.step

    def dies_at_the_third(self, index, lr):
        if index == 2:
            raise KeyboardInterrupt
        return step(self, index, lr)

    monkeypatch.setattr(zo_run.PrivateRun, "step", dies_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        main([*TINY, "--steps", "3", "--save-every", "1", "--out", str(b)])
    monkeypatch.setattr(zo_run.PrivateRun, "step", step)
    assert main([*TINY, "--steps", "3", "--save-every", "1", "--out", str(b), "--resume"]) == 0
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert _state(b)["privacy"] == privacy
    keep = ("step", "loss", "lr", "epsilon")
    assert [{k: r[k] for k in keep} for r in _log(b)] == [{k: r[k] for k in keep} for r in rows]

    # a longer --steps buys no budget: the run stops before the step that would overspend
    capsys.readouterr()
    assert main([*TINY, "--steps", "5", "--out", str(a), "--resume"]) == 0
    assert "privacy budget reached" in capsys.readouterr().err
    assert _state(a)["step"] == 3 and len(_log(a)) == 3


def test_the_noise_and_the_samples_are_fresh_in_every_run(tmp_path):
    """The same settings and seed, run twice: the directions are the same, the noise (OS CSPRNG) is
    not, so the weights differ."""
    for name in ("c", "d"):
        assert main([*TINY, "--steps", "1", "--out", str(tmp_path / name)]) == 0
    wc, wd = _weights(tmp_path / "c"), _weights(tmp_path / "d")
    assert any(not torch.equal(wc[k], wd[k]) for k in wc)


@pytest.mark.parametrize("optimizer", ["dpzero", "adamw"])
def test_the_classification_task_trains_a_llama(tmp_path, monkeypatch, optimizer):
    # (seeded: a Poisson sample of 3 expected records is empty with probability e^-3, and a step
    # with no record has no loss to report)
    monkeypatch.setattr(zo_run, "SecureRandom", lambda: SeededRandom(0))
    config = tiny_config("llama", vocab_size=512)
    config.save_pretrained(tmp_path / "llama")
    out = tmp_path / "run"
    assert main(["train", "--optimizer", optimizer, "--model", str(tmp_path / "llama" / "config.json"), "--data",
                 "builtin:classify", "--seq-len", "512", "--batch-size", "3", "--steps", "2", "--out", str(out)]) == 0
    state = _state(out)
    assert state["step"] == 2 and all(loss == loss for loss in state["losses"])  # (finite: one label token a row)
    assert ("privacy" in state) == (optimizer == "dpzero")


def test_classify_data_scores_one_label_token_per_row_and_cuts_padding():
    data = TokenData(byte_tokenizer(), "builtin:classify", seq_len=4096)
    assert data.records == 1618
    batch = data.rows([0, 5, 17])
    labelled = (batch["labels"] != -100).sum(1)
    assert labelled.tolist() == [1, 1, 1]
    assert batch["input_ids"].shape[1] == int(batch["attention_mask"].sum(1).max()) < 4096
    assert data.batch(0, 0, 4)["input_ids"].shape[1] < 4096
    # a text corpus: its records are the whole windows
    text = TokenData(byte_tokenizer(), None, seq_len=100)
    assert text.records == text.stream.numel() // 100
    assert torch.equal(text.rows([2])["input_ids"][0], text.stream[200:300])


@pytest.mark.parametrize("args, message", [
    (["--engine", "ddp"], "runs in one process"),
    (["--objective", "sft"], "trains --objective lm"),
    (["--dtype", "bf16"], "needs --dtype fp32 or fp64"),
    (["--dp-clip", "0"], "--dp-clip must be"),
    (["--dp-epsilon", "-1"], "--dp-epsilon must be"),
    (["--dp-delta", "1.5"], "--dp-delta must be in (0, 1)"),
    (["--zo-mu", "0"], "--zo-mu must be"),
    (["--weight-decay", "0.1"], "--weight-decay is AdamW's"),
    (["--approx", "act"], "makes none"),
    (["--batch-size", "100000"], "more than the"),
    (["--dp-epsilon", "1e-9", "--dp-delta", "1e-12"], "no noise multiplier reaches"),
])
def test_settings_dpzero_cannot_honour_are_one_line_errors(tmp_path, capsys, args, message):
    assert main([*TINY, "--steps", "2", "--out", str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("leanbp train: error: ") and message in err[0], err
