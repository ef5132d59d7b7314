"""Llama-style decoder layers: Llama, Mistral, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms).

    h = h + o_proj(attention(rope(q_norm?(q_proj(n1(h)))), rope(k_norm?(k_proj(n1(h)))), v_proj(n1(h))))
    h = h + mlp(n2(h))

This is ``DecoderAdapter``'s default layer; the families differ only in where the sliding window
comes from and in the q/k norms.
"""

from __future__ import annotations

import transformers

from ._base import DecoderAdapter, NormSite, final_norm_site


class LlamaAdapter(DecoderAdapter):
    def mlp_norm_consumers(self, layer) -> list | None:
        """The linears the post-attention norm feeds (None: it feeds something else too)."""
        return [layer.mlp.gate_proj, layer.mlp.up_proj]

    def norm_sites(self, notes):
        sites = []
        for layer in self.layers():
            attn = layer.self_attn
            sites.append(NormSite(layer, "input_layernorm", [attn.q_proj, attn.k_proj, attn.v_proj]))
            consumers = self.mlp_norm_consumers(layer)
            if consumers is not None:
                sites.append(NormSite(layer, "post_attention_layernorm", consumers))
        if self.head_norms:
            notes.append("q/k norms kept exact: they feed RoPE, not a linear layer")
        return sites + final_norm_site(self, notes)

    @classmethod
    def tiny_config(cls, window=None, **sizes):
        return transformers.LlamaConfig(**sizes)


class Qwen2Adapter(LlamaAdapter):
    """Qwen2: per-layer sliding windows (read from each attention module)."""

    config_class = transformers.Qwen2Config

    @classmethod
    def tiny_config(cls, window=None, **sizes):
        # layers from max_window_layers on slide: layer 0 global, layer 1 sliding
        sliding = dict(use_sliding_window=True, sliding_window=window, max_window_layers=1) if window else {}
        return cls.config_class(**{**sliding, **sizes})


class Qwen3Adapter(Qwen2Adapter):
    head_norms = True
    config_class = transformers.Qwen3Config


class MistralAdapter(LlamaAdapter):
    """Mistral: one sliding window for every layer."""

    window_from_config = True

    @classmethod
    def tiny_config(cls, window=None, **sizes):
        return transformers.MistralConfig(**{"sliding_window": window, **sizes})
