"""DPZero on real model families and under LoRA: a noise-free step descends (the loss falls by
about lr d^2, its first-order prediction), a streamed model takes the same step as the plain one,
and only trainable parameters move."""

from __future__ import annotations

import pytest
import torch
import transformers

import leanbp
from leanbp.engine import IGNORE_INDEX
from leanbp.models import tiny_config
from leanbp.zo import DPZero, DPZeroConfig, SeededRandom, example_losses


def _model(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)


def _batch(vocab: int, B: int = 4, T: int = 29):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    labels = ids.clone()
    labels[:, :9] = IGNORE_INDEX
    labels[mask == 0] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_noise_free_step_descends_and_a_streamed_model_takes_the_same_step(family):
    """Without clip and noise the update is -lr d z with d = g . z (the batch mean): the loss falls
    by lr d^2 to first order. A streamed model (chunked decoder and head, no full logits) computes
    the same per-example losses (fp32 tolerance) and so the same update."""
    plain, streamed = _model(family), _model(family)
    leanbp.stream(streamed, chunk_size=9, head_chunk_size=11)
    batch = _batch(plain.config.vocab_size)
    torch.testing.assert_close(example_losses(streamed, **batch), example_losses(plain, **batch), rtol=2e-6, atol=0)
    config = DPZeroConfig(mu=1e-3, clip=float("inf"), expected_batch_size=4)
    lr = 3e-5  # (small enough that the second-order term is ~1% of the first)
    before = example_losses(plain, **batch).mean().item()
    results = [DPZero(m, config).step(lambda m=m: example_losses(m, **batch), lr=lr, step=5)
               for m in (plain, streamed)]
    after = example_losses(plain, **batch).mean().item()
    d = results[0].scalar  # (= mean d_i)
    assert after < before
    assert (before - after) == pytest.approx(lr * d * d, rel=0.04)
    assert results[1].scalar == pytest.approx(d, rel=1e-3)
    for (name, p), q in zip(plain.named_parameters(), streamed.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    assert plain.training and streamed.training  # (the forwards ran in eval mode and put the mode back)


def test_only_the_trainable_parameters_move_under_lora():
    peft = pytest.importorskip("peft")
    base = _model("qwen3")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    leanbp.stream(model, chunk_size=9)
    batch = _batch(base.config.vocab_size)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = DPZeroConfig(mu=1e-3, clip=1.0, noise_multiplier=0.8, expected_batch_size=4)
    optimizer = DPZero(model, config, SeededRandom(0))
    assert len(optimizer.params) == sum(p.requires_grad for p in model.parameters()) > 0
    for step in range(2):
        optimizer.step(lambda: example_losses(model, **batch), lr=1e-2, step=step)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert moved == trainable  # every adapter moved (lora_B starts at 0, and moves), nothing frozen did
