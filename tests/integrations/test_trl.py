"""TRL's trainers with leanbp: SFT (padded, completion-only, packed), DPO (reference model, PEFT's
disabled adapter) and GRPO (beta = 0, beta > 0), each run for two optimizer steps in float64 with
and without leanbp. Every gradient (at both steps) and every parameter after step 2 must agree to
1e-12; the streamed run must really stream (layer calls counted) and serve TRL's fused head with
leanbp's chunked head."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import leanbp  # noqa: E402
from leanbp.train import byte_tokenizer  # noqa: E402
from leanbp.testing import exact_trl_head, full_precision_norms  # noqa: E402
from leanbp.engine import ChunkedTokenStatsFunction  # noqa: E402
from leanbp.engine import StreamedLayerFunction  # noqa: E402
from leanbp.integrations.trl import stream_trainer  # noqa: E402

TOL = 1e-12
CHUNKS = dict(chunk_size=7, head_chunk_size=5)  # neither divides the sequence lengths


def tiny_model(seed=0):
    config = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, attn_implementation="sdpa",
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=4, bos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    with torch.no_grad():  # non-trivial norm weights, so that a wrong norm gradient shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model


def tiny_moe_model(seed=0):
    """Qwen3-MoE (4 experts, top 2, the second layer dense) with the load-balancing loss on."""
    from leanbp.testing import randomize_for_checks
    from leanbp.models import tiny_config

    config = tiny_config("qwen3_moe", vocab_size=256, max_position_embeddings=512, pad_token_id=0, eos_token_id=4,
                         bos_token_id=None)
    torch.manual_seed(seed)
    return randomize_for_checks(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64))


def _exact_load_balancing_loss(gate_logits, num_experts, top_k, attention_mask=None):
    """transformers' load_balancing_loss_func (which TRL's fused head calls) in float64: it sums in
    float32, ~1e-7, which a float64 comparison would measure instead of leanbp."""
    from types import SimpleNamespace

    from leanbp.testing import reference_load_balancing_loss

    return reference_load_balancing_loss(gate_logits, SimpleNamespace(num_experts=num_experts, top_k=top_k),
                                         attention_mask)


def _lora_config():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)


class _Grads(transformers.TrainerCallback):
    """Every trainable gradient just before each optimizer step."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


class _Counter:
    def __init__(self, monkeypatch):
        self.layers = self.heads = 0
        layer_apply, head_apply = StreamedLayerFunction.apply, ChunkedTokenStatsFunction.apply

        def layer(*a):
            self.layers += torch.is_grad_enabled()  # (not stream()'s probe)
            return layer_apply(*a)

        def head(*a):
            self.heads += 1
            return head_apply(*a)

        monkeypatch.setattr(StreamedLayerFunction, "apply", layer)
        monkeypatch.setattr(ChunkedTokenStatsFunction, "apply", head)


