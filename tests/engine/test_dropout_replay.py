"""Dropout inside streamed layers trains exactly: the backward replays the forward's draws.

Each chunk's recompute starts from the generators' states its forward had, so the streamed gradient
is the derivative of the very loss the step computed. Checked as a derivative (a central finite
difference of that loss under the same seed, float64), and against plain autograd where the streamed
forward draws in plain autograd's order (one chunk).
"""

from __future__ import annotations

import pytest
import torch

import leanbp
from _helpers import make_batch, slope_error
from leanbp.testing import full_precision_norms, reference_causal_lm_loss
from conftest import tiny_model

peft = pytest.importorskip("peft")

SEED = 1234
LORA = dict(r=4, lora_dropout=0.1, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"])


def _lora(model):
    model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    with torch.no_grad():  # lora_B starts at zero: make the adapters (and their dropout) matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model.train()


def _loss(model, batch, plain: bool):
    """The step's loss under the test's seed; plain autograd's through transformers' loss without its
    float32 cast (the streamed head keeps float64 in float64)."""
    torch.manual_seed(SEED)
    if plain:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return reference_causal_lm_loss(model, batch["labels"], **inputs)
    return model(**batch).loss


def _slope_error(model, batch, plain: bool = False) -> float:
    """``slope_error`` of the step's loss under one seed throughout (norms in float64: transformers'
    float32 norms would leave the difference float32's noise)."""
    with full_precision_norms(model):
        return slope_error(lambda: _loss(model, batch, plain), [p for p in model.parameters() if p.requires_grad])


def _batch():
    ids, mask, labels = make_batch(B=2, T=61)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


@pytest.mark.parametrize("order", ["peft_then_stream", "stream_then_peft"])
def test_lora_dropout_gradient_is_the_derivative_of_the_steps_loss(order):
    batch = _batch()
    plain = _lora(tiny_model("qwen3"))
    plain_error = _slope_error(plain, batch, plain=True)
    if order == "peft_then_stream":
        model = _lora(tiny_model("qwen3"))
        leanbp.stream(model.base_model.model, chunk_size=13)
    else:
        base = tiny_model("qwen3")
        leanbp.stream(base, chunk_size=13)
        model = _lora(base)
    error = _slope_error(model, batch)
    assert plain_error < 1e-6  # (the check itself: plain autograd's own agreement)
    assert error <= 1e-6, (error, plain_error)


def test_phi3_residual_dropout_gradient_is_the_derivative_of_the_steps_loss():
    batch = _batch()
    model = tiny_model("phi3", resid_pdrop=0.1)
    leanbp.stream(model, chunk_size=13)
    assert _slope_error(model, batch) <= 1e-6


@pytest.mark.parametrize("family,setting", [("qwen3", None), ("phi3", dict(resid_pdrop=0.1))])
def test_one_chunk_draws_what_plain_autograd_draws_and_gives_its_gradients(family, setting):
    """With one chunk the streamed forward calls the same modules in the same order on the same
    rows as plain autograd, so the draws, the loss and every gradient are plain autograd's; the
    backward leaves the generator where the forward left it (plain autograd's backward draws nothing)."""
    batch = _batch()

    def build():
        model = tiny_model(family, **(setting or {}))
        return _lora(model) if setting is None else model

    plain, streamed = build(), build()
    leanbp.stream(streamed.base_model.model if setting is None else streamed, chunk_size=64, head_chunk_size=64)
    states = []
    for model in (plain, streamed):
        with full_precision_norms(model):
            loss = _loss(model, batch, plain=model is plain)
            after_forward = torch.get_rng_state()
            loss.backward()
        assert torch.equal(torch.get_rng_state(), after_forward)
        states.append((loss.item(), after_forward))
    assert states[0][0] == pytest.approx(states[1][0], rel=1e-12)
    assert torch.equal(states[0][1], states[1][1])
    grads = {n: p.grad for n, p in streamed.named_parameters() if p.grad is not None}
    assert grads
    for name, p in plain.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_a_layer_without_draws_keeps_no_states():
    """Without dropout nothing is replayed (and nothing kept): the states are dropped after forward."""
    from leanbp.engine._rng import ChunkDraws

    draws = ChunkDraws(torch.device("cpu"))
    draws.mark()
    torch.ones(3) * 2  # (no draw)
    assert not draws.drew() and draws.before == []
    draws.mark()
    torch.rand(3)
    assert draws.drew() and len(draws.before) == 1
