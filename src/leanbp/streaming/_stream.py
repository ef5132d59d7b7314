"""``leanbp.stream(model)``: the decoder of a transformers causal LM runs StreamBP.

Streaming lives at the decoder. Two forwards are replaced, per instance and reversibly (parameters,
state dict, ``save_pretrained``, optimizers and distributed wrappers are untouched): the backbone's
and the causal LM's (``_forwards.py`` says which call streams and how). The model carries its
``StreamConfig`` and its family adapter (``_state.py``).
"""

from __future__ import annotations

import os
import warnings

from torch import nn

from .._patching import install, installed, uninstall
from ..distributed import prepare_for_engines
from ..engine import SequenceGroup, unroute
from ..models import adapter_for
from ._config import StreamConfig
from ._forwards import CHECKPOINTING_IGNORED, backbone_forward, checkpointing, lm_forward
from ._probe import check_streamed
from ._state import ATTRIBUTE, StreamState, causal_lm_of, state_of

# attention implementations that compute what leanbp's chunk attention computes (leanbp computes
# it itself, so a model configured for any of them streams); ``accept_attention_implementation``
# adds one
_SAME_ATTENTION = {"eager", "sdpa", "flash_attention_2", "flash_attention_3"}


def accept_attention_implementation(name: str) -> None:
    """Let models configured with the attention implementation ``name`` (one registered with
    transformers' ``AttentionInterface``) stream: leanbp replaces its attention by leanbp's exact
    chunk attention, so register only an implementation that computes plain softmax attention
    (soft-capping, windows and masks as transformers passes them), e.g. a float64 reference."""
    _SAME_ATTENTION.add(name)


def is_streamed(model: nn.Module) -> bool:
    return state_of(causal_lm_of(model)) is not None


def chunk_size_used(model: nn.Module) -> int | None:
    """The rows per chunk of the streamed model's last call that streamed its layers (what "auto"
    chose; calls without gradients count too): None before the first, and always with
    ``layers=False``; a call that ran the model's own forward leaves it as it was."""
    state = state_of(causal_lm_of(model))
    if state is None:
        raise ValueError("model is not streamed")
    return state.last_chunk_rows


# the positional parameters of stream() before StreamConfig carried them (deprecated)
_OLD_POSITIONAL = ("chunk_size", "head_chunk_size", "layers", "eval_logits", "chunk_memory", "offload")


def stream(model: nn.Module, config: StreamConfig | None = None, *old_positional, sequence_parallel=None,
           **overrides) -> nn.Module:
    """Make the decoder of ``model`` run exact StreamBP whenever it builds a graph.

    ``model`` is a transformers causal LM, or a PEFT / DDP / accelerate wrapper of one, before or
    after ``get_peft_model`` or a TRL trainer's setup. ``config`` (default ``StreamConfig()``) and
    keyword ``overrides`` of its fields (``chunk_size=2048``, ``offload=True``, ...) say how.
    Calls with ``labels`` return ``loss`` (and ``logits=None`` in training); TRL's fused-head calls
    return per-token log-probs; both are chunked. Returns ``model``. Undo with :func:`unstream`.

    ``sequence_parallel``: a process group (or ``True``: DeepSpeed's sequence-parallel group where it
    has set one up, else the default group) whose ranks share each sequence, Ulysses-style
    (``leanbp.engine._ulysses``): every rank passes its own T/P consecutive rows of the inputs and
    labels (``sequence_batch``), the loss is the whole sequence's on every rank, and
    ``reduce_sequence_gradients(model)`` sums the gradients over the group once per step.
    (A ``leanbp.engine.SequenceGroup`` is taken as it is: ``leanbp plan`` streams its fake models
    with a group that moves nothing.)
    """
    config = resolve_config(config, overrides, old_positional, _OLD_POSITIONAL)
    sequence = _sequence_group(sequence_parallel, config)
    lm = causal_lm_of(model)
    if state_of(lm) is not None:
        if installed(lm, "forward", lm_forward):
            raise ValueError("model is already streamed; call leanbp.unstream(model) first to change chunk sizes")
        # something (TRL's fused head) wrapped the streamed forward since: leanbp goes on top again
        _uninstall(lm)
    adapter = adapter_for(lm, layers=config.layers)
    attn_impl = getattr(lm.config, "_attn_implementation", None) or "eager"
    if config.layers and attn_impl not in _SAME_ATTENTION:
        raise NotImplementedError(
            f"attn_implementation={attn_impl!r} is not supported by leanbp.stream (it computes chunk "
            f"attention itself); load the model with attn_implementation='sdpa' (or 'eager' where the family "
            "has no SDPA path, e.g. soft-capped attention)."
        )
    if config.layers:  # (before anything is installed: a refusal leaves the model as it was)
        prepare_for_engines(adapter.layers(), [adapter.final_norm(), adapter.lm_head()])
    if config.check:  # (before anything is installed, like the refusals above)
        check_streamed(lm, adapter, config.layers)
    state = StreamState(config=config, adapter=adapter, sequence=sequence)
    if config.layers and checkpointing(adapter):
        state.warn_once("checkpointing", CHECKPOINTING_IGNORED)
    setattr(lm, ATTRIBUTE, state)
    # instance attributes, picklable, reporting the replaced forward's signature (see _patching)
    install(lm, "forward", lm_forward)
    if config.layers:
        backbone = adapter.backbone()
        setattr(backbone, ATTRIBUTE, state)
        install(backbone, "forward", backbone_forward)
    return model