def _train(trainer_cls, config_cls, dataset, tmp_path, leanbp_order=None, ref=False, peft=False, reward_funcs=None,
           build=tiny_model, sequence_parallel=None, **config):
    """Two optimizer steps; returns (gradients per step, final parameters). ``sequence_parallel``
    (with ``leanbp_order="after"``): as ``stream_trainer`` takes it."""
    model = build()
    if config.get("beta", 0) > 0 and not peft:
        # GRPOTrainer loads its reference model from the policy's config._name_or_path; under
        # torch.distributed only rank 0 writes, into the folder every rank is given, then all read
        folder = tmp_path.parent / "init" if sequence_parallel else tmp_path / "init"
        if not sequence_parallel or torch.distributed.get_rank() == 0:
            model.save_pretrained(folder)
        if sequence_parallel:
            torch.distributed.barrier()
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    if leanbp_order == "before":
        leanbp.stream(model, **CHUNKS)
    extra = {"reward_funcs": reward_funcs} if reward_funcs is not None else {}
    if ref:
        extra["ref_model"] = tiny_model(seed=1)
    if peft:
        extra["peft_config"] = _lora_config()
    grads = _Grads()
    args = config_cls(output_dir=str(tmp_path), max_steps=2, learning_rate=1e-2, report_to=[], use_cpu=True,
                      bf16=False, fp16=False, save_strategy="no", seed=0, logging_steps=1, disable_tqdm=True,
                      dataloader_num_workers=0, **config)
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=byte_tokenizer(),
                          callbacks=[grads], **extra)
    if leanbp_order == "after":
        stream_trainer(trainer, sequence_parallel=sequence_parallel, **CHUNKS)
    models = [m for m in (trainer.model, getattr(trainer, "ref_model", None)) if m is not None]
    with full_precision_norms(*models), exact_trl_head():
        trainer.train()
    assert len(grads.steps) == 2
    return grads.steps, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _assert_same(reference, streamed):
    (ref_grads, ref_params), (grads, params) = reference, streamed
    for step, (expected, got) in enumerate(zip(ref_grads, grads)):
        assert expected and set(expected) == set(got), f"step {step}: different parameters got gradients"
        assert any(g.abs().max() > 0 for g in expected.values()), f"step {step}: all gradients are zero"
        for name, g in expected.items():
            err = ((got[name] - g).norm() / g.norm().clamp(min=1e-300)).item()
            assert err <= TOL, f"step {step} {name}: relative gradient error {err:.3e}"
    for name, p in ref_params.items():
        err = ((params[name] - p).norm() / p.norm()).item()
        assert err <= TOL, f"{name} after step 2: relative parameter error {err:.3e}"


def _compare(monkeypatch, tmp_path, trainer_cls, config_cls, dataset, order="after", **kwargs):
    reference = _train(trainer_cls, config_cls, dataset, tmp_path / "ref", **kwargs)
    counter = _Counter(monkeypatch)
    streamed = _train(trainer_cls, config_cls, dataset, tmp_path / "leanbp", leanbp_order=order, **kwargs)
    _assert_same(reference, streamed)
    assert counter.layers >= 2 * 2  # 2 layers x 2 training steps at least
    return counter


# -- data: shipped with the test, different lengths so that batches are padded -------------------

def _text_data():
    return datasets.Dataset.from_list([{"text": f"line {i}: " + "abcdefgh"[: i % 8 + 1] * (i % 3 + 1)}
                                       for i in range(12)])


def _completion_data():
    return datasets.Dataset.from_list([{"prompt": f"Q{i}: what is {i}+{i}? " * (i % 2 + 1),
                                        "completion": f"A: {2 * i}." * (i % 3 + 1)} for i in range(12)])


def _preference_data():
    return datasets.Dataset.from_list([{"prompt": f"say {i}: " * (i % 3 + 1), "chosen": f"{i} is {i}." * (i % 2 + 1),
                                        "rejected": f"no {i}" * (i % 3 + 1)} for i in range(8)])


def _prompt_data():
    return datasets.Dataset.from_list([{"prompt": f"count to {i}: " * (i % 2 + 1)} for i in range(8)])


def _digit_reward(completions, **kwargs):
    """Rule-based: digits are good, length costs a little (varied rewards for random models)."""
    return [sum(ch.isdigit() for ch in c) - 0.01 * sum(map(ord, c)) / max(1, len(c)) for c in completions]


# -- SFT -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("data", ["padded", "completion_only"])
def test_sft_matches_trl_without_leanbp(monkeypatch, tmp_path, data):
    dataset = _text_data() if data == "padded" else _completion_data()
    counter = _compare(monkeypatch, tmp_path, trl.SFTTrainer, trl.SFTConfig, dataset, per_device_train_batch_size=3)
    assert counter.heads == 2  # leanbp's chunked head answered TRL's fused-head calls


def test_sft_packed_padding_free_matches_trl(monkeypatch, tmp_path):
    """packing=True (best-fit decreasing): padding-free rows of several documents, position_ids
    restarting at each document; each document attends only to itself."""
    _compare(monkeypatch, tmp_path, trl.SFTTrainer, trl.SFTConfig, _completion_data(), per_device_train_batch_size=4,
             packing=True, max_length=64)


