"""Adapter for Llama-style decoder layers: Llama, Mistral, Qwen2, Qwen3.

A decoder layer of these families is

    h = h + o_proj(attention(rope(q_norm?(q_proj(n1(h)))), rope(k_norm?(k_proj(n1(h)))), v_proj(n1(h))))
    h = h + mlp(n2(h))

The adapter splits it into "K/V for all rows" and "everything else for a chunk of rows". It calls
the layer's own submodules (so PEFT-wrapped linears, custom norms and activations keep working)
and never copies a modeling file.
"""

from __future__ import annotations

import torch
from torch import nn

from ..engine._attention import ChunkMasks, PrefixGradSink, chunk_attention


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim: the RoPE rotation these families use. Written here,
    not looked up through the layer's class module (FSDP2 swaps that class for a generated one)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaFamilyAdapter:
    """Llama, Mistral, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm)."""

    model_types = ("llama", "mistral", "qwen2", "qwen3")

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config

    # -- where things live in the model (looked up on every call: PEFT and wrappers replace modules)
    def backbone(self) -> nn.Module:
        """The module whose forward returns ``last_hidden_state``."""
        return self.model.model

    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    def embed_tokens(self) -> nn.Module:
        return self.model.model.embed_tokens

    def final_norm(self) -> nn.Module:
        return self.model.model.norm

    def lm_head(self) -> nn.Module:
        return self.model.lm_head

    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        """(cos, sin), each (1 or B, T, D): computed once per forward, shared by all layers."""
        return self.model.model.rotary_emb(hidden, position_ids)

    def sliding_window(self, layer_idx: int) -> int | None:
        attn = self.layers()[layer_idx].self_attn
        if hasattr(attn, "sliding_window"):  # Qwen2/Qwen3: set per layer from config.layer_types
            return attn.sliding_window
        if self.config.model_type == "mistral":
            return getattr(self.config, "sliding_window", None)
        return None

    def attention_dropout(self, layer_idx: int) -> float:
        return float(getattr(self.layers()[layer_idx].self_attn, "attention_dropout", 0.0) or 0.0)

    # -- the split of one decoder layer ---------------------------------------------------------
    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D): broadcast over heads
        return x * cos + rotate_half(x) * sin

    def _key_value_from_normed(self, attn: nn.Module, x: torch.Tensor, cos, sin):
        shape = (*x.shape[:-1], -1, attn.head_dim)  # (B, n, Hkv, D)
        key = attn.k_proj(x).view(shape)
        if hasattr(attn, "k_norm"):
            key = attn.k_norm(key)
        key = self._rope(key.transpose(1, 2), cos, sin)  # (B, Hkv, n, D)
        value = attn.v_proj(x).view(shape).transpose(1, 2)
        return key, value

    def key_value(self, layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K and V of the given rows: hidden (B, n, H) -> (B, Hkv, n, D) each."""
        return self._key_value_from_normed(layer.self_attn, layer.input_layernorm(hidden), cos, sin)

    def chunk_forward(
        self,
        layer: nn.Module,
        hidden: torch.Tensor,
        prefix_key: torch.Tensor | None,
        prefix_value: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        masks: ChunkMasks,
        sink: PrefixGradSink | None = None,
    ):
        """The layer for a chunk of rows: hidden (B, c, H); prefix_key/value (B, Hkv, p, D) are the
        visible rows before the chunk (None when there are none); ``sink`` collects their K/V
        gradients in backward (see ``chunk_attention``).

        Returns (output (B, c, H), the chunk's own key and value (B, Hkv, c, D)). The chunk's K/V are
        computed here from the same normed rows as its queries, so a backward through this call
        covers the K/V projections of these rows too.
        """
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        query = attn.q_proj(x).view(*hidden.shape[:-1], -1, attn.head_dim)  # (B, c, Hq, D)
        if hasattr(attn, "q_norm"):
            query = attn.q_norm(query)
        query = self._rope(query.transpose(1, 2), cos, sin)  # (B, Hq, c, D)
        key_c, value_c = self._key_value_from_normed(attn, x, cos, sin)  # (B, Hkv, c, D)
        out = chunk_attention(query, prefix_key, prefix_value, key_c, value_c, masks, attn.scaling, sink)
        out = out.transpose(1, 2).reshape(*hidden.shape[:-1], -1)  # (B, c, Hq*D)
        hidden = hidden + attn.o_proj(out)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden)), key_c, value_c
