"""Optional Triton kernels. Each has a pure-PyTorch reference beside it (in ``leanbp.approx``),
which is the CPU path and the test oracle; the kernels run on CUDA tensors, and on CPU tensors
only under ``TRITON_INTERPRET=1`` (how the tests check them without a GPU)."""

from ._dispatch import triton_available, use_triton

__all__ = ["triton_available", "use_triton"]
