"""The registry of family adapters: the only place a ``config.model_type`` selects code."""

from __future__ import annotations

from torch import nn

from ._base import ApproxRecipe, FamilyAdapter
from ._encoders import BertRecipe, VitRecipe
from ._gemma import Gemma2Adapter, Gemma3Adapter
from ._head_only import HeadOnlyAdapter, head_only_backbone
from ._llama import LlamaAdapter, MistralAdapter, Qwen2Adapter, Qwen3Adapter
from ._moe import MixtralAdapter, Qwen3MoeAdapter
from ._olmo2 import Olmo2Adapter
from ._phi3 import Phi3Adapter

_ADAPTERS: dict[str, type[FamilyAdapter]] = {
    "llama": LlamaAdapter,
    "mistral": MistralAdapter,
    "qwen2": Qwen2Adapter,
    "qwen3": Qwen3Adapter,
    "gemma2": Gemma2Adapter,
    "gemma3_text": Gemma3Adapter,
    "phi3": Phi3Adapter,
    "olmo2": Olmo2Adapter,
    "qwen3_moe": Qwen3MoeAdapter,
    "mixtral": MixtralAdapter,
}


# encoders that leanbp.approx patches (fold sites and activations only; nothing to stream)
_APPROX_ONLY = {"vit": VitRecipe, "bert": BertRecipe, "roberta": BertRecipe}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_ADAPTERS))


# the sizes of a tiny float64 test model (GQA: 4 query heads on 2 K/V heads)
_TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
             attn_implementation="sdpa")


def tiny_config(model_type: str, window: int | None = None, **overrides):
    """A 2-layer config of a registered family for float64 tests (``FamilyAdapter.tiny_config``)."""
    if model_type not in _ADAPTERS:
        raise ValueError(f"no adapter for {model_type!r}; registered: {', '.join(supported_model_types())}")
    return _ADAPTERS[model_type].tiny_config(window, **{**_TINY, **overrides})


def model_type_of(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def adapter_class(model: nn.Module) -> type[FamilyAdapter]:
    """The adapter class of ``model``'s family (the base class for any other model: its generic
    answers, e.g. for float64 norms, still apply)."""
    return _ADAPTERS.get(model_type_of(model), FamilyAdapter)


def adapter_for(model: nn.Module, layers: bool = True) -> FamilyAdapter:
    """The adapter for a transformers causal LM, or a clear error saying what is unsupported.

    ``layers=False`` (only the LM head is chunked) works for any causal LM with an output embedding."""
    model_type = model_type_of(model)
    name = type(model).__name__
    if model_type in _ADAPTERS:
        if not (hasattr(model, "model") and hasattr(model, "lm_head")):
            raise NotImplementedError(
                f"{name} is a {model_type} model without a causal LM head; leanbp.stream expects the "
                "*ForCausalLM class (e.g. AutoModelForCausalLM)."
            )
        adapter = _ADAPTERS[model_type](model)
        adapter.check()
        return adapter
    has_head = callable(getattr(model, "get_output_embeddings", None)) and model.get_output_embeddings() is not None
    has_head = has_head and head_only_backbone(model) is not None  # (what layers=False needs)
    if not layers and has_head:
        adapter = HeadOnlyAdapter(model)
        adapter.check()
        return adapter
    fallback = (
        f" {name} has an output embedding, so leanbp.stream(model, layers=False) chunks its LM head and "
        "loss (the largest single activation) while transformers runs the decoder."
        if has_head else ""
    )
    raise NotImplementedError(
        f"leanbp has no adapter for model_type={model_type!r} ({name}). Streamed layers: "
        f"{', '.join(supported_model_types())}.{fallback} Adding a family: see docs/families.md."
    )


def approx_recipe_for(model: nn.Module) -> ApproxRecipe:
    """What ``leanbp.approx`` needs (``norm_sites``, ``activation_owners``) for ``model``'s family."""
    model_type = model_type_of(model)
    if model_type in _ADAPTERS:
        return _ADAPTERS[model_type](model)
    if model_type in _APPROX_ONLY:
        return _APPROX_ONLY[model_type](model)
    raise NotImplementedError(
        f"leanbp.approx has no recipe for model_type={model_type!r}; supported: "
        f"{', '.join(sorted({*_ADAPTERS, *_APPROX_ONLY}))}"
    )
