"""leanbp: exact sequence-streamed backpropagation (StreamBP) for long-sequence LM training."""

from .engine import StreamConfig, is_streamed, stream, unstream

__version__ = "0.1.0"

__all__ = ["StreamConfig", "is_streamed", "stream", "unstream", "__version__"]
