"""Registry of family adapters keyed by ``config.model_type``."""

from __future__ import annotations

from torch import nn

from ._llama import LlamaFamilyAdapter

_ADAPTERS = {t: LlamaFamilyAdapter for t in LlamaFamilyAdapter.model_types}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_ADAPTERS))


def adapter_for(model: nn.Module):
    """The adapter for a transformers causal LM, or a clear error saying what is unsupported."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _ADAPTERS:
        raise NotImplementedError(
            f"leanbp has no adapter for model_type={model_type!r} ({type(model).__name__}). "
            f"Supported: {', '.join(supported_model_types())}. An adapter says how a decoder layer "
            "splits into K/V for all rows and the rest for a chunk of rows (see leanbp/models/_llama.py)."
        )
    if not (hasattr(model, "model") and hasattr(model, "lm_head")):
        raise NotImplementedError(
            f"{type(model).__name__} is a {model_type} model without a causal LM head; leanbp.stream "
            "expects the *ForCausalLM class (e.g. AutoModelForCausalLM)."
        )
    return _ADAPTERS[model_type](model)
