"""Optional Triton kernels. Each has a pure-PyTorch reference beside it (in ``leanbp.approx``),
which is the CPU path and the test oracle; the kernels run on CUDA tensors, and on CPU tensors
only under ``TRITON_INTERPRET=1`` (how the tests check them without a GPU). Importing this package
does not import triton: the kernels load on first use."""

from ._dispatch import (approx_act_backward, approx_act_forward, inverted_backward, inverted_forward, ms_norm_backward,
                        ms_norm_forward, triton_available, use_triton)

__all__ = ["approx_act_backward", "approx_act_forward", "inverted_backward", "inverted_forward", "ms_norm_backward",
           "ms_norm_forward", "triton_available", "use_triton"]
