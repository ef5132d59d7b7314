"""Gemma2 and Gemma3 (text) decoder layers.

    x = n1(h)                         RMSNorm with scale (1 + weight)
    h = h + n2(o_proj(attention(q, k, v)))           a post-attention norm before the residual sum
    h = h + n4(mlp(n3(h)))                           pre- and post-feedforward norms

with the embedding scaled by sqrt(hidden) (inside transformers' embedding module), scores scaled by
``query_pre_attn_scalar ** -0.5``, sliding-window and global layers alternating. Gemma2 soft-caps the
attention logits (so attention runs block by block with an exact log-sum-exp merge, never SDPA) and
the final logits; Gemma3 has per-head q/k norms and a different RoPE base for local and global
layers (one (cos, sin) per layer type, shared by the layers of that type).
"""

from __future__ import annotations

import transformers

from ..engine import SOFTCAP_BLOCK_ROWS
from ._base import DecoderAdapter, Rope


class Gemma2Adapter(DecoderAdapter):
    norm_weight_offset = 1.0

    def attention_residual(self, layer, hidden, attn_out):
        return hidden + layer.post_attention_layernorm(attn_out)

    def mlp_residual(self, layer, hidden):
        return hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))

    def attention_softcap(self, layer_idx):
        return getattr(self.config, "attn_logit_softcapping", None)

    def row_working_set(self):
        # soft-capped attention holds a row's scores against a block of keys for every head (scores,
        # capped scores, probabilities and their gradients: about 6 copies)
        extra = 0
        if any(self.attention_softcap(i) for i in range(len(self.layers()))):
            extra = 6 * self.config.num_attention_heads * SOFTCAP_BLOCK_ROWS
        return super().row_working_set() + extra

    def check(self):
        if getattr(self.config, "use_bidirectional_attention", False):
            raise NotImplementedError("use_bidirectional_attention=True: leanbp streams causal attention only")

    def norm_sites(self, notes):
        notes.append("Gemma norms kept exact: their scale is (1 + weight) and the post-sublayer norms feed "
                     "the residual sum, not a linear layer")
        return []

    def activation_name(self):
        # tanh-approximated GELU: ReGELU2's forward is the erf form, so it is refused (not swapped)
        return getattr(self.config, "hidden_activation", None)

    @classmethod
    def _kinds(cls, window, sizes):
        """A sliding layer, then a global one (all global without a window)."""
        layers = sizes.get("num_hidden_layers", 2)
        kinds = ["sliding_attention", "full_attention"] if window else ["full_attention"]
        return dict(layer_types=(kinds * layers)[:layers], sliding_window=window or 4096,
                    query_pre_attn_scalar=24)

    @classmethod
    def tiny_config(cls, window=None, **sizes):
        # soft-capping small enough that tanh is far from linear; SDPA cannot soft-cap: eager
        return transformers.Gemma2Config(**{**cls._kinds(window, sizes), "attn_logit_softcapping": 3.0,
                                            "final_logit_softcapping": 5.0, **sizes, "attn_implementation": "eager"})


class Gemma3Adapter(Gemma2Adapter):
    head_norms = True

    def attention_softcap(self, layer_idx):
        return None  # Gemma3's attention never passes its config's attn_logit_softcapping on

    def position_embeddings(self, hidden, position_ids):
        rotary = self.backbone().rotary_emb
        kinds = self.config.layer_types
        per_kind = {kind: Rope(rotary, hidden, position_ids, kind) for kind in set(kinds)}
        return [per_kind[kind] for kind in kinds]

    @classmethod
    def tiny_config(cls, window=None, **sizes):
        return transformers.Gemma3TextConfig(**{**cls._kinds(window, sizes), **sizes})
