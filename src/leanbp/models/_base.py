"""What leanbp needs from a model family, stated once.

A family adapter answers three clients:

* the streamed engine (``leanbp.engine``, whose ``DecoderFamily`` protocol it implements) and the
  switch that installs it (``leanbp.streaming``): where the embedding, decoder layers, final norm
  and LM head live; the rotary embedding each layer uses; each layer's attention kind (sliding
  window, logit soft-capping); the split of a decoder layer into "K/V of given rows"
  (``key_value``) and "everything else for a chunk of rows" (``chunk_forward``); the transform
  applied to the logits; the router of a mixture-of-experts layer;
* the approx patcher (``leanbp.approx``): which norms feed which linear layers (fold sites for the
  memory-sharing norms) and which modules own the MLP activation;
* the float64 references (``leanbp.testing``): a full-precision forward for the family's norms.

Adapters call the layer's own submodules (so PEFT-wrapped linears, custom norms and activations
keep working), look modules up on every call (PEFT and engine wrappers replace them), and never copy
a modeling file. ``DecoderAdapter`` implements the split for the common shape of a decoder layer;
a family overrides the few hooks where it differs. The registry (``_registry.py``) is the only
place a ``model_type`` selects code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from ..engine import ChunkMasks, LayerChunk, LogitTransform, PrefixGradSink, Router, chunk_attention


@dataclass
class NormSite:
    """A norm whose output feeds only ``consumers`` (linear layers), so MS-BP can fold its affine
    into them; ``residual`` is the module that adds the norm's output to a residual (post-LN)."""

    parent: nn.Module
    attr: str
    consumers: list
    residual: nn.Module | None = None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim: the RoPE rotation of these families. Written here,
    not looked up through the layer's class module (FSDP2 swaps that class for a generated one)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, n, D); cos/sin (1 or B, n, R) with R <= D: the first R dims rotate (partial rotary,
    as Phi3 configures it), the rest pass through."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, n, R): broadcast over heads
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        out = x * cos + rotate_half(x) * sin
    else:
        x_rot, x_pass = x[..., :rotary], x[..., rotary:]
        out = torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
    return out.to(x.dtype)  # (OLMo2's rotary embedding is float32 for a bf16 model; x keeps its dtype)


# rotary types whose (cos, sin) at a position depend on that position only; the others (dynamic
# NTK, longrope) rescale every position by the longest one in the call
_POSITION_LOCAL_ROPE = ("default", "linear", "llama3", "yarn")


class Rope:
    """(cos, sin) of a layer's rotary embedding for rows [start, end) of the streamed call, each
    (1 or B, end - start, R).

    Memory: for a position-local rotary type nothing of length T is kept: each chunk computes its
    own rows from its position ids (the same values, element for element, as one call over all
    rows). Other types (dynamic NTK, longrope) depend on the longest position, so their tables are
    computed once for all T and sliced."""

    def __init__(self, rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, *kind):
        rope_type = getattr(rotary, "rope_type", None)
        if isinstance(rope_type, dict):  # one rotary module for several layer kinds (Gemma3)
            rope_type = rope_type.get(kind[0]) if kind else None
        self._rotary, self._kind = rotary, kind
        self._position_ids = position_ids  # (1 or B, T)
        self._like = hidden.new_empty(0)  # the device and dtype the rotary embedding reads from its input
        self._table = None if rope_type in _POSITION_LOCAL_ROPE else rotary(hidden, position_ids, *kind)

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._table is not None:
            cos, sin = self._table
            return cos[:, start:end], sin[:, start:end]
        return self._rotary(self._like, self._position_ids[:, start:end], *self._kind)


