"""The public switch: ``stream(model)`` makes a transformers causal LM run the engine's exact
StreamBP in every call that builds a graph; ``unstream`` undoes it; ``token_log_probs`` gives
per-token log-probs through the chunked head for any objective. ``StreamConfig`` declares every
setting once; ``METHODS`` names the ways a step can run that leanbp is compared with.

    _config.py      StreamConfig, StreamWarning
    _stream.py      stream / unstream: install the two forwards, per instance and reversibly
    _forwards.py    which call streams and what it returns (labels, TRL's fused head, the backbone);
                    a pipeline stage's layers and its loss
    _fused_head.py  TRL's fused-head calls answered in TRL's format (imports no TRL)
    _state.py       what a streamed model carries
    _methods.py     plain / checkpointing / leanbp (and variants), for bench and plan
    _sequence.py    a sequence-parallel model's rows, sums and gradients
"""

from ._config import StreamConfig, StreamWarning, old_chunk_sizes, parse_chunk_size
from ._forwards import stage_hidden, stage_loss, token_log_probs
from ._methods import METHODS, PLANNED, Method, apply_method, method
from ._sequence import reduce_sequence_gradients, sequence_batch, sequence_rows, sequence_sum
from ._state import StreamState, causal_lm_of, state_of
from ._stream import accept_attention_implementation, chunk_size_used, is_streamed, resolve_config, stream, unstream

__all__ = ["METHODS", "Method", "PLANNED", "StreamConfig", "StreamState", "StreamWarning", "accept_attention_implementation",
           "apply_method", "causal_lm_of", "chunk_size_used", "is_streamed", "method", "old_chunk_sizes", "parse_chunk_size",
           "reduce_sequence_gradients", "resolve_config", "sequence_batch", "sequence_rows", "sequence_sum", "stage_hidden", "stage_loss", "state_of", "stream",
           "token_log_probs", "unstream"]
