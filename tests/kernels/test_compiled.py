"""The fused CPU kernels (torch.compile) against their PyTorch references, and the fallback to the
references where compiling fails (no C++ compiler) or is switched off: both branches run here,
whatever this machine can compile."""

from __future__ import annotations

import warnings

import pytest
import torch

from leanbp.approx import inverted_activation
from leanbp.approx import _activations as act_ref
from leanbp.approx import _inverted as ref
from leanbp import kernels
from leanbp.kernels import _compiled


@pytest.mark.parametrize("kind", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_kernels_match_the_reference(kind, dtype):
    x = (torch.randn(3, 8, 41) * 4).to(dtype)  # 984 elements: 8 planes of 123
    t = ref.side_threshold(kind, dtype)
    x.view(-1)[:3] = torch.tensor([t, t, float("nan")], dtype=dtype)
    x.view(-1)[1] = torch.nextafter(x.view(-1)[1], torch.tensor(-10.0, dtype=dtype))
    y_ref, packed_ref = ref.inverted_forward(kind, x)
    packed = kernels.compiled_side_bits(x, t)
    assert packed is not None and torch.equal(packed, packed_ref)  # the same side bits, bit for bit
    g = torch.randn(x.shape).to(dtype)
    got = kernels.compiled_inverted_backward(g, y_ref, packed, ref.inverse_fit(kind))
    want = ref.inverted_backward(kind, g, y_ref, packed_ref)
    assert got.shape == want.shape == x.shape and torch.isnan(got.view(-1)[2])
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7  # (the same series; fused fp32 rounding)
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6, equal_nan=True)


def test_sizes_that_are_not_whole_planes_take_the_reference():
    x, g = torch.randn(3, 7, 41), torch.randn(3, 7, 41)  # 861 elements: not a multiple of 8
    y_ref, packed = ref.inverted_forward("silu", x)
    assert kernels.compiled_side_bits(x, 0.0) is None
    assert kernels.compiled_inverted_backward(g, y_ref, packed, ref.inverse_fit("silu")) is None
    x.requires_grad_()
    y = inverted_activation(x, "silu")
    y.backward(g)
    torch.testing.assert_close(y, torch.nn.functional.silu(x), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, ref.inverted_backward("silu", g, y_ref, packed), rtol=0, atol=0)


@pytest.mark.parametrize("kind,consts", [("gelu", act_ref.REGELU2), ("silu", act_ref.RESILU2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_two_bit_kernels_match_the_reference(kind, consts, dtype):
    x = (torch.randn(5, 203) * 5).to(dtype)  # 1015 elements: the last byte part full
    x.view(-1)[:3] = torch.tensor(act_ref.thresholds(consts, dtype), dtype=dtype)  # (strict >)
    packed = _compiled.run(_compiled.two_bit_codes, x, *act_ref.thresholds(consts, dtype))
    _, packed_ref = act_ref.approx_act_forward(kind, x)
    assert packed is not None and torch.equal(packed, packed_ref)
    g = torch.randn(x.shape).to(dtype)
    got = _compiled.run(_compiled.two_bit_backward, g, packed, *consts.levels[1:])
    torch.testing.assert_close(got, act_ref.approx_act_backward(kind, g, packed_ref), rtol=0, atol=0)


def test_the_activation_takes_the_fused_path_on_cpu_and_matches_the_reference(monkeypatch):
    x = (torch.randn(5, 64) * 3).requires_grad_()
    calls = []
    real = _compiled.run
    monkeypatch.setattr(_compiled, "run", lambda fn, *a: calls.append(fn.__name__) or real(fn, *a))
    y = inverted_activation(x, "silu")
    y.backward(torch.ones_like(y))
    assert calls == ["side_bits", "inverted_backward"]
    torch.testing.assert_close(y, torch.nn.functional.silu(x), rtol=0, atol=0)  # forward: PyTorch's own
    y_ref, packed = ref.inverted_forward("silu", x.detach())
    torch.testing.assert_close(x.grad, ref.inverted_backward("silu", torch.ones_like(y_ref), y_ref, packed),
                               rtol=1e-5, atol=1e-6)


def test_a_compiler_that_fails_falls_back_to_the_reference_with_one_warning(monkeypatch):
    def broken(fn):
        def call(*args):
            raise RuntimeError("no C++ compiler found")
        return call

    monkeypatch.setattr(_compiled, "_compiled", broken)
    monkeypatch.setattr(_compiled, "_failed", [])
    x = (torch.randn(4, 16) * 3).requires_grad_()
    with pytest.warns(UserWarning, match="no C.. compiler found.*PyTorch reference"):
        y = inverted_activation(x, "silu")
    assert not _compiled.use_compiled(x)  # (once failed, never tried again in this process)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning only
        y.backward(torch.ones_like(y))
    y_ref, packed = ref.inverted_forward("silu", x.detach())
    torch.testing.assert_close(x.grad, ref.inverted_backward("silu", torch.ones_like(y_ref), y_ref, packed),
                               rtol=0, atol=0)  # the reference itself


def test_switched_off_float64_and_cuda_take_other_paths(monkeypatch):
    assert _compiled.use_compiled(torch.zeros(2))
    assert not _compiled.use_compiled(torch.zeros(2, dtype=torch.float64))  # (exactness checks: the reference)
    assert not _compiled.use_compiled(torch.zeros(2, device="meta"))
    from leanbp.memory import track

    with track(torch.nn.Linear(1, 1)):  # (a dispatch mode watching: compiled code would run op by op)
        assert not _compiled.use_compiled(torch.zeros(2))
    monkeypatch.setattr(_compiled, "_switched_off", lambda: True)  # LEANBP_COMPILE=0
    assert not _compiled.use_compiled(torch.zeros(2))
