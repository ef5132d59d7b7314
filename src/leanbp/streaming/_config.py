"""``StreamConfig``: every setting of a streamed model, declared once.

``leanbp.stream``, ``stream_trainer``, ``leanbp train``, ``leanbp bench``, ``leanbp plan`` and
``leanbp verify`` all carry this object; their command-line options are built from its fields.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

from .._options import setting
from ..engine import ATTENTION_MODES, AUTO, DEFAULT_ROWS
from ..memory import parse_bytes


class StreamWarning(UserWarning):
    """A streamed model ran a step without streaming, or ignored a setting."""


def parse_chunk_size(text: str) -> int | str:
    """A number of rows, or "auto"."""
    if text == AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f'expected a number of rows or "auto", got {text!r}') from None


@dataclass(frozen=True)
class StreamConfig:
    """How a streamed model chunks its work (see each field's help)."""

    chunk_size: int | str = setting(
        DEFAULT_ROWS, parse=parse_chunk_size, metavar="ROWS|auto",
        help='rows of the sequence a decoder layer recomputes and backpropagates at once, or "auto": the largest '
             "multiple of 64 rows whose working set fits the chunk memory (default budget: one layer input, and at "
             f"least min({DEFAULT_ROWS}, T) rows)")
    head_chunk_size: int = setting(256, metavar="ROWS",
                                   help="labelled rows whose logits (rows x vocabulary) exist at once in the LM head")
    layers: bool = setting(True, help="stream the decoder layers (StreamBP); off: the model's own decoder runs "
                                      "(plain autograd or its checkpointing) and only the LM head and loss are chunked")
    eval_logits: bool = setting(True, help="a labels call without gradients in eval mode (Trainer.evaluate / predict) "
                                           "also returns the full logits, as transformers does; off: such calls are "
                                           "loss-only (no (T, V) logits, for evaluation at long T)")
    chunk_memory: int | None = setting(None, parse=parse_bytes, metavar="BYTES",
                                       help='bytes a chunk\'s working set may take with chunk size "auto" (e.g. 2GiB)')
    offload: bool = setting(False, help="keep the hidden states between decoder layers, and their gradients, in host "
                                        "memory (the same gradients, bit for bit; the device holds one layer's "
                                        "working set)")
    check: bool = setting(True, help="at stream(), run leanbp's layers and head and the model's own forward on a "
                                     "16-token probe and refuse where they differ (an adapter that does not match "
                                     "the model's modeling code); off: skip it for a model you verified")
    attention: str = setting("blocks", choices=ATTENTION_MODES,
                             help="how chunk attention applies its masks: blocks = the prefix and the chunk's own rows "
                                  "as key blocks through fused kernels, merged by their log-sum-exps (CPU and CUDA); "
                                  "mask = one SDPA call with a (batch, 1, chunk, keys) boolean mask (other devices)")

    def __post_init__(self):
        for name in ("chunk_size", "head_chunk_size", "chunk_memory"):
            value = getattr(self, name)
            if (name == "chunk_size" and value == AUTO) or (name == "chunk_memory" and value is None):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                allowed = ' or "auto"' if name == "chunk_size" else ""
                raise ValueError(f"{name} must be a positive integer{allowed}, got {value!r}")
        if self.chunk_memory is not None and self.chunk_size != AUTO:
            raise ValueError('chunk_memory is the budget of chunk_size="auto"; a fixed chunk_size ignores it')
        if self.offload and not self.layers:
            raise ValueError("offload moves the streamed layers' inputs to the host; it needs layers=True")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {self.attention!r}")


def old_chunk_sizes(owner, config: StreamConfig, chunk_size=None, head_chunk_size=None) -> StreamConfig:
    """``config`` with the chunk sizes that ``owner``'s class took as arguments of its own before its
    ``StreamConfig`` carried them (deprecated; they win over the config, as they did)."""
    given = {k: v for k, v in (("chunk_size", chunk_size), ("head_chunk_size", head_chunk_size)) if v is not None}
    if not given:
        return config
    warnings.warn(f"{type(owner).__name__}({', '.join(f'{k}=...' for k in given)}) is deprecated: pass "
                  "stream=leanbp.StreamConfig(...)", DeprecationWarning, stacklevel=4)
    return replace(config, **given)
