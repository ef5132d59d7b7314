"""The exact chunked backward: streamed decoder layers and the chunked LM head + loss."""

from ._stream import StreamConfig, is_streamed, stream, unstream

__all__ = ["StreamConfig", "is_streamed", "stream", "unstream"]
