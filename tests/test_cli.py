"""The command line: train (with checkpoint + resume), verify, and bench on tiny settings."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import leanbp
from leanbp.cli import main


def test_train_checkpoint_and_resume(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--seq-len", "128", "--steps", "3", "--save-every", "2", "--out", str(out),
                 "--chunk-size", "40", "--head-chunk-size", "50"]) == 0
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 3 and len(state["losses"]) == 3
    assert (out / "loss.png").stat().st_size > 0
    # the checkpoint is a plain transformers checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    assert model.config.model_type == "qwen3"
    assert main(["train", "--seq-len", "128", "--steps", "5", "--out", str(out), "--resume",
                 "--chunk-size", "40"]) == 0
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 5 and len(state["losses"]) == 5
    rows = (out / "train_log.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows] == ["step", "1", "2", "3", "4", "5"]


def test_train_resume_gives_the_same_losses_as_one_run(tmp_path):
    args = ["train", "--seq-len", "64", "--chunk-size", "24", "--lr", "3e-3"]
    assert main(args + ["--steps", "4", "--out", str(tmp_path / "a")]) == 0
    assert main(args + ["--steps", "2", "--out", str(tmp_path / "b")]) == 0
    assert main(args + ["--steps", "4", "--out", str(tmp_path / "b"), "--resume"]) == 0
    assert main(args + ["--steps", "4", "--out", str(tmp_path / "c"), "--offload"]) == 0
    a = json.loads((tmp_path / "a" / "checkpoint" / "trainer_state.json").read_text())["losses"]
    b = json.loads((tmp_path / "b" / "checkpoint" / "trainer_state.json").read_text())["losses"]
    c = json.loads((tmp_path / "c" / "checkpoint" / "trainer_state.json").read_text())["losses"]
    assert a == pytest.approx(b, rel=1e-5)
    assert a == c  # offload: the same gradients bit for bit, so the same run


def test_train_sft_jsonl_with_prompt_masking(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Q{i}: what is {i}+{i}? ", "completion": f"A: {2 * i}."})
                              for i in range(20)))
    assert main(["train", "--data", str(data), "--seq-len", "48", "--batch-size", "2", "--grad-accum", "2",
                 "--steps", "2", "--out", str(tmp_path / "o"), "--chunk-size", "16"]) == 0


def test_train_rejects_bad_input(tmp_path, capsys):
    assert main(["train", "--steps", "0", "--out", str(tmp_path)]) == 2
    assert "steps must be >= 1" in capsys.readouterr().err
    assert main(["train", "--model", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    assert main(["train", "--resume", "--out", str(tmp_path / "empty")]) == 2
    assert main(["train", "--offload", "--no-stream", "--out", str(tmp_path / "x")]) == 2
    assert "--offload" in capsys.readouterr().err


def test_verify_built_in_model(capsys):
    assert main(["verify", "--seq-len", "40", "--batch", "2", "--chunk-size", "9"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "lm head" in out


def test_verify_a_local_config(tmp_path, capsys):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    config.save_pretrained(tmp_path)
    assert main(["verify", "--model", str(tmp_path / "config.json"), "--seq-len", "30", "--chunk-size", "7"]) == 0


def test_bench_writes_table_csv_and_plot(tmp_path, capsys):
    assert main(["bench", "--seq-lens", "64", "--methods", "ckpt,leanbp,leanbp_auto", "--out", str(tmp_path),
                 "--chunk-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "| 64 | leanbp | 32 |" in out
    assert "| 64 | leanbp_auto | 64 |" in out  # "auto": the whole sequence fits the default budget
    csv_text = (tmp_path / "bench.csv").read_text()
    assert csv_text.startswith("method,seq_len") and "leanbp" in csv_text
    assert (tmp_path / "bench.png").stat().st_size > 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert all("error" not in r and r["activations"] > 0 for r in rows)


@pytest.mark.parametrize("model", ["gemma3", "qwen3_moe"])
def test_bench_runs_the_other_family_shapes(tmp_path, capsys, model):
    assert main(["bench", "--model", model, "--seq-lens", "48", "--methods", "leanbp", "--timed-steps", "1",
                 "--out", str(tmp_path), "--chunk-size", "16"]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [(r["model"], r["method"]) for r in rows] == [(model, "leanbp")] and rows[0]["activations"] > 0


def test_bench_measures_qlora(tmp_path, capsys, small_cases):
    """``--quantize nf4``: each method on the bench model loaded in 4 bits with LoRA on top (the
    cases in this process, the model at a tiny size: ``small_cases``)."""
    pytest.importorskip("bitsandbytes")
    assert main(["bench", "--quantize", "nf4", "--seq-lens", "48", "--methods", "ckpt,leanbp", "--timed-steps", "1",
                 "--out", str(tmp_path), "--chunk-size", "16"]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [(r["quantize"], r["method"]) for r in rows] == [("nf4", "ckpt"), ("nf4", "leanbp")]
    assert all("error" not in r and r["activations"] > 0 for r in rows)
    # the frozen 4-bit base gets no gradient: only the fp32 adapters' (r=8 on the 7 linears of each layer)
    from _helpers import TINY_SHAPE as s

    width, kv, ffn = s["hidden_size"], s["num_key_value_heads"] * s["head_dim"], s["intermediate_size"]
    adapters = 8 * (2 * (width + width) + 2 * (width + kv) + 3 * (width + ffn)) * s["num_hidden_layers"]
    assert rows[0]["grads"] == rows[1]["grads"] == 4 * adapters


def test_bench_quantize_builds_the_qlora_model():
    pytest.importorskip("bitsandbytes")
    import bitsandbytes

    from leanbp.bench import build_case_model

    top, _ = build_case_model({"method": "leanbp", "seq_len": 64, "quantize": "nf4", "stream": {"chunk_size": 16}})
    lm = top.base_model.model
    assert leanbp.is_streamed(lm)
    linears = [m for m in lm.model.layers.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    assert len(linears) == 4 * 7 and all(m.weight.quant_state.nested for m in linears)  # double quantization
    assert {n.split(".")[-2] for n, p in top.named_parameters() if p.requires_grad} == {"default"}  # lora_A/B


@pytest.mark.parametrize("objective", ["lm", "sft", "dpo", "grpo"])
def test_every_objective_runs_on_its_defaults(tmp_path, objective):
    """`leanbp train --objective X` with nothing but --steps and --out: each objective's defaults
    form a valid run (GRPO's batch holds one prompt's group by default)."""
    if objective != "lm":
        pytest.importorskip("trl")
    out = tmp_path / objective
    args = ["train", "--objective", objective, "--steps", "2", "--out", str(out)]
    assert main(args) == 0
    rows = (out / "train_log.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows] == ["step", "1", "2"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    assert model.config.model_type == "qwen3" and (out / "loss.png").stat().st_size > 0
    if objective == "dpo":  # resume continues from the trainer's newest checkpoint
        assert main([*args[:-4], "--steps", "3", "--out", str(out), "--resume"]) == 0
        assert [r.split(",")[0] for r in (out / "train_log.csv").read_text().splitlines()] == ["step", "1", "2", "3"]


def test_grpo_batches_that_split_a_group_are_explained_with_the_fix(tmp_path, capsys):
    pytest.importorskip("trl")
    assert main(["train", "--objective", "grpo", "--batch-size", "6", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--batch-size 6 x --grad-accum 1 = 6 completions" in err and "not a whole number of groups" in err
    assert "pass --batch-size 4 (or a multiple of it), or --group-size 2 or 3 or 6" in err
    assert main(["train", "--objective", "grpo", "--group-size", "1", "--out", str(tmp_path / "o")]) == 2
    assert "at least 2 completions per prompt" in capsys.readouterr().err


def test_train_objective_rejects_data_in_the_wrong_format(tmp_path, capsys):
    pytest.importorskip("trl")
    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b"}\n')
    assert main(["train", "--objective", "dpo", "--data", str(data), "--out", str(tmp_path / "o")]) == 2
    assert "prompt+chosen+rejected" in capsys.readouterr().err
    data.write_text('{"prompt": "a", "answer": "b"}\nnot json\n')
    assert main(["train", "--objective", "grpo", "--data", str(data), "--out", str(tmp_path / "o")]) == 2
    assert "prefs.jsonl:2: not valid JSON" in capsys.readouterr().err


# -- reliability of `leanbp train`: no run lost, no NaN saved --------------------------------------

TINY = ["train", "--seq-len", "32", "--chunk-size", "16", "--head-chunk-size", "24"]


def _steps(out):
    return [r.split(",")[0] for r in (out / "train_log.csv").read_text().splitlines()[1:]]


def test_a_new_run_never_overwrites_an_old_one_silently(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "2", "--out", str(out)]) == 0
    assert main([*TINY, "--steps", "1", "--out", str(out)]) == 2
    assert "already holds a run (checkpoint at step 2)" in capsys.readouterr().err
    assert _steps(out) == ["1", "2"]
    assert main([*TINY, "--steps", "1", "--out", str(out), "--overwrite"]) == 0
    assert _steps(out) == ["1"]


def test_resume_refuses_other_settings(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "2", "--out", str(out)]) == 0
    assert main([*TINY, "--steps", "3", "--out", str(out), "--resume", "--lr", "3e-3", "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert "lr: run has 0.001, now 0.003" in err and "seed: run has 0, now 1" in err


def test_resume_after_a_crash_inside_the_checkpoint_swap(tmp_path):
    """A crash after the new checkpoint's folder is written but before the pointer moves, with a
    torn temporary folder left behind: --resume takes the newest complete checkpoint."""
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "2", "--save-every", "1", "--out", str(out)]) == 0
    (out / "checkpoint").unlink()  # the pointer is gone
    torn = out / "checkpoints" / ".step-00000003.tmp"
    torn.mkdir()
    (torn / "config.json").write_text("{")  # half written, no COMPLETE marker
    with open(out / "train_log.csv", "a") as f:
        f.write("3,9.99999,1e-3,1,1,1\n")  # a log row whose checkpoint never landed
    assert main([*TINY, "--steps", "4", "--save-every", "1", "--out", str(out), "--resume"]) == 0
    assert _steps(out) == ["1", "2", "3", "4"]
    assert "9.99999" not in (out / "train_log.csv").read_text()
    assert (out / "checkpoint").resolve().name == "step-00000004" and not torn.exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003", "step-00000004"]


def test_sft_examples_without_completion_tokens_are_left_out(tmp_path, capsys):
    """An example whose prompt fills --seq-len would make a step without labels (NaN in plain
    transformers' loss): it is left out with a warning; with none left, a clear error."""
    data = tmp_path / "sft.jsonl"
    rows = [{"prompt": "x" * 80, "completion": "y"}] * 3 + [{"prompt": "q: ", "completion": "an answer"}]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "run"
    with pytest.warns(UserWarning, match="3 of 4 examples have no completion token"):
        assert main([*TINY, "--data", str(data), "--steps", "2", "--out", str(out)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    data.write_text("\n".join(json.dumps(r) for r in rows[:3]))
    assert main([*TINY, "--data", str(data), "--steps", "2", "--out", str(tmp_path / "none")]) == 2
    assert "no example has a completion token" in capsys.readouterr().err


def test_a_step_without_labels_or_with_a_non_finite_loss_makes_no_update():
    from leanbp.train import NonFiniteError
    from leanbp.train._loop import _skip_reason

    assert "no labelled token" in _skip_reason(0, n_items=0, loss=0.0, grad_norm=0.0, skip_nonfinite=False)
    assert _skip_reason(0, n_items=5, loss=1.0, grad_norm=2.0, skip_nonfinite=False) is None
    assert "skipped" in _skip_reason(0, n_items=5, loss=float("nan"), grad_norm=2.0, skip_nonfinite=True)
    with pytest.raises(NonFiniteError, match="not finite"):
        _skip_reason(0, n_items=5, loss=1.0, grad_norm=float("inf"), skip_nonfinite=False)


def test_a_diverging_run_stops_before_a_non_finite_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "4", "--save-every", "1", "--lr", "1e30", "--warmup", "0", "--out", str(out)]) == 3
    assert "not finite" in capsys.readouterr().err
    for folder in (out / "checkpoints").glob("step-*"):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert all(torch.isfinite(p).all() for p in model.parameters()), folder.name


def test_verify_rejects_settings_that_check_nothing(capsys):
    assert main(["verify", "--seq-len", "1"]) == 2
    assert "too short" in capsys.readouterr().err
    assert main(["verify", "--batch", "0"]) == 2
    assert "--batch must be >= 1" in capsys.readouterr().err


def test_train_rejects_unusable_inputs(tmp_path, capsys):
    cases = [
        (["--data", str(tmp_path)], "is a folder"),
        (["--out", str(tmp_path / "file.txt" / "run")], "cannot make a folder"),
        (["--device", "cuda"], "no CUDA device"),
        (["--lr", "inf"], "lr must be a finite number"),
    ]
    (tmp_path / "file.txt").write_text("x")
    for extra, message in cases:
        args = [*TINY, "--steps", "1", "--out", str(tmp_path / "o"), *extra]
        assert main(args) == 2, extra
        assert message in capsys.readouterr().err, extra


@pytest.mark.parametrize("args,message", [
    (["--seq-lens", ""], "seq_lens is empty"),
    (["--seq-lens", "0"], "positive integers"),
    (["--seq-lens", "-8"], "positive integers"),
    (["--seq-lens", "abc"], "takes integers"),
    (["--methods", "bogus"], "choose from"),
    (["--chunk-size", "0"], "chunk_size must be a positive integer"),
    (["--suite", "approx", "--batch", "0"], "batch must be a positive integer"),
    (["--suite", "trl", "--seq-lens", "ppo=128"], "looks like sft="),
    (["--suite", "approx", "--quantize", "nf4"], "--quantize is measured by the stream suite"),
    (["--suite", "peers", "--quantize", "nf4"], "--quantize is measured by the stream suite"),
    (["--quantize", "nf4", "--methods", "alst"], "not the peers"),
])
def test_bench_rejects_bad_settings_before_running(tmp_path, capsys, args, message):
    assert main(["bench", *args, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bench.csv").exists()


@pytest.mark.parametrize("name,content,message", [
    ("bad.jsonl", '{"text": "fine"}\n{"text": 5}\n', "record 2: 'text' must be a string"),
    ("bad.jsonl", '{"text": "fine"}\n"just a string"\n', "bad.jsonl:2: expected a JSON object"),
    ("bad.jsonl", '{"text": "fine"}\n{"text": \n', "bad.jsonl:2: not valid JSON"),
    ("BAD.JSONL", '{"prompt": 1, "completion": "x"}\n', "record 1: 'prompt' must be a string"),
])
def test_train_names_the_bad_line_of_its_data(tmp_path, capsys, name, content, message):
    data = tmp_path / name
    data.write_text(content)
    assert main([*TINY, "--data", str(data), "--steps", "1", "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("suite", ["stream", "approx", "trl"])
def test_every_bench_suite_runs_its_cases_on_the_device_asked_for(tmp_path, monkeypatch, suite):
    """--device reaches every case of every suite (the approx and TRL suites ran on the CPU whatever
    it said); the cases are recorded here instead of run."""
    from leanbp.bench import _run

    specs = []
    monkeypatch.setattr(_run, "_run_one", lambda spec, timeout_s: specs.append(spec) or {**spec, "error": "not run"})
    lengths = {"stream": "64", "approx": "64", "trl": "sft=64"}[suite]
    assert main(["bench", "--suite", suite, "--device", "cuda", "--seq-lens", lengths, "--out", str(tmp_path)]) == 0
    assert specs and {s["device"] for s in specs} == {"cuda"}


def test_every_stream_setting_reads_the_same_in_every_command():
    """A StreamConfig setting offered by several commands has one default and one help text, built
    from its field; the ones every command offers are the chunk sizes."""
    import dataclasses

    from leanbp import StreamConfig
    from leanbp.cli import options_by_command

    seen = {}  # option -> [(command, default, help)]
    for command, options in options_by_command().items():
        for option, action in options.items():
            seen.setdefault(option, []).append((command, action.default, action.help))
    fields = {f.name: f for f in dataclasses.fields(StreamConfig)}
    for option in ("--chunk-size", "--head-chunk-size"):
        assert [c for c, _, _ in seen[option]] == ["train", "bench", "plan", "verify"]
    for option, uses in seen.items():
        name = option.removeprefix("--").replace("-", "_")
        if name not in fields:
            continue
        assert len({(default, text) for _, default, text in uses}) == 1, (option, uses)
        field = fields[name]
        assert uses[0][1] == field.default and uses[0][2].startswith(field.metadata["help"].replace("%", "%%")), option


def test_old_call_forms_keep_working_and_say_so():
    """Renamed names keep a deprecated alias: settings passed positionally to stream() and
    stream_trainer(), LEANBP_ATTENTION, leanbp.engine.stream, leanbp.memory.Planner, and the chunk
    sizes as arguments of Planner and the bench cases."""
    import os
    import types

    import leanbp
    import leanbp.engine
    import leanbp.memory
    from leanbp.bench import BenchCase
    from leanbp.integrations.trl import stream_trainer
    from leanbp.plan import Planner

    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, attn_implementation="sdpa"))
    ids = torch.randint(0, 64, (1, 9))
    with pytest.warns(DeprecationWarning, match="positionally"):
        leanbp.stream(model, 7)
    model(input_ids=ids, labels=ids).loss.backward()
    assert leanbp.chunk_size_used(model) == 7
    leanbp.unstream(model)
    os.environ["LEANBP_ATTENTION"] = "mask"
    try:
        with pytest.warns(DeprecationWarning, match="LEANBP_ATTENTION"):
            leanbp.stream(model)
    finally:
        del os.environ["LEANBP_ATTENTION"]
    assert model._leanbp_stream.config.attention == "mask"
    model(input_ids=ids, labels=ids).loss.backward()  # the masked single-call path runs
    leanbp.unstream(model)
    with pytest.warns(DeprecationWarning, match="positionally"):
        leanbp.stream(model, 7, 5)  # chunk_size, head_chunk_size: the old signature's order
    assert model._leanbp_stream.config.head_chunk_size == 5
    leanbp.unstream(model)
    with pytest.raises(TypeError, match="by name"):
        leanbp.stream(model, leanbp.StreamConfig(), 5)
    trainer = types.SimpleNamespace(model=model, args=types.SimpleNamespace(gradient_checkpointing=False))
    with pytest.warns(DeprecationWarning, match="positionally"):
        stream_trainer(trainer, 9, 4)
    assert (model._leanbp_stream.config.chunk_size, model._leanbp_stream.config.head_chunk_size) == (9, 4)
    leanbp.unstream(model)
    with pytest.warns(DeprecationWarning, match="leanbp.streaming.stream"):
        assert leanbp.engine.stream is leanbp.stream
    with pytest.warns(DeprecationWarning, match="leanbp.plan.Planner"):
        assert leanbp.memory.Planner is Planner
    with pytest.warns(DeprecationWarning, match="stream=leanbp.StreamConfig"):
        assert Planner(model.config, chunk_size=64).stream.chunk_size == 64
    with pytest.warns(DeprecationWarning, match="stream=leanbp.StreamConfig"):
        assert BenchCase(head_chunk_size=32).stream.head_chunk_size == 32
