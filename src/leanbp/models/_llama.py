"""Llama-style decoder layers: Llama, Mistral, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms).

    h = h + o_proj(attention(rope(q_norm?(q_proj(n1(h)))), rope(k_norm?(k_proj(n1(h)))), v_proj(n1(h))))
    h = h + mlp(n2(h))

This is ``DecoderAdapter``'s default layer; the families differ only in where the sliding window
comes from and in the q/k norms. It is also the worked example of "Adding a family" in the README.
"""

from __future__ import annotations

from ._base import DecoderAdapter, NormSite


class LlamaAdapter(DecoderAdapter):
    """Llama and Qwen2 (per-layer sliding windows are read from the attention module)."""

    def norm_sites(self, notes):
        sites = []
        for layer in self.layers():
            attn, mlp = layer.self_attn, layer.mlp
            sites.append(NormSite(layer, "input_layernorm", [attn.q_proj, attn.k_proj, attn.v_proj]))
            sites.append(NormSite(layer, "post_attention_layernorm", [mlp.gate_proj, mlp.up_proj]))
        return sites + final_norm_site(self, notes)

    def activation_owners(self):
        return [(layer.mlp, "act_fn") for layer in self.layers()]


class MistralAdapter(LlamaAdapter):
    """Mistral: one sliding window for every layer, from the config."""

    def sliding_window(self, layer_idx):
        return getattr(self.config, "sliding_window", None)


class Qwen3Adapter(LlamaAdapter):
    head_norms = True

    def norm_sites(self, notes):
        notes.append("q/k norms kept exact: they feed RoPE, not a linear layer")
        return super().norm_sites(notes)


def final_norm_site(adapter, notes) -> list[NormSite]:
    """The final norm folds into an untied LM head; a head tied to the embedding cannot change."""
    head = adapter.model.get_output_embeddings()
    if head.weight is adapter.model.get_input_embeddings().weight:
        notes.append("final norm kept exact: the LM head is tied to the embedding")
        return []
    return [NormSite(adapter.backbone(), "norm", [head])]
