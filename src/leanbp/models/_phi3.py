"""Phi3 decoder layers: Llama's layer with a fused ``qkv_proj`` and ``gate_up_proj``, partial rotary
(``partial_rotary_factor``: only the first dims of each head rotate), one sliding window for all
layers, and residual dropout (the layer's own dropout modules: a streamed backward replays their draws)."""

from __future__ import annotations

import torch.nn.functional as F
import transformers
from torch import nn

from ._base import DecoderAdapter, NormSite, final_norm_site


class Phi3Adapter(DecoderAdapter):
    window_from_config = True
    activation_attr = "activation_fn"

    def _widths(self, attn):
        """(query width, key width) of ``qkv_proj``'s output: [q | k | v], v as wide as k."""
        return self.config.num_attention_heads * attn.head_dim, self.config.num_key_value_heads * attn.head_dim

    def project(self, attn, x):
        q, kv = self._widths(attn)
        qkv = attn.qkv_proj(x)  # (B, c, q + 2 kv): the fused projection runs once per chunk
        shape = (*x.shape[:-1], -1, attn.head_dim)
        return qkv[..., :q].view(shape), qkv[..., q:q + kv].view(shape), qkv[..., q + kv:].view(shape)

    def project_key_value(self, attn, x):
        """K/V of all rows for the prefix (backward): a plain Linear's weight rows [q, q + 2 kv) (a view,
        no copy) skip the query projection; any other module (PEFT's LoRA wrapper) runs whole."""
        q, kv = self._widths(attn)
        linear = attn.qkv_proj
        if type(linear) is nn.Linear:
            bias = None if linear.bias is None else linear.bias[q:]
            out = F.linear(x, linear.weight[q:], bias)  # (B, n, 2 kv)
        else:
            out = linear(x)[..., q:]
        shape = (*x.shape[:-1], -1, attn.head_dim)
        return out[..., :kv].view(shape), out[..., kv:].view(shape)

    def project_query(self, attn, x):
        return self.project(attn, x)[0]

    def attention_residual(self, layer, hidden, attn_out):
        return hidden + layer.resid_attn_dropout(attn_out)

    def mlp_residual(self, layer, hidden):
        return hidden + layer.resid_mlp_dropout(layer.mlp(layer.post_attention_layernorm(hidden)))

    def norm_sites(self, notes):
        sites = []
        for layer in self.layers():
            sites.append(NormSite(layer, "input_layernorm", [layer.self_attn.qkv_proj]))
            sites.append(NormSite(layer, "post_attention_layernorm", [layer.mlp.gate_up_proj]))
        return sites + final_norm_site(self, notes)

    @classmethod
    def tiny_config(cls, window=None, **sizes):
        return transformers.Phi3Config(**{"partial_rotary_factor": 0.5, "sliding_window": window, "pad_token_id": 0,
                                          "bos_token_id": 1, "eos_token_id": 2, **sizes})
