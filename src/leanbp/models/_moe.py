"""Mixture-of-experts decoder layers: Qwen3-MoE and Mixtral.

Attention is Qwen3's / Mistral's; the MLP is a router and token-routed experts. Every token is
routed on its own, so the MLP is separable by rows and streams like a dense one. The router's
load-balancing loss is not: it multiplies, per expert, the fraction of all tokens routed there (a
count, no gradient) by the mean router probability over all tokens (with gradient). The engine sums
both per layer while streaming the forward and hands the probability sums a gradient in backward
(see ``engine/_moe.py``); the adapter only says where the router is.
"""

from __future__ import annotations

from ._base import NormSite, Router
from ._llama import MistralAdapter, Qwen3Adapter, final_norm_site


class _MoeMixin:
    def _is_sparse(self, layer) -> bool:
        return hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")

    def router(self, layer):
        if not self._is_sparse(layer):  # Qwen3-MoE's mlp_only_layers / decoder_sparse_step
            return None
        gate = layer.mlp.gate
        return Router(gate, num_experts=gate.num_experts, top_k=gate.top_k)

    def norm_sites(self, notes):
        notes.append("post-attention norms kept exact: they feed the router and the experts' fused 3D weights")
        sites = []
        for layer in self.layers():
            attn = layer.self_attn
            sites.append(NormSite(layer, "input_layernorm", [attn.q_proj, attn.k_proj, attn.v_proj]))
            if not self._is_sparse(layer):
                sites.append(NormSite(layer, "post_attention_layernorm", [layer.mlp.gate_proj, layer.mlp.up_proj]))
        return sites + final_norm_site(self, notes)

    def activation_owners(self):
        return [(layer.mlp.experts if self._is_sparse(layer) else layer.mlp, "act_fn") for layer in self.layers()]


class Qwen3MoeAdapter(_MoeMixin, Qwen3Adapter):
    pass


class MixtralAdapter(_MoeMixin, MistralAdapter):
    def training_randomness(self):
        out = super().training_randomness()
        if float(getattr(self.config, "router_jitter_noise", 0.0) or 0.0) > 0:
            out.append(f"router_jitter_noise={self.config.router_jitter_noise}")
        return out
