"""Model-family adapters, looked up by ``config.model_type``."""

from ._registry import adapter_for, supported_model_types

__all__ = ["adapter_for", "supported_model_types"]
