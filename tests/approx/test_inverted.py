"""Inverted Activations: the derivative from the saved output and one bit, its error against the
exact derivative, real memory sharing with the next op, and its place in ``leanbp.approx``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import leanbp
from leanbp.approx import (InvertedActivation, approx, derivative_error, inverse_fit, inverted_activation,
                           inverted_saved_bytes, unapprox)
from leanbp.approx._inverted import FUNCTIONS, pack_bits, unpack_bits
from conftest import tiny_model
from _helpers import make_batch

# the largest derivative error each function may have on fp32 inputs (measured 1.0e-4, 1.8e-4,
# 2.5e-4); the method's paper reports about 2.9e-3 for SiLU and 1.9e-2 for GELU
FP32_BOUND = {"silu": 1.5e-4, "gelu": 2.5e-4, "gelu_pytorch_tanh": 3e-4}
PAPER = {"silu": 2.9e-3, "gelu": 1.9e-2, "gelu_pytorch_tanh": 1.9e-2}


@pytest.mark.parametrize("kind", list(FUNCTIONS))
def test_the_derivative_error_is_bounded_over_the_whole_input_range(kind):
    error, _ = derivative_error(kind, torch.float32, samples=400_001)  # every 1.5e-4 of [-30, 30]
    assert error <= FP32_BOUND[kind] < PAPER[kind]
    bf16, where = derivative_error(kind, torch.bfloat16, samples=400_001)
    assert bf16 <= 2e-2 and abs(where - inverse_fit(kind).x_min) < 0.6  # (bf16 outputs: near the minimum)


@pytest.mark.parametrize("kind", list(FUNCTIONS))
def test_the_fit_knows_the_minimum_and_both_sides(kind):
    fit = inverse_fit(kind)
    x = torch.tensor([fit.x_min - 2.0, fit.x_min, fit.x_min + 2.0], dtype=torch.float64, requires_grad=True)
    FUNCTIONS[kind](x).sum().backward()
    assert abs(x.grad[1]) < 1e-9 and x.grad[0] < 0 < x.grad[2]  # f' = 0 at x*, < 0 left of it, > 0 right
    x2 = x.detach().clone().requires_grad_()
    inverted_activation(x2, kind).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=0, atol=FP32_BOUND[kind])


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001])
def test_bits_pack_eight_per_byte(n):
    bits = torch.rand(n) < 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == inverted_saved_bytes(n) == -(-n // 8)
    assert torch.equal(unpack_bits(packed, n).bool(), bits)
    # in planes: 9 elements, 2 bytes; byte 0 holds elements 0, 2, 4, 6, 8 at bits 0..4, byte 1 the odd ones
    assert pack_bits(torch.tensor([True, False, True] + [False] * 5 + [True])).tolist() == [0b10011, 0]


def test_the_reference_gives_the_same_bits_and_gradients_in_blocks(monkeypatch):
    from leanbp.approx import _inverted

    x = torch.randn(3, 17, 11) * 3  # 561 elements: blocks of 64 cut it 9 times, the last one short
    g = torch.randn_like(x)
    y, packed = _inverted.inverted_forward("gelu", x)
    whole = _inverted.inverted_backward("gelu", g, y, packed)
    monkeypatch.setattr(_inverted, "BLOCK", 64)
    y_b, packed_b = _inverted.inverted_forward("gelu", x)
    assert torch.equal(packed_b, packed) and torch.equal(y_b, y)
    assert torch.equal(_inverted.inverted_backward("gelu", g, y, packed), whole)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_forward_is_exact(dtype):
    x = torch.randn(37, 11, dtype=dtype, requires_grad=True) * 3
    torch.testing.assert_close(inverted_activation(x, "silu"), F.silu(x), rtol=0, atol=0)
    torch.testing.assert_close(InvertedActivation("gelu")(x), F.gelu(x), rtol=0, atol=0)


def _saved(fn, *inputs):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*inputs)
    return out, saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_swiglu_the_output_is_shared_with_the_product_and_one_bit_is_kept(dtype):
    """act(gate) * up: exact SiLU keeps gate, the product keeps act(gate) and up. Inverted keeps the
    product's act(gate) (one storage, two references) and 1 bit per element, never gate."""
    gate = torch.randn(4, 6, 8, dtype=dtype, requires_grad=True)
    up = torch.randn(4, 6, 8, dtype=dtype, requires_grad=True)
    out, saved = _saved(lambda g, u: inverted_activation(g, "silu") * u, gate, up)
    storages = [t.untyped_storage().data_ptr() for t in saved]
    act = [t for t in saved if t.dtype == dtype and t.data_ptr() not in (up.data_ptr(),)]
    assert len(act) == 2 and len({t.untyped_storage().data_ptr() for t in act}) == 1  # one storage, shared
    assert [t.numel() for t in saved if t.dtype == torch.uint8] == [24]  # 192 elements -> 24 bytes
    assert gate.untyped_storage().data_ptr() not in storages
    extra = sum(t.untyped_storage().nbytes() for t in saved if t.dtype == torch.uint8)
    _, exact = _saved(lambda g, u: F.silu(g) * u, gate, up)
    exact_bytes = len({t.untyped_storage().data_ptr() for t in exact}) * gate.numel() * gate.element_size()
    inverted_bytes = len({t.untyped_storage().data_ptr() for t in saved if t.dtype == dtype}) * gate.numel() * \
        gate.element_size() + extra
    assert inverted_bytes == exact_bytes - gate.numel() * gate.element_size() + extra
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=0, atol=0)