def rms_norm_full_precision(module: nn.Module, hidden: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """transformers' RMSNorm computes in float32 even for a float64 model; here float64 stays
    float64 (``offset`` 1: the Gemma form, scale 1 + weight, applied before the cast back)."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    x = hidden.to(dtype)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x * (offset + module.weight.to(dtype))).to(hidden.dtype)
    return module.weight * x.to(hidden.dtype)


@runtime_checkable
class ApproxRecipe(Protocol):
    """What ``leanbp.approx`` needs from a family: every ``FamilyAdapter``, and the encoder recipes."""

    def norm_sites(self, notes: list[str]) -> list[NormSite]: ...

    def activation_owners(self) -> list[tuple[nn.Module, str]]: ...

    def activation_name(self) -> str | None: ...


class FamilyAdapter(ABC):
    """Everything leanbp needs from one model family (the engine's ``DecoderFamily`` and more).
    One instance per streamed model."""

    #: the family's RMSNorms scale by (norm_weight_offset + weight): 1 for Gemma, 0 elsewhere
    norm_weight_offset: ClassVar[float] = 0.0

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config

    # -- where things live (looked up on every call) ----------------------------------------------
    def backbone(self) -> nn.Module:
        """The module whose forward returns ``last_hidden_state``."""
        return self.model.model

    def layers(self) -> nn.ModuleList:
        return self.backbone().layers

    def embed_tokens(self) -> nn.Module:
        """The input embedding, including any scaling the family applies to it."""
        return self.backbone().embed_tokens

    def final_norm(self) -> nn.Module:
        return self.backbone().norm

    def lm_head(self) -> nn.Module:
        return self.model.lm_head

    def check(self) -> None:
        """Raise ``NotImplementedError`` for a configuration leanbp cannot stream exactly."""

    def training_randomness(self) -> list[str]:
        """Random ops in training (dropout, router jitter) that a recomputed chunk would redraw
        differently: a streamed training step refuses while any is on."""
        dropout = float(getattr(self.config, "attention_dropout", 0.0) or 0.0)
        return [f"attention_dropout={dropout}"] if dropout > 0 else []

    # -- per-layer attention ----------------------------------------------------------------------
    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[Rope]:
        """The rotary embedding of every layer for this call's (1 or B, T) position ids."""
        return [Rope(self.backbone().rotary_emb, hidden, position_ids)] * len(self.layers())

    #: one sliding window for every layer, from ``config.sliding_window`` (Mistral, Phi3); else
    #: each attention module's own ``sliding_window`` (per-layer kinds: Qwen2, Gemma)
    window_from_config: ClassVar[bool] = False

    def sliding_window(self, layer_idx: int) -> int | None:
        if self.window_from_config:
            return getattr(self.config, "sliding_window", None)
        return getattr(self.layers()[layer_idx].self_attn, "sliding_window", None)

    def row_working_set(self) -> int:
        """Elements one row of a recomputed chunk keeps alive in a layer's backward, an upper bound
        (``chunk_size="auto"`` divides its budget by it): the norms' inputs and outputs, q/k/v before
        and after RoPE, the attention output, the MLP's intermediates (``mlp_width`` wide) and the
        residual sums, and as many gradients."""
        c = self.config
        heads, kv_heads = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return 2 * (8 * c.hidden_size + 3 * (heads + kv_heads) * head_dim + 4 * self.mlp_width())

    def mlp_width(self) -> int:
        """Features of a row inside the MLP (the widest intermediate)."""
        return self.config.intermediate_size

    def attention_softcap(self, layer_idx: int) -> float | None:
        """Attention logit soft-capping of a layer (scores -> cap * tanh(scores / cap))."""
        return None

    # -- the split of one decoder layer -----------------------------------------------------------
    @abstractmethod
    def key_value(self, layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K and V of the given rows: hidden (B, n, H) -> (B, Hkv, n, D) each."""

    @abstractmethod
    def chunk_forward(self, layer: nn.Module, hidden: torch.Tensor, prefix_key, prefix_value, cos, sin,
                      masks: ChunkMasks, sink: PrefixGradSink | None = None, softcap: float | None = None,
                      router: Router | None = None) -> LayerChunk:
        """The layer for a chunk of rows ``hidden`` (B, c, H) attending to the visible rows before it
        (``prefix_key/value`` (B, Hkv, p, D), None when there are none); ``sink`` collects their K/V
        gradients in backward (see ``chunk_attention``); with a ``router``, its logits for these rows
        are returned too."""

    # -- the head -----------------------------------------------------------------------------------
    def logit_transform(self) -> LogitTransform:
        """What the causal LM applies to ``lm_head``'s output before the softmax, from the config
        fields transformers' models read: ``logit_scale`` (multiplies), ``logits_scaling`` (divides),
        ``final_logit_softcapping``."""
        scale = float(getattr(self.config, "logit_scale", None) or 1.0)
        scale /= float(getattr(self.config, "logits_scaling", None) or 1.0)
        return LogitTransform(scale=scale, softcap=getattr(self.config, "final_logit_softcapping", None))

    # -- mixture of experts --------------------------------------------------------------------------
    def router(self, layer: nn.Module) -> Router | None:
        """The router of a mixture-of-experts layer, None for a dense layer."""
        return None

    # -- approx (MS-BP folds, 2-bit activations) -----------------------------------------------------
    def norm_sites(self, notes: list[str]) -> list[NormSite]:
        """Norms MS-BP may replace, with the linears their affine folds into; a family explains in
        ``notes`` every norm it keeps exact."""
        return []

    def activation_owners(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of every MLP activation a 2-bit approximation may replace."""
        return [(layer.mlp, self.activation_attr) for layer in self.layers()]

    #: the attribute of a layer's MLP that holds its activation
    activation_attr: ClassVar[str] = "act_fn"

    def activation_name(self) -> str | None:
        """The MLP activation's name in transformers' ACT2FN (which 2-bit approximation fits it)."""
        return getattr(self.config, "hidden_act", None)

    # -- float64 verification ---------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def tiny_config(cls, window: int | None = None, **sizes):
        """A config of the family for float64 tests: ``sizes`` (vocab, hidden, layers, heads...) plus
        what the family needs to show its features (two layers of different kinds where it has
        them); ``window``: the sliding window of its sliding layers (None: no sliding layer)."""

    @classmethod
    def full_precision_norm(cls, module: nn.Module):
        """A forward for ``module`` that keeps float64 in float64 (same function), or None when the
        module is not one of the family's norms that downcasts."""
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight"):
            return partial(rms_norm_full_precision, offset=cls.norm_weight_offset)
        return None


def final_norm_site(adapter: FamilyAdapter, notes: list[str]) -> list[NormSite]:
    """The final norm folds into an untied LM head; a head tied to the embedding cannot change."""
    head = adapter.model.get_output_embeddings()
    if head.weight is adapter.model.get_input_embeddings().weight:
        notes.append("final norm kept exact: the LM head is tied to the embedding")
        return []
    return [NormSite(adapter.backbone(), "norm", [head])]


class DecoderAdapter(FamilyAdapter):
    """The common decoder layer, with hooks where families differ:

        x = attention_input(h)                                   (a pre-norm, or the identity)
        q, k, v = projections of x (per-head q/k norms, RoPE)
        h = attention_residual(h, o_proj(attention(q, k, v)))    (+ a post-norm in some families)
        h = mlp_residual(h)                                      (pre-norm -> MLP -> post-norm?)
    """

    #: per-head RMSNorm on q and k after the projection (Qwen3, Gemma3)
    head_norms: ClassVar[bool] = False

    def attention_input(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return layer.input_layernorm(hidden)

    def project_query(self, attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x (B, n, H) -> query before RoPE, (B, n, Hq, D)."""
        query = attn.q_proj(x).view(*x.shape[:-1], -1, attn.head_dim)
        return attn.q_norm(query) if self.head_norms else query

    def project_key_value(self, attn: nn.Module, x: torch.Tensor):
        """x (B, n, H) -> key before RoPE and value, (B, n, Hkv, D) each."""
        shape = (*x.shape[:-1], -1, attn.head_dim)
        key = attn.k_proj(x).view(shape)
        if self.head_norms:
            key = attn.k_norm(key)
        return key, attn.v_proj(x).view(shape)

    def project(self, attn: nn.Module, x: torch.Tensor):
        """Query, key and value of a chunk's rows, before RoPE (a fused projection runs once here)."""
        return self.project_query(attn, x), *self.project_key_value(attn, x)

    def attention_residual(self, layer: nn.Module, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        return hidden + attn_out

    def mlp_residual(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def key_value(self, layer, hidden, cos, sin):
        key, value = self.project_key_value(layer.self_attn, self.attention_input(layer, hidden))
        return apply_rope(key.transpose(1, 2), cos, sin), value.transpose(1, 2)  # (B, Hkv, n, D)

    def chunk_forward(self, layer, hidden, prefix_key, prefix_value, cos, sin, masks, sink=None, softcap=None,
                      router=None):
        # The chunk's own K/V come from the same attention input as its queries, so a backward
        # through this call covers the K/V projections of these rows too.
        attn = layer.self_attn
        query, key_c, value_c = self.project(attn, self.attention_input(layer, hidden))  # (B, c, H*, D)
        query = apply_rope(query.transpose(1, 2), cos, sin)  # (B, Hq, c, D)
        key_c = apply_rope(key_c.transpose(1, 2), cos, sin)  # (B, Hkv, c, D)
        value_c = value_c.transpose(1, 2)
        out = chunk_attention(query, prefix_key, prefix_value, key_c, value_c, masks, attn.scaling, sink,
                              softcap=softcap)
        out = out.transpose(1, 2).reshape(*hidden.shape[:-1], -1)  # (B, c, Hq*D)
        hidden = self.attention_residual(layer, hidden, attn.o_proj(out))
        if router is None:
            return LayerChunk(self.mlp_residual(layer, hidden), key_c, value_c)
        with _Recorded(router.module) as recorded:  # the router's logits, as transformers records them
            hidden = self.mlp_residual(layer, hidden)
        return LayerChunk(hidden, key_c, value_c, recorded.output)


class _Recorded:
    """Records ``module``'s output[0] during a block (a forward hook, removed on exit)."""

    def __init__(self, module: nn.Module):
        self.module, self.output, self._handle = module, None, None

    def _hook(self, module, args, output):
        self.output = output[0] if isinstance(output, (tuple, list)) else output

    def __enter__(self):
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()
