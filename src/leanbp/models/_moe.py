"""Mixture-of-experts decoder layers: Qwen3-MoE and Mixtral.

Attention is Qwen3's / Mistral's; the MLP is a router and token-routed experts. Every token is
routed on its own, so the MLP is separable by rows and streams like a dense one. The router's
load-balancing loss is not: it multiplies, per expert, the fraction of all tokens routed there (a
count, no gradient) by the mean router probability over all tokens (with gradient). The engine sums
both per layer while streaming the forward and hands the probability sums a gradient in backward
(see ``leanbp.engine``, ``_moe.py``); the adapter only says where the router is.
"""

from __future__ import annotations

import transformers

from ..engine import Router
from ._llama import LlamaAdapter, MistralAdapter, Qwen3Adapter


def _sparse(layer) -> bool:
    """A routed MLP (Qwen3-MoE also has dense layers: mlp_only_layers, decoder_sparse_step)."""
    return hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")


class _MoeAdapter(LlamaAdapter):
    def router(self, layer):
        if not _sparse(layer):
            return None
        gate = layer.mlp.gate
        return Router(gate, num_experts=gate.num_experts, top_k=gate.top_k)

    def mlp_norm_consumers(self, layer):
        if _sparse(layer):  # the router and the experts' fused 3D weights: nothing to fold into
            return None
        return super().mlp_norm_consumers(layer)

    def norm_sites(self, notes):
        notes.append("post-attention norms of MoE layers kept exact: they feed the router and the experts' "
                     "fused 3D weights")
        return super().norm_sites(notes)

    def activation_owners(self):
        return [(layer.mlp.experts if _sparse(layer) else layer.mlp, "act_fn") for layer in self.layers()]

    def mlp_width(self):
        # a row goes to top_k experts (a copy of the row and the expert's intermediates each) and
        # the router's E logits; the dense layers between may be wider
        c = self.config
        experts = getattr(c, "num_experts", None) or c.num_local_experts
        per_expert = (getattr(c, "moe_intermediate_size", None) or c.intermediate_size) + c.hidden_size
        return max(c.intermediate_size, c.num_experts_per_tok * per_expert + experts)


# tiny test models: 4 experts, 2 per token, the load-balancing loss on with a large weight, and the
# experts' eager loop (torch's grouped matmul has no float64 kernel)
_TINY_MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5,
                 experts_implementation="eager")


class Qwen3MoeAdapter(_MoeAdapter, Qwen3Adapter):
    @classmethod
    def tiny_config(cls, window=None, **sizes):
        # the second layer dense (mlp_only_layers); a window slides every layer
        sliding = dict(use_sliding_window=True, sliding_window=window) if window else {}
        return transformers.Qwen3MoeConfig(**{"num_experts": 4, "moe_intermediate_size": 32, "mlp_only_layers": [1],
                                              **sliding, **_TINY_MOE, **sizes})


class MixtralAdapter(_MoeAdapter, MistralAdapter):
    def training_randomness(self):
        out = super().training_randomness()
        if float(getattr(self.config, "router_jitter_noise", 0.0) or 0.0) > 0:
            out.append(f"router_jitter_noise={self.config.router_jitter_noise}")
        return out

    @classmethod
    def tiny_config(cls, window=None, **sizes):
        return transformers.MixtralConfig(**{"num_local_experts": 4, "sliding_window": window, **_TINY_MOE, **sizes})
