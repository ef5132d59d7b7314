"""The exact chunked backward: streamed decoder layers and the chunked LM head + loss."""

from ._stream import StreamConfig, StreamWarning, chunk_size_used, is_streamed, stream, token_log_probs, unstream

__all__ = ["StreamConfig", "StreamWarning", "chunk_size_used", "is_streamed", "stream", "token_log_probs", "unstream"]
