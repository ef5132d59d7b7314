"""The algorithm: exact StreamBP for decoder layers, the chunked final norm and the chunked LM head.

What it needs from a model family is the ``DecoderFamily`` protocol (``_adapter.py``), which
``leanbp.models`` implements; the public switch that installs it on a model is ``leanbp.streaming``.

    _decoder.py      the streamed decoder: embeddings, then each layer as one autograd Function
    _layer.py        one decoder layer that keeps only its input (forward and chunked backward)
    _masks.py        which keys each row of a chunk sees (causal, window, padding, documents)
    _attention.py    chunk attention from fused (out, lse) kernels (``_attention_backends.py``),
                     soft-capped attention block by block (``_softcap_attention.py``)
    _head.py         final norm + LM head + loss (or per-token log-probs) over labelled rows, chunked
    _chunking.py     chunk_size="auto"
    _offload.py      the layer boundaries and their gradients in host memory
    _moe.py          the exact load-balancing loss of mixture-of-experts layers
    _grads.py        gradients summed over chunks, handed over once
    _split.py        a backward split into input and weight passes (pipeline schedules, 2BP)
    _ulysses.py      sequence parallelism: Ulysses' head exchange around the chunk attention
    _module_call.py  a block of chunks run as the body of one call of its module (engine hooks)
    _value_reads.py  the few decisions taken from tensor values (and a planned step's assumptions)
"""

from ._adapter import DecoderFamily, LayerChunk, RotaryRows, Router
from ._attention import chunk_attention, forced_backend, uses_two_block_attention
from ._attention_backends import CPU_FLASH, CUDA_KERNELS, MATH, CudaKernels, backend_for
from ._chunking import AUTO, DEFAULT_ROWS, pick_chunk_rows, row_bytes
from ._decoder import DecoderOutput, check_attention_mask, decoder_layers, rowwise, trainable
from ._grads import AutocastState
from ._layer import LayerCall, StreamedLayerFunction
from ._head import (IGNORE_INDEX, STATS, ChunkedCrossEntropyFunction, ChunkedTokenStatsFunction, HeadCall,
                    LogitTransform, cross_entropy, shift_labels, token_stats)
from ._masks import ATTENTION_MODES, ChunkMasks, Documents, KeyKeep, PrefixGradSink, key_start
from ._module_call import is_routed, unroute
from ._softcap_attention import BLOCK_ROWS as SOFTCAP_BLOCK_ROWS
from ._split import PASSES, backward_pass, current_pass
from ._ulysses import SequenceGroup, deepspeed_sequence_group, gather_over_group, reduce_gradients, shift_labels_across, sum_over_group
from ._value_reads import has_values

__all__ = [
    "ATTENTION_MODES", "AUTO", "AutocastState", "CPU_FLASH", "CUDA_KERNELS", "ChunkMasks",
    "ChunkedCrossEntropyFunction", "ChunkedTokenStatsFunction", "CudaKernels", "DEFAULT_ROWS", "DecoderFamily",
    "DecoderOutput", "Documents", "HeadCall", "IGNORE_INDEX", "KeyKeep", "LayerCall", "LayerChunk", "LogitTransform",
    "MATH", "PASSES", "PrefixGradSink", "RotaryRows", "Router", "SOFTCAP_BLOCK_ROWS", "STATS", "SequenceGroup", "deepspeed_sequence_group",
    "StreamedLayerFunction",
    "backend_for", "backward_pass", "check_attention_mask", "chunk_attention", "cross_entropy", "current_pass", "decoder_layers", "forced_backend",
    "gather_over_group", "has_values", "is_routed", "key_start", "pick_chunk_rows", "reduce_gradients", "row_bytes", "rowwise", "shift_labels",
    "shift_labels_across", "sum_over_group", "token_stats", "trainable", "unroute", "uses_two_block_attention",
]
