"""Model-family adapters, looked up by ``config.model_type``: each implements the engine's
``DecoderFamily`` protocol (and what ``leanbp.approx`` and ``leanbp.testing`` need) for one family."""

from ..engine import LayerChunk, Router
from ._base import ApproxRecipe, DecoderAdapter, FamilyAdapter, NormSite, Rope
from ._registry import adapter_class, adapter_for, approx_recipe_for, supported_model_types, tiny_config

__all__ = ["ApproxRecipe", "DecoderAdapter", "FamilyAdapter", "LayerChunk", "NormSite", "Rope", "Router",
           "adapter_class", "adapter_for", "approx_recipe_for", "supported_model_types", "tiny_config"]
