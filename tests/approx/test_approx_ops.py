"""ReGELU2 / ReSiLU2 and the memory-sharing norms, op by op."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from leanbp.approx import (REGELU2, RESILU2, MSLayerNorm, MSRMSNorm, ReGELU2, ReSiLU2, pack_2bit, regelu2,
                           resilu2, saved_bytes, step_codes, swiglu2, unpack_2bit)

POINTS = [-4, -3.2, -1, -0.5, 0, 0.5, 1, 3.2, 4]


def _grad(fn, x):
    x = x.clone().requires_grad_()
    fn(x).sum().backward()
    return x.grad


def test_regelu2_derivative_levels_at_reference_points():
    got = _grad(regelu2, torch.tensor(POINTS, dtype=torch.float64))
    expected = torch.tensor([0, 0, -0.0492226, -0.0492226, 1.0487406, 1.0487406, 1.0487406, 1, 1],
                            dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-8)


def test_resilu2_derivative_levels():
    x = torch.tensor([-7.0, -6.0, -1.0, 0.0, 6.0, 7.0], dtype=torch.float64)
    expected = torch.tensor([0, -0.0406036, -0.0406036, 1.0403219, 1.0403219, 1.0], dtype=torch.float64)
    torch.testing.assert_close(_grad(resilu2, x), expected, rtol=0, atol=5e-8)


@pytest.mark.parametrize("consts", [REGELU2, RESILU2])
def test_thresholds_are_strict(consts):
    c = torch.tensor(consts.c, dtype=torch.float64)
    assert step_codes(c, consts).tolist() == [0, 1, 2]  # x == c_i does not pass threshold i
    assert step_codes(torch.nextafter(c, c + 1), consts).tolist() == [1, 2, 3]


@pytest.mark.parametrize("fn,exact", [(regelu2, F.gelu), (resilu2, F.silu)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_forward_is_exact(fn, exact, dtype):
    x = torch.randn(37, 11, dtype=dtype, requires_grad=True)
    torch.testing.assert_close(fn(x), exact(x), rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 1001])
def test_pack_unpack_round_trips_every_code(n):
    codes = (torch.arange(n) % 4).to(torch.uint8)[torch.randperm(n)]
    packed = pack_2bit(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 4) == saved_bytes(n)
    assert torch.equal(unpack_2bit(packed, n), codes)


def test_pack_layout_least_significant_first():
    codes = torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8)
    assert pack_2bit(codes).tolist() == [1 | 2 << 2 | 3 << 4 | 0 << 6, 3]


def _saved(fn, *inputs):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*inputs)
    return out, saved


@pytest.mark.parametrize("fn", [regelu2, resilu2])
def test_only_packed_codes_are_saved(fn):
    x = torch.randn(3, 5, 7, requires_grad=True)  # 105 elements -> 27 bytes
    _, saved = _saved(fn, x)
    assert [(t.dtype, t.numel()) for t in saved] == [(torch.uint8, 27)]


def test_swiglu_saves_codes_and_what_the_product_needs():
    gate, up = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    out, saved = _saved(swiglu2, gate, up)
    assert sorted((str(t.dtype), t.numel()) for t in saved) == sorted(
        [("torch.uint8", 6), ("torch.float32", 24), ("torch.float32", 24)])
    assert not any(t.data_ptr() == gate.data_ptr() for t in saved)  # gate itself is not kept
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=0, atol=0)


def test_modules_match_functions():
    x = torch.randn(10, requires_grad=True)
    torch.testing.assert_close(ReGELU2()(x), F.gelu(x), rtol=0, atol=0)
    torch.testing.assert_close(ReSiLU2()(x), F.silu(x), rtol=0, atol=0)


def _inputs(shape, transpose):
    x = torch.randn(*shape, dtype=torch.float64) * 3 + 0.7
    if transpose:  # non-contiguous input, normalized along its (strided) last dim
        x = torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=torch.float64).transpose(-1, -2) * 3 + 0.7
        assert not x.is_contiguous()
    return x


SHAPES = [((7,), False), ((5, 9), False), ((5, 9), True), ((2, 3, 16), False), ((2, 3, 16), True),
          ((2, 3, 4, 33), False), ((2, 3, 4, 33), True)]


NORMS = [(MSLayerNorm(1e-5), lambda t: F.layer_norm(t, (t.shape[-1],), eps=1e-5)),
         (MSRMSNorm(1e-6), lambda t: F.rms_norm(t, (t.shape[-1],), eps=1e-6))]


@pytest.mark.parametrize("norm,reference", NORMS, ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape,transpose", SHAPES)
def test_ms_norms_match_torch(norm, reference, shape, transpose):
    x = _inputs(shape, transpose)
    g = torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(norm(x), reference(x), rtol=1e-12, atol=1e-12)
    ref = _grad(lambda t: reference(t) * g, x)
    got = _grad(lambda t: norm(t) * g, x)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", [MSLayerNorm(), MSRMSNorm()])
def test_ms_norm_saves_its_output_and_one_fp32_rstd_per_row(norm):
    x = torch.randn(6, 10, requires_grad=True)
    y, saved = _saved(norm, x)
    assert len(saved) == 2
    assert saved[0].untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    assert saved[1].dtype == torch.float32 and saved[1].numel() == 6


def test_ms_norm_under_autocast_outputs_the_autocast_dtype():
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = MSRMSNorm()(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32
