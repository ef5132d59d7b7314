"""When to run a Triton kernel instead of the PyTorch reference, and the kernels' entry points
(imported on first use: triton is optional)."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _switched_off() -> bool:
    """``LEANBP_TRITON=0``: the PyTorch references everywhere (read once per process)."""
    return os.environ.get("LEANBP_TRITON", "1") == "0"


def use_triton(x: torch.Tensor) -> bool:
    """CUDA tensors with triton installed (unless ``LEANBP_TRITON=0``), except float64: the kernels
    compute in fp32, so float64 (exactness checks) keeps the reference."""
    return x.is_cuda and x.dtype != torch.float64 and triton_available() and not _switched_off()


def approx_act_forward(kind: str, x: torch.Tensor, thresholds):
    """ReGELU2 / ReSiLU2 forward and packed 2-bit codes (``_approx_act.py``)."""
    from ._approx_act import approx_act_forward as kernel

    return kernel(kind, x, thresholds)


def approx_act_backward(grad_out: torch.Tensor, packed: torch.Tensor, consts):
    from ._approx_act import approx_act_backward as kernel

    return kernel(grad_out, packed, consts)


def inverted_forward(kind: str, x: torch.Tensor, x_min: float):
    """Inverted activation forward and packed side bits (``_inverted_act.py``)."""
    from ._inverted_act import inverted_forward as kernel

    return kernel(kind, x, x_min)


def inverted_backward(grad_out: torch.Tensor, y: torch.Tensor, packed: torch.Tensor, fit):
    from ._inverted_act import inverted_backward as kernel

    return kernel(grad_out, y, packed, fit)


def use_compiled(x: torch.Tensor) -> bool:
    """Run the fused CPU kernel (``_compiled.py``): CPU tensors other than float64, unless
    ``LEANBP_COMPILE=0`` or compiling failed here before."""
    from ._compiled import use_compiled as decide

    return decide(x)


def compiled_side_bits(x: torch.Tensor, threshold: float):
    """The packed side bits of an inverted activation from the fused CPU kernel, or None where it
    cannot be compiled or N is not a multiple of 8 (the caller runs the reference: the kernel sees
    the 8 bit planes as one (8, N/8) view)."""
    from ._compiled import run, side_bits

    return run(side_bits, x, threshold) if x.numel() % 8 == 0 else None


def compiled_inverted_backward(grad_out: torch.Tensor, y: torch.Tensor, packed: torch.Tensor, fit):
    """``fit``: the reference's ``InverseFit``; None as for ``compiled_side_bits``."""
    from ._compiled import inverted_backward, run

    if y.numel() % 8:
        return None
    right, left = fit.on(y.device, torch.float32)
    dx = run(inverted_backward, grad_out, y, packed, right, left, fit.y_min, fit.u_right, fit.u_left)
    return None if dx is None else dx.view(grad_out.shape)


def compiled_two_bit_codes(x: torch.Tensor, thresholds):
    """ReSiLU2/ReGELU2's packed codes from the fused CPU kernel, or None (the caller runs the reference)."""
    from ._compiled import run, two_bit_codes

    return run(two_bit_codes, x, *thresholds)


def compiled_two_bit_backward(grad_out: torch.Tensor, packed: torch.Tensor, consts):
    from ._compiled import run, two_bit_backward

    return run(two_bit_backward, grad_out, packed, *consts.levels[1:])


def ms_norm_forward(x: torch.Tensor, eps: float, center: bool, out_dtype: torch.dtype):
    """MS-LayerNorm / MS-RMSNorm forward (``_ms_norm.py``)."""
    from ._ms_norm import ms_norm_forward as kernel

    return kernel(x, eps, center, out_dtype)


def ms_norm_backward(grad_y: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, center: bool,
                     input_dtype: torch.dtype):
    from ._ms_norm import ms_norm_backward as kernel

    return kernel(grad_y, y, rstd, center, input_dtype)
