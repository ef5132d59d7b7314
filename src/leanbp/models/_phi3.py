"""Phi3 decoder layers: Llama's layer with a fused ``qkv_proj`` and ``gate_up_proj``, partial rotary
(``partial_rotary_factor``: only the first dims of each head rotate), one sliding window for all
layers, and residual dropout (refused in a training step while it is on)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ._base import DecoderAdapter, NormSite
from ._llama import final_norm_site


class Phi3Adapter(DecoderAdapter):
    def _split(self, attn):
        q = self.config.num_attention_heads * attn.head_dim
        kv = self.config.num_key_value_heads * attn.head_dim
        return q, kv

    def project_query(self, attn, x):
        q, _ = self._split(attn)
        return self._rows(attn.qkv_proj, x, 0, q).view(*x.shape[:-1], -1, attn.head_dim)

    def project_key_value(self, attn, x):
        q, kv = self._split(attn)
        kv_out = self._rows(attn.qkv_proj, x, q, q + 2 * kv)  # (B, n, 2*Hkv*D)
        shape = (*x.shape[:-1], -1, attn.head_dim)
        return kv_out[..., :kv].view(shape), kv_out[..., kv:].view(shape)

    @staticmethod
    def _rows(linear, x, start, end):
        """Output features [start, end) of ``linear``: a slice of a plain Linear's weight (a view, no
        copy: K/V of all rows in backward need no query projection); any other module (PEFT's LoRA
        wrapper) runs whole and is sliced after."""
        if type(linear) is nn.Linear:
            bias = None if linear.bias is None else linear.bias[start:end]
            return F.linear(x, linear.weight[start:end], bias)
        return linear(x)[..., start:end]

    def sliding_window(self, layer_idx):
        return getattr(self.config, "sliding_window", None)

    def training_randomness(self):
        out = super().training_randomness()
        if float(getattr(self.config, "resid_pdrop", 0.0) or 0.0) > 0:
            out.append(f"resid_pdrop={self.config.resid_pdrop}")
        return out

    def norm_sites(self, notes):
        sites = []
        for layer in self.layers():
            sites.append(NormSite(layer, "input_layernorm", [layer.self_attn.qkv_proj]))
            sites.append(NormSite(layer, "post_attention_layernorm", [layer.mlp.gate_up_proj]))
        return sites + final_norm_site(self, notes)

    def activation_owners(self):
        return [(layer.mlp, "activation_fn") for layer in self.layers()]

