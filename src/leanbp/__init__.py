"""leanbp: exact sequence-streamed backpropagation (StreamBP) for long-sequence LM training,
plus opt-in Approx-BP (2-bit activations) and MS-BP (memory-sharing norms)."""

from . import memory
from .approx import approx, is_approximated, unapprox
from .streaming import StreamConfig, StreamWarning, chunk_size_used, is_streamed, stream, token_log_probs, unstream

__version__ = "0.1.0"

__all__ = ["StreamConfig", "StreamWarning", "approx", "chunk_size_used", "is_approximated", "is_streamed", "memory",
           "stream", "token_log_probs", "unapprox", "unstream", "__version__"]
