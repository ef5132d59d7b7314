"""Model-family adapters, looked up by ``config.model_type``."""

from ._base import DecoderAdapter, FamilyAdapter, LayerChunk, NormSite, Router
from ._registry import adapter_class, adapter_for, approx_recipe_for, supported_model_types, tiny_config

__all__ = ["DecoderAdapter", "FamilyAdapter", "LayerChunk", "NormSite", "Router", "adapter_class", "adapter_for", "approx_recipe_for",
           "supported_model_types", "tiny_config"]