def test_sft_moe_with_load_balancing_loss_matches_trl(monkeypatch, tmp_path):
    """A mixture-of-experts model with output_router_logits: TRL's fused head adds the load-balancing
    loss; leanbp's answers the same call with it (from router statistics gathered while streaming)."""
    import transformers.models.mixtral.modeling_mixtral as mixtral

    monkeypatch.setattr(mixtral, "load_balancing_loss_func", _exact_load_balancing_loss)
    counter = _compare(monkeypatch, tmp_path, trl.SFTTrainer, trl.SFTConfig, _completion_data(),
                       build=tiny_moe_model, per_device_train_batch_size=3)
    assert counter.heads == 2


@pytest.mark.parametrize("order", ["before", "after"])
def test_sft_lora_in_both_orders(monkeypatch, tmp_path, order):
    """peft_config makes the trainer wrap the model: streamed before (TRL's head on leanbp's
    decoder, with a warning) or after (leanbp's head too)."""
    if order == "before":
        with pytest.warns(leanbp.StreamWarning, match="TRL's fused LM head was added after"):
            counter = _compare(monkeypatch, tmp_path, trl.SFTTrainer, trl.SFTConfig, _completion_data(), order=order,
                               peft=True, per_device_train_batch_size=3)
        assert counter.heads == 0
    else:
        counter = _compare(monkeypatch, tmp_path, trl.SFTTrainer, trl.SFTConfig, _completion_data(), order=order,
                           peft=True, per_device_train_batch_size=3)
        assert counter.heads == 2


@pytest.mark.parametrize("order", ["before", "after"])
def test_sft_lora_dropout_gradient_is_the_derivative_of_the_steps_loss(tmp_path, order):
    """TRL's SFT with a ``peft_config`` whose LoRA dropout is on: the streamed gradient of the
    trainer's own loss is that loss's derivative under the step's seed (the backward replays the
    forward's dropout masks; without the replay the two differ by ~1)."""
    from _helpers import slope_error

    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, init_lora_weights=False,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, report_to=[], use_cpu=True,
                         bf16=False, fp16=False, save_strategy="no", seed=0, disable_tqdm=True,
                         dataloader_num_workers=0)
    model = tiny_model()
    if order == "before":
        leanbp.stream(model, **CHUNKS)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=_completion_data(),
                             processing_class=byte_tokenizer(), peft_config=lora)
    if order == "after":
        stream_trainer(trainer, **CHUNKS)
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model.train()
    assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.1 for m in model.modules())

    def loss():
        torch.manual_seed(1234)
        return trainer.compute_loss(model, batch)

    with full_precision_norms(model), exact_trl_head():
        error = slope_error(loss, [p for p in model.parameters() if p.requires_grad])
    assert error <= 1e-6


# -- DPO -------------------------------------------------------------------------------------------

def test_dpo_with_reference_model_matches_trl(monkeypatch, tmp_path):
    counter = _compare(monkeypatch, tmp_path, trl.DPOTrainer, trl.DPOConfig, _preference_data(), ref=True,
                       per_device_train_batch_size=2)
    assert counter.heads == 4  # policy and reference, two steps


def test_dpo_with_peft_disabled_adapter_reference_matches_trl(monkeypatch, tmp_path):
    _compare(monkeypatch, tmp_path, trl.DPOTrainer, trl.DPOConfig, _preference_data(), peft=True,
             per_device_train_batch_size=2)


# -- GRPO ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("beta,peft", [(0.0, False), (0.05, False), (0.05, True)])
def test_grpo_matches_trl(monkeypatch, tmp_path, beta, peft):
    """Generation stays plain ``generate``; the loss step streams. beta > 0: the reference log-probs
    come from a reference model that the trainer loads (streamed too), or with PEFT from the
    disabled adapter."""
    counter = _compare(monkeypatch, tmp_path, trl.GRPOTrainer, trl.GRPOConfig, _prompt_data(), peft=peft,
                       reward_funcs=_digit_reward, per_device_train_batch_size=4, num_generations=4,
                       max_completion_length=6, beta=beta, temperature=0.9)
    assert counter.heads > 0


def test_streaming_does_not_change_generation():
    model = tiny_model().eval()
    ids = torch.tensor([[100, 101, 102, 103]])
    expected = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    leanbp.stream(copy.deepcopy(model))
    leanbp.stream(model)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0), expected)
