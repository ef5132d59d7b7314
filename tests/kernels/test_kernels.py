"""Triton kernels against their PyTorch references, on CPU tensors under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from leanbp.approx import _activations as act_ref  # noqa: E402
from leanbp.approx import _inverted as inv_ref  # noqa: E402
from leanbp.approx import _norms as norm_ref  # noqa: E402
from leanbp.kernels import _approx_act, _inverted_act, _ms_norm  # noqa: E402


@pytest.mark.parametrize("kind,consts", [("gelu", act_ref.REGELU2), ("silu", act_ref.RESILU2)])
@pytest.mark.parametrize("n", [1, 5, 1024, 2051])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_approx_activation_kernels_match_reference(kind, consts, n, dtype):
    x = (torch.randn(n) * 4).to(dtype)
    # thresholds themselves: strict > in both
    x[: min(n, 3)] = torch.tensor(consts.c[: min(n, 3)], dtype=dtype)
    y, packed = _approx_act.approx_act_forward(kind, x, act_ref.thresholds(consts, dtype))
    y_ref, packed_ref = act_ref.approx_act_forward(kind, x)
    assert torch.equal(packed, packed_ref)  # the same codes, bit for bit
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    g = torch.randn(n).to(dtype)
    # fp32: identical; bf16: both round the same fp32 product, within one bf16 rounding step
    rtol = 0 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(_approx_act.approx_act_backward(g, packed, consts),
                               act_ref.approx_act_backward(kind, g, packed_ref), rtol=rtol, atol=0)


@pytest.mark.parametrize("kind", list(inv_ref.FUNCTIONS))
@pytest.mark.parametrize("n", [5, 1031])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inverted_activation_kernels_match_reference(kind, n, dtype):
    x = (torch.randn(n) * 4).to(dtype)
    t = inv_ref.side_threshold(kind, dtype)
    x[:3] = torch.tensor([t, t, t], dtype=dtype)  # the threshold itself, and its neighbours
    x[1], x[2] = torch.nextafter(x[1], torch.tensor(-10.0, dtype=dtype)), torch.nextafter(x[2], torch.tensor(10.0, dtype=dtype))
    x[3:5] = torch.tensor([float("nan"), 40.0])  # (a NaN stays NaN; far right: f' held at 1)
    y, packed = _inverted_act.inverted_forward(kind, x, t)
    y_ref, packed_ref = inv_ref.inverted_forward(kind, x)
    assert torch.equal(packed, packed_ref)  # the same side bits, bit for bit
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol, equal_nan=True)
    g = torch.randn(n).to(dtype)
    # from the same saved output: the same series, within fp32 rounding
    got = _inverted_act.inverted_backward(g, y_ref, packed_ref, inv_ref.inverse_fit(kind))
    want = inv_ref.inverted_backward(kind, g, y_ref, packed_ref)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("center", [True, False])
@pytest.mark.parametrize("shape", [(7,), (3, 5, 33), (4, 64)])
def test_ms_norm_kernels_match_reference(center, shape):
    x = torch.randn(shape) * 3 + 1
    y, rstd = _ms_norm.ms_norm_forward(x, 1e-5, center, torch.float32)
    y_ref, rstd_ref = norm_ref.ms_norm_forward(x, 1e-5, center)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-5, atol=1e-6)
    g = torch.randn(shape)
    torch.testing.assert_close(_ms_norm.ms_norm_backward(g, y, rstd, center, torch.float32),
                               norm_ref.ms_norm_backward(g, y_ref, rstd_ref, center, torch.float32),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,consts", [("gelu", act_ref.REGELU2), ("silu", act_ref.RESILU2)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kernel_and_reference_codes_agree_bit_for_bit_at_the_thresholds(kind, consts, dtype):
    """Every value of ``dtype`` around each threshold (the nearest, the two neighbours of each side,
    the rounded-down one): the kernel (fp32 comparisons) and the reference (in x's dtype) give the
    same codes, and those of the exact comparison x > c. Before the fix the reference compared
    against c rounded to the nearest fp16/bf16 value: at a threshold that rounds up, that value
    itself got another code from the kernel."""
    values = []
    for c in consts.c:
        t = torch.tensor(c, dtype=torch.float64).to(dtype)
        for direction in (float("-inf"), float("inf")):
            v = t
            for _ in range(3):
                values.append(v)
                v = torch.nextafter(v, torch.tensor(direction, dtype=dtype))
    values += [torch.tensor(t, dtype=dtype) for t in act_ref.thresholds(consts, dtype)]
    x = torch.stack(values)
    _, packed = _approx_act.approx_act_forward(kind, x, act_ref.thresholds(consts, dtype))
    codes = act_ref.unpack_2bit(packed, x.numel())
    exact = sum((x.double() > c).to(torch.uint8) for c in consts.c)
    assert torch.equal(codes, act_ref.step_codes(x, consts))
    assert torch.equal(codes, exact)


def test_cpu_and_float64_tensors_use_the_reference_path(monkeypatch):
    """The kernels compute in fp32: a float64 tensor (an exactness check) keeps the reference even
    on CUDA (``is_cuda`` answered yes here)."""
    from leanbp.kernels import use_triton

    assert not use_triton(torch.randn(3))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    assert use_triton(torch.randn(3)) and use_triton(torch.randn(3).bfloat16())
    assert not use_triton(torch.randn(3, dtype=torch.float64))