def test_gradients_of_a_model_are_close_to_exact():
    """float64 model: every parameter's gradient within a few 1e-4 of the exact backward's."""
    from leanbp.testing import plain_step

    exact = tiny_model("llama")
    model = approx(copy.deepcopy(exact), activations="inverted", norms=False)
    assert isinstance(model.model.layers[0].mlp.act_fn, InvertedActivation)
    ids, mask, labels = make_batch()
    plain_step(exact, labels, dict(input_ids=ids, attention_mask=mask))
    plain_step(model, labels, dict(input_ids=ids, attention_mask=mask))
    for (name, p), q in zip(exact.named_parameters(), model.parameters()):
        err = ((q.grad - p.grad).norm() / p.grad.norm()).item()
        assert err < 1e-3, (name, err)


def test_gemma_geglu_gets_the_tanh_form_which_2bit_cannot_take():
    model = tiny_model("gemma2")
    with pytest.raises(NotImplementedError, match="inverted"):
        approx(copy.deepcopy(model), activations=True)
    approx(model, activations="inverted", norms=False)
    assert model.model.layers[0].mlp.act_fn.kind == "gelu_pytorch_tanh"
    ids, mask, labels = make_batch(padding="none")  # (transformers' eager attention: NaN on all-padding rows)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_inverted_composes_with_stream_and_undoes():
    """A streamed + inverted model gives exactly the inverted model's plain-autograd gradients."""
    from leanbp.testing import relative_errors, streamed_vs_plain

    model = approx(tiny_model("qwen3"), activations="inverted")
    ids, mask, labels = make_batch(padding="left")
    ref, _, _ = streamed_vs_plain(model, labels, dict(input_ids=ids, attention_mask=mask),
                                  dict(chunk_size=7, head_chunk_size=5))
    assert max(relative_errors(ref, model).values()) <= 1e-12
    unapprox(model)
    assert not isinstance(model.model.layers[0].mlp.act_fn, InvertedActivation)
    assert leanbp.is_streamed(model)  # (streaming looks the modules up on every call: it goes on)


def test_variants_name_the_inverted_forms():
    from leanbp.approx import VARIANTS, variant_settings

    assert variant_settings("inverted") == {"activations": "inverted", "norms": False}
    assert variant_settings("inverted+norm") == {"activations": "inverted", "norms": True}
    assert variant_settings("both") == {"activations": "2bit", "norms": True}
    assert {"inverted", "inverted+norm"} <= set(VARIANTS)
    with pytest.raises(ValueError, match="activations must be"):
        approx(tiny_model("llama"), activations="3bit")
