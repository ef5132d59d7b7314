"""OLMo2 decoder layers: no pre-norms; post-sublayer norms before each residual sum; q/k RMSNorms
over the full projection width (all heads together), before the heads are split.

    h = h + n1(o_proj(attention(rope(q_norm(q_proj(h))), rope(k_norm(k_proj(h))), v_proj(h))))
    h = h + n2(mlp(h))

This module is the worked example of "Adding a family" in docs/families.md.
"""

from __future__ import annotations

import transformers

from ._base import DecoderAdapter, final_norm_site


class Olmo2Adapter(DecoderAdapter):
    def attention_input(self, layer, hidden):
        return hidden

    def project_query(self, attn, x):
        return attn.q_norm(attn.q_proj(x)).view(*x.shape[:-1], -1, attn.head_dim)

    def project_key_value(self, attn, x):
        shape = (*x.shape[:-1], -1, attn.head_dim)
        return attn.k_norm(attn.k_proj(x)).view(shape), attn.v_proj(x).view(shape)

    def attention_residual(self, layer, hidden, attn_out):
        return hidden + layer.post_attention_layernorm(attn_out)

    def mlp_residual(self, layer, hidden):
        return hidden + layer.post_feedforward_layernorm(layer.mlp(hidden))

    def norm_sites(self, notes):
        notes.append("OLMo2 layer norms kept exact: they follow the sublayers and feed the residual sum")
        return final_norm_site(self, notes)

    @classmethod
    def tiny_config(cls, window=None, **sizes):
        return transformers.Olmo2Config(**{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **sizes})
