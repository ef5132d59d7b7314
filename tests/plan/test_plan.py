"""leanbp plan: fake steps measure what real steps measure, the depth and length lines hold, the
longest T fits and the next does not, presets are the published shapes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

import leanbp
from leanbp import StreamConfig
from leanbp.cli import main
from leanbp.memory import parse_bytes
from leanbp.plan import PRESETS, Planner, load_config, training_step
from _helpers import plan_config as _config

METHODS = ("plain", "ckpt", "leanbp", "leanbp_offload")




def _quantization_statistics(model) -> int:
    """Bytes of bitsandbytes' absmax codes and their nested absmax: resident beside the packed
    weights, but in each weight's quant_state, not a parameter (the planner's stand-in holds them
    as frozen parameters)."""
    import bitsandbytes

    states = [m.weight.quant_state for m in model.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    return sum(s.absmax.nbytes + s.state2.absmax.nbytes for s in states)


def _measured(config, method, T, hold_outputs, lora_rank=None, free_grads=False, quantize="none"):
    """The step on real tensors, measured by leanbp.memory.track (gradients resident, zeroed, or
    none: ``free_grads``); ``quantize="nf4"``: the model in 4 bits (QLoRA)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    if quantize == "nf4":  # (saved and loaded again in 4 bits, as ``leanbp bench --quantize nf4`` does)
        from leanbp.bench._models import nf4_reloaded

        model = nf4_reloaded(model, "cpu").train()
    if lora_rank:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                                                           target_modules="all-linear"))
    if method == "ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if method.startswith("leanbp"):
        leanbp.stream(model, chunk_size=64, head_chunk_size=32, offload=method == "leanbp_offload")
    for p in model.parameters():
        if p.requires_grad:
            p.grad = None if free_grads else torch.zeros_like(p)
    ids = torch.randint(0, config.vocab_size, (2, T))
    with leanbp.memory.track(model) as mem:
        training_step(model, ids, hold_outputs)
    if quantize == "nf4":  # (resident, beside the parameters: see _quantization_statistics)
        statistics = _quantization_statistics(model)
        mem.report = dataclasses.replace(mem.report, params=mem.report.params + statistics,
                                         peak=mem.report.peak + statistics,
                                         phase_peaks={k: v + statistics for k, v in mem.report.phase_peaks.items()})
    return mem.report


@pytest.mark.parametrize("method, hold_outputs, lora_rank, free_grads, quantize", [
    ("plain", True, None, False, "none"), ("plain", False, None, False, "none"), ("ckpt", True, None, False, "none"),
    ("ckpt", False, None, False, "none"), ("leanbp", True, None, False, "none"),
    ("leanbp_offload", True, None, False, "none"), ("ckpt", True, 4, False, "none"), ("leanbp", True, 4, False, "none"),
    ("plain", True, None, True, "none"), ("ckpt", False, None, True, "none"), ("leanbp", True, None, True, "none"),
    ("leanbp_offload", True, None, True, "none"), ("ckpt", False, 4, True, "none"),
    ("plain", True, 4, False, "nf4"), ("ckpt", True, 4, False, "nf4"), ("leanbp", True, 4, False, "nf4")])
def test_fake_step_predicts_the_measured_bytes_exactly(method, hold_outputs, lora_rank, free_grads, quantize):
    if quantize != "none":
        pytest.importorskip("bitsandbytes")
    config = _config()
    planner = Planner(config, dtype="fp32", batch=2, stream=StreamConfig(chunk_size=64, head_chunk_size=32),
                      hold_outputs=hold_outputs, lora_rank=lora_rank, free_grads=free_grads, quantize=quantize)
    assert planner.depths == (2, 3)  # so the 4-layer numbers come from the depth line
    predicted = planner.step(method, 320)
    measured = _measured(config, method, 320, hold_outputs, lora_rank, free_grads, quantize)
    assert (predicted.peak, predicted.params, predicted.grads, predicted.host) == \
        (measured.peak, measured.params, measured.grads, measured.host)
    top = max(measured.phase_peaks, key=measured.phase_peaks.get)  # (the phase that holds the peak)
    assert (predicted.phase_peaks[top], predicted.phase_grads[top]) == \
        (measured.phase_peaks[top], measured.phase_grads[top])
    if free_grads:  # the step made its gradients: where the peak is, not all of them exist yet
        assert min(measured.phase_grads.values()) < measured.grads
    else:
        assert set(measured.phase_grads.values()) == {measured.grads}


