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

from functools import partial

from ..engine._head import LogitTransform
from ._base import DecoderAdapter, rms_norm_full_precision


class Gemma2Adapter(DecoderAdapter):
    def attention_residual(self, layer, hidden, attn_out):
        return hidden + layer.post_attention_layernorm(attn_out)

    def mlp_residual(self, layer, hidden):
        return hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))

    def attention_softcap(self, layer_idx):
        return getattr(self.config, "attn_logit_softcapping", None)

    def logit_transform(self):
        return LogitTransform(softcap=getattr(self.config, "final_logit_softcapping", None))

    def check(self):
        if getattr(self.config, "use_bidirectional_attention", False):
            raise NotImplementedError("use_bidirectional_attention=True: leanbp streams causal attention only")

    def norm_sites(self, notes):
        notes.append("Gemma norms kept exact: their scale is (1 + weight) and the post-sublayer norms feed "
                     "the residual sum, not a linear layer")
        return []

    def activation_owners(self):
        return [(layer.mlp, "act_fn") for layer in self.layers()]

    @classmethod
    def full_precision_norm(cls, module):
        if type(module).__name__.endswith("RMSNorm"):
            return partial(rms_norm_full_precision, plus_one=True)
        return None


class Gemma3Adapter(Gemma2Adapter):
    head_norms = True

    def position_embeddings(self, hidden, position_ids):
        rotary = self.backbone().rotary_emb
        kinds = self.config.layer_types
        per_kind = {kind: rotary(hidden, position_ids, kind) for kind in set(kinds)}
        return [per_kind[kind] for kind in kinds]
