"""Optional kernels. Each has a pure-PyTorch reference beside it (in ``leanbp.approx``), which is
the test oracle and the fallback: Triton kernels for CUDA tensors (on CPU tensors only under
``TRITON_INTERPRET=1``, how the tests check them without a GPU), and for the approximate
activations fused CPU kernels compiled by ``torch.compile`` (``_compiled.py``). Importing this package
imports neither triton nor the compiler: the kernels load on first use."""

from ._dispatch import (approx_act_backward, approx_act_forward, compiled_inverted_backward, compiled_side_bits,
                        compiled_two_bit_backward, compiled_two_bit_codes, inverted_backward, inverted_forward,
                        ms_norm_backward, ms_norm_forward, triton_available, use_compiled, use_triton)

__all__ = ["approx_act_backward", "approx_act_forward", "compiled_inverted_backward", "compiled_side_bits",
           "compiled_two_bit_backward", "compiled_two_bit_codes", "inverted_backward", "inverted_forward",
           "ms_norm_backward", "ms_norm_forward", "triton_available", "use_compiled", "use_triton"]