def test_freed_gradients_lower_the_peak_and_split_it_by_what_exists(bf16_planner):
    resident = bf16_planner
    freed = Planner(resident.config, dtype=resident.dtype, stream=resident.stream, free_grads=True)
    T = 2048
    a, b = resident.peak("ckpt", T, probe=True), freed.peak("ckpt", T, probe=True)
    assert b.total < a.total and a.grads == resident.rank().grads
    # the peak holds the gradients made by then; the parts add up to that phase's peak
    step = freed.step("ckpt", T)
    assert b.grads == step.phase_grads[b.phase] < step.grads
    assert b.weights + b.grads + b.activations + b.buffers == step.phase_peaks[b.phase] == b.total
    # read from the lines beyond the probes, the same split as a fake step there
    T = max(freed.lines("ckpt").valid_from, 2048) * 4
    by_lines, probed = freed.peak("ckpt", T), freed.peak("ckpt", T, probe=True)
    assert not by_lines.probed
    assert (by_lines.total, by_lines.grads, by_lines.activations) == (probed.total, probed.grads, probed.activations)
    with pytest.raises(ValueError, match="free_grads"):
        Planner(resident.config, free_grads=True, setup=leanbp.plan.Setup(gpus=2, engine="zero3"))


@pytest.mark.parametrize("method", ["ckpt", "leanbp_offload"])
def test_the_phase_lines_predict_a_longer_fake_step(bf16_planner, method):
    planner = bf16_planner
    lines = planner.lines(method)
    T = max(planner._probes[method]) + 4 * planner.stream.chunk_size  # (beyond the last probe: extrapolated)
    assert lines.valid_from < T
    by_lines, probed = planner.peak(method, T), planner.peak(method, T, probe=True)
    assert not by_lines.probed and probed.probed
    assert (by_lines.total, by_lines.host, by_lines.phase) == (probed.total, probed.host, probed.phase)


def test_longest_sequence_fits_and_one_more_block_does_not(bf16_planner):
    planner = bf16_planner
    budget = 11 * 2**20  # (leanbp: 10 chunks of 512, 5x checkpointing; each more chunk costs its fake steps)
    for method, optimizer, step in (("ckpt", False, 256), ("leanbp", True, 512)):  # leanbp: whole chunks
        T, checked = planner.max_seq_len(method, budget, optimizer)
        assert checked and T > 0 and T % step == 0
        assert planner.peak(method, T, optimizer, probe=True).total <= budget
        assert planner.peak(method, T + step, optimizer, probe=True).total > budget
    assert planner.max_seq_len("leanbp", budget)[0] > 4 * planner.max_seq_len("ckpt", budget)[0]


def test_optimizer_state_is_two_fp32_moments_and_an_fp32_master_per_parameter(bf16_planner):
    planner = bf16_planner
    """The default optimizer (adamw) on bf16 weights: two fp32 moments, an fp32 master copy, and
    torch AdamW's 4-byte step per tensor; the optimizer's own step is a phase of the full step."""
    params = list(transformers.AutoModelForCausalLM.from_config(_config()).parameters())
    n = sum(p.numel() for p in params)
    assert planner.trainable_params() == n
    step = planner.peak("leanbp", 4096, optimizer=True)
    assert step.optimizer == 12 * n + 4 * len(params)
    assert step.total == planner.peak("leanbp", 4096).total + step.optimizer
    assert "optimizer step" in planner._shift(planner.lines("leanbp"), optimizer=True).phases


# published parameter counts of the presets' models (their model cards), in billions
# (Gemma 3 4B/12B/27B: the card's count less the SigLIP vision tower's 0.42 B, which a text preset
# leaves out: 4.30, 12.19, 27.43 on the cards)
PUBLISHED = {"qwen3-0.6b": 0.60, "qwen3-1.7b": 1.72, "qwen3-4b": 4.02, "qwen3-8b": 8.19, "qwen3-14b": 14.77,
             "qwen3-32b": 32.76, "qwen3-30b-a3b": 30.53, "llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21,
             "llama-3.1-8b": 8.03, "llama-3.1-70b": 70.55, "mistral-7b": 7.25, "qwen2.5-1.5b": 1.54,
             "qwen2.5-7b": 7.62, "qwen2.5-14b": 14.77, "qwen2.5-32b": 32.76, "qwen2.5-72b": 72.71,
             "gemma2-2b": 2.61, "gemma2-9b": 9.24, "gemma2-27b": 27.23, "gemma3-1b": 1.00, "gemma3-4b": 3.88,
             "gemma3-12b": 11.77, "gemma3-27b": 27.01}