def _sequence_group(sequence_parallel, config: StreamConfig) -> SequenceGroup | None:
    if sequence_parallel is None or sequence_parallel is False:
        return None
    if not config.layers:
        raise ValueError("sequence_parallel splits the streamed layers' rows: it needs layers=True")
    if isinstance(sequence_parallel, SequenceGroup):  # (one built already: the planner's fake group)
        return sequence_parallel
    return SequenceGroup.set_up() if sequence_parallel is True else SequenceGroup.of(sequence_parallel)


def resolve_config(config, overrides: dict, old_positional: tuple = (), old_names: tuple = ()) -> StreamConfig:
    """``config`` with ``overrides`` applied (and validated). Settings passed positionally, as the
    calls before ``StreamConfig`` took them (``stream(model, 2048, 512)``: ``old_names`` in order,
    a number or "auto" where the config goes first), still work and warn that they are deprecated."""
    if isinstance(config, StreamConfig) and old_positional:
        raise TypeError("settings beside a StreamConfig go by name (chunk_size=...)")
    if config is not None and not isinstance(config, StreamConfig):
        old_positional = (config, *old_positional)
        config = None
    if old_positional:
        if len(old_positional) > len(old_names) or not isinstance(old_positional[0], (int, str)):
            raise TypeError(f"config must be a leanbp.StreamConfig, got {type(old_positional[0]).__name__}")
        named = dict(zip(old_names, old_positional))
        twice = sorted(set(named) & set(overrides))
        if twice:
            raise TypeError(f"{twice} given both positionally and by name")
        warnings.warn(f"passing {', '.join(named)} positionally is deprecated: pass them by name or in a "
                      "leanbp.StreamConfig", DeprecationWarning, stacklevel=3)
        overrides = {**named, **overrides}
    config = config or StreamConfig()
    unknown = set(overrides) - set(StreamConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown StreamConfig settings {sorted(unknown)}; "
                        f"choose from {sorted(StreamConfig.__dataclass_fields__)}")
    mode = os.environ.get("LEANBP_ATTENTION")
    if mode is not None and "attention" not in overrides and config.attention == "blocks":
        warnings.warn("LEANBP_ATTENTION is deprecated: pass attention=... (StreamConfig.attention)", DeprecationWarning,
                      stacklevel=3)
        overrides = {**overrides, "attention": mode}
    return StreamConfig(**{**vars(config), **overrides})


def unstream(model: nn.Module) -> nn.Module:
    """Return a streamed model to plain transformers behaviour."""
    lm = causal_lm_of(model)
    if state_of(lm) is None:
        raise ValueError("model is not streamed")
    _uninstall(lm)
    return model


def _uninstall(lm: nn.Module) -> None:
    adapter = state_of(lm).adapter
    for module, impl in ((lm, lm_forward), (adapter.backbone(), backbone_forward)):
        vars(module).pop(ATTRIBUTE, None)
        # a wrapper installed on top of ours stays; ours, without its state, passes calls through
        uninstall(module, "forward", impl)
    for module in (*adapter.layers(), adapter.final_norm(), adapter.lm_head()):
        unroute(module)  # (routed on first use; calls leanbp does not make pass through anyway)
