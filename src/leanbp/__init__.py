"""leanbp: exact sequence-streamed backpropagation (StreamBP) for long-sequence LM training,
plus opt-in Approx-BP (2-bit activations) and MS-BP (memory-sharing norms)."""

import warnings

from . import engine, memory, plan, streaming
from .approx import approx, is_approximated, unapprox
from .streaming import (StreamConfig, StreamWarning, chunk_size_used, is_streamed, reduce_sequence_gradients,
                        sequence_batch, sequence_rows, sequence_sum, stream, token_log_probs, unstream)

__version__ = "0.1.0"

__all__ = ["StreamConfig", "StreamWarning", "approx", "chunk_size_used", "is_approximated", "is_streamed", "memory",
           "reduce_sequence_gradients", "sequence_batch", "sequence_rows", "sequence_sum", "stream", "token_log_probs",
           "unapprox", "unstream", "__version__"]


def _moved(old_home, names: tuple[str, ...], new_home) -> None:
    """Deprecated names of the package ``old_home`` that now live in ``new_home``: reading one warns
    and gives the new one. Installed here, at the face that stands above both, so that no package
    imports one on a floor above it for the sake of an old name."""
    old, new = old_home.__name__, new_home.__name__

    def __getattr__(name: str):
        if name in names:
            warnings.warn(f"{old}.{name} moved to {new}.{name}", DeprecationWarning, stacklevel=2)
            return getattr(new_home, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    old_home.__getattr__ = __getattr__


_moved(engine, ("StreamConfig", "StreamWarning", "chunk_size_used", "is_streamed", "stream", "token_log_probs",
                "unstream"), streaming)  # the public switch left the engine
_moved(memory, ("PRESETS", "Planner", "training_step"), plan)  # the planner drives the engine, which memory serves