def test_a_layer_pattern_with_a_remainder_keeps_the_depth_line():
    """Gemma 3's five sliding layers and a global one repeat four times and two layers more in its
    1B model: the depth line runs from two and three repeats, each with that remainder."""
    planner = Planner(load_config("gemma3-1b"))
    assert planner.depths == (14, 20)
    assert Planner(load_config("gemma3-12b")).depths == (12, 18)
    assert Planner(load_config("gemma2-9b")).depths == (4, 6)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_have_the_published_sizes(name):
    config = load_config(name.upper())  # names are case-insensitive
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    assert params == pytest.approx(PUBLISHED[name], rel=0.01)


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("141 GB") == 141 * 10**9
    assert parse_bytes("1.5TiB") == int(1.5 * 2**40)
    assert parse_bytes("4096") == 4096
    for bad in ("lots", "-1GiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="preset"):
        load_config("qwen9-1t")


def test_cli_plan_writes_table_csv_json_and_plot(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    _config().to_json_file(str(cfg))
    out = tmp_path / "plan"
    # (--allocator share: both modes held to one budget; in 64 MiB a replay's 20 MiB segments decide)
    code = main(["plan", "--model", str(cfg), "--memory", "64MiB", "--reserve", "0", "--dtype", "bf16", "--seq-lens", "1024,8192",
                 "--methods", "ckpt,leanbp_offload", "--chunk-size", "512", "--head-chunk-size", "1024",
                 "--allocator", "share", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "transformers checkpointing" in printed and "leanbp + offload" in printed
    result = json.loads((out / "plan.json").read_text())
    assert {p["seq_len"] for p in result["peaks"]} == {1024, 8192}
    longest = {(r["mode"], r["method"]): r["max_seq_len"] for r in result["longest"]}
    assert longest[("backprop", "leanbp_offload")] > longest[("backprop", "ckpt")] > 0
    assert longest[("step", "ckpt")] <= longest[("backprop", "ckpt")]
    assert {p["optimizer"] > 0 for p in result["peaks"] if p["mode"] == "step"} == {True}
    assert {p["optimizer"] for p in result["peaks"] if p["mode"] == "backprop"} == {0}
    for name in ("plan.md", "plan.csv", "plan.png"):
        assert (out / name).stat().st_size > 0
    assert main(["plan", "--model", str(cfg), "--memory", "1GiB", "--reserve", "2GiB", "--out", str(out)]) == 2


def test_methods_planned_side_by_side_in_processes_give_the_plan_of_one_process():
    """run_plan's pool (one process per method) returns, row for row, what one process plans."""
    from leanbp.plan import PlanRequest, run_plan

    request = PlanRequest(model="tiny", memory=64 * 2**20, reserve=0, seq_lens=[1024, 4096], methods=["plain", "ckpt"],
                          allocator="share")
    alone, side_by_side = (run_plan(request, _config(), progress=False, workers=n) for n in (1, 2))
    assert len(alone["peaks"]) == 8 and len(alone["longest"]) == 4
    assert side_by_side["longest"] == alone["longest"] and side_by_side["peaks"] == alone["peaks"]


def test_switching_from_checkpointing_takes_back_only_its_own_input_grads_hook():
    """transformers' checkpointing makes a frozen embedding's output require grad by a hook that its
    disable keeps; apply_method takes it back when the next method does not checkpoint (else a LoRA
    model measured or planned after checkpointing keeps a hidden state per layer it would not keep),
    and leaves a hook that was there before (the user's own) alone."""
    import peft

    from leanbp.streaming import apply_method

    def lora_model():
        model = transformers.AutoModelForCausalLM.from_config(_config(layers=2)).train()
        return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))

    ids = torch.randint(0, 512, (1, 64))
    fresh = apply_method(lora_model(), "plain")
    assert getattr(fresh, "_require_grads_hook", None) is None
    assert not fresh.get_input_embeddings()(ids).requires_grad
    switched = apply_method(apply_method(lora_model(), "ckpt"), "leanbp", StreamConfig(chunk_size=32))
    assert getattr(switched, "_require_grads_hook", None) is None
    assert not switched.get_input_embeddings()(ids).requires_grad
    own = lora_model()
    own.enable_input_require_grads()
    apply_method(apply_method(own, "ckpt"), "plain")
    assert own.get_input_embeddings()(ids).requires_grad


def test_a_pool_process_ends_when_the_plans_process_is_gone():
    """A process of run_plan's pool watches the plan's process: killed (it cannot end its pool), the
    pool's processes end within a second or two instead of planning on for nobody."""
    import subprocess
    import sys

    plan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    worker = subprocess.Popen([sys.executable, "-c", "import time; from leanbp.plan._report import _end_with; "
                               f"_end_with({plan.pid}); time.sleep(120)"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):  # (alive while the plan's process is)
            worker.wait(timeout=2)
        plan.kill()
        plan.wait()
        assert worker.wait(timeout=30) == 1
    finally:
        plan.kill()
        worker.kill()
    with pytest.raises(ValueError, match="workers must be"):
        leanbp.plan.run_plan(leanbp.plan.PlanRequest(), _config(), workers=0)


def test_a_fake_step_with_mask_and_position_ids_takes_no_decision_from_values():
    """Padding, packed documents and labelled rows are read from values in a real step; on fake
    tensors the engine takes the planner's assumptions instead of failing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = transformers.AutoModelForCausalLM.from_config(_config(layers=2)).train()
        leanbp.stream(model, chunk_size=64, head_chunk_size=32)
        ids = torch.zeros(2, 200, dtype=torch.long)
        out = model(input_ids=ids, attention_mask=torch.ones(2, 200, dtype=torch.long),
                    position_ids=torch.arange(200).expand(2, -1), labels=ids)
        out.loss.backward()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_the_default_reserve_is_stated_and_left_free_in_every_row(tmp_path, capsys):
    """Without --reserve a plan that holds back a share for the allocator (--allocator share) holds
    back the CUDA context, cuBLAS workspaces and 5% for the allocator's fragmentation (80 GiB: 1 +
    0.0625 + 4 GiB), says so in the report, and no row it calls fitting eats into it; a toy budget
    smaller than that reserve is a clear error."""
    from leanbp.plan import CudaReserve, PlanRequest

    assert PlanRequest(memory=80 * 2**30, allocator="share").reserve == 2**30 + 64 * 2**20 + int(0.05 * 80 * 2**30)
    cfg = tmp_path / "config.json"
    _config(layers=2).to_json_file(str(cfg))
    memory = 2 * 2**30
    reserve = CudaReserve().total(memory)
    assert main(["plan", "--model", str(cfg), "--memory", "2GiB", "--methods", "ckpt", "--mode", "backprop",
                 "--allocator", "share", "--seq-lens", "65536,131072", "--out", str(tmp_path / "plan")]) == 0
    printed = capsys.readouterr().out
    assert f"reserve {reserve / 2**30:.1f} GiB (default: CUDA context 1.00 + cuBLAS workspaces 0.06" in printed
    result = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert result["budget"] == memory - reserve
    # T = 131072 would fit the whole 2 GiB, not what the reserve leaves: the table says it does not fit
    assert [p["seq_len"] for p in result["peaks"] if result["budget"] < p["total"] <= memory] == [131072]
    assert "| 131,072* | 0.0 | 0.0 | 0.0 | 0.0 | 1.0 | 1.0 | - | no |" in printed
    (longest,) = result["longest"]
    assert 65536 < longest["max_seq_len"] < 131072
    with pytest.raises(ValueError, match="default reserve"):
        PlanRequest(memory=64 * 2**20)


def test_a_plan_needs_a_fixed_chunk_size():
    """With "auto" the chunk grows with T, which the phases' lines in T do not follow: a clear error,
    also on the command line."""
    with pytest.raises(ValueError, match="fixed chunk size"):
        Planner(_config(), stream=StreamConfig(chunk_size="auto"))
    assert main(["plan", "--model", "qwen3-0.6b", "--chunk-size", "auto"]) == 2


def test_a_4bit_plan_needs_lora_and_one_gpu_or_ddp(capsys):
    """nf4 base weights are frozen (LoRA trains on them) and kept whole on each GPU: a plan without
    LoRA, or one that shards them, is refused with what to change, also on the command line."""
    from leanbp.plan import Setup

    with pytest.raises(ValueError, match="plan them under LoRA"):
        Planner(_config(), quantize="nf4")
    with pytest.raises(ValueError, match="not fsdp2"):
        Planner(_config(), quantize="nf4", lora_rank=8, setup=Setup(gpus=2, engine="fsdp2"))
    with pytest.raises(ValueError, match="quantize must be one of"):
        Planner(_config(), quantize="int3", lora_rank=8)
    ddp = Planner(_config(), quantize="nf4", lora_rank=8, setup=Setup(gpus=2, engine="ddp"))
    with pytest.raises(ValueError, match="not zero3"):
        ddp.with_setup(Setup(gpus=2, engine="zero3"))
    assert main(["plan", "--model", "qwen3-0.6b", "--quantize", "nf4"]) == 2
    assert "--lora R" in capsys.readouterr().err


def test_4bit_weights_are_a_quarter_of_bf16_with_their_statistics():
    """The planned nf4 layers: half a byte per weight, a uint8 absmax code per 64 and an fp32 absmax
    per 256 codes; the head and the embeddings stay bf16."""
    config = _config()
    bf16, nf4 = (Planner(config, dtype="bf16", lora_rank=4, quantize=q).rank().weights for q in ("none", "nf4"))
    model = transformers.AutoModelForCausalLM.from_config(config)
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    n = [m.weight.numel() for m in linears]
    packed = sum(k // 2 + k // 64 + 4 * -(-k // (64 * 256)) for k in n)
    assert bf16 - nf4 == 2 * sum(n) - packed
