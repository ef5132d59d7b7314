"""What the engine needs from a model family, stated as types of its own.

The engine streams any decoder whose family answers ``DecoderFamily``: where the embedding and the
layers are, the rotary embedding each layer uses, each layer's attention kind, and the split of a
layer into "K/V of given rows" (``key_value``) and "everything else for a chunk of rows"
(``chunk_forward``). ``leanbp.models`` implements it once per family; the engine imports nothing
of the families.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn

from ._masks import ChunkMasks, PrefixGradSink


class LayerChunk(NamedTuple):
    """What ``chunk_forward`` returns for rows [s, e) of one layer."""

    out: torch.Tensor  # (B, c, H)
    key: torch.Tensor  # (B, Hkv, c, D): the chunk's own K/V rows, computed from the same normed rows
    value: torch.Tensor
    router_logits: torch.Tensor | None = None  # (B*c, E) for a mixture-of-experts layer


@dataclass(frozen=True)
class Router:
    """A mixture-of-experts layer's router: ``module``'s output[0] are the router logits (N, E)."""

    module: nn.Module
    num_experts: int
    top_k: int


class RotaryRows(Protocol):
    """A layer's rotary embedding for one streamed call: (cos, sin) of rows [start, end), each
    (1 or B, end - start, R) with R rotary dims."""

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class DecoderFamily(Protocol):
    """The engine's view of a model family (one instance per streamed model)."""

    config: Any  # the model's config (the chunk-size budget reads its attention heads)

    def embed_tokens(self) -> nn.Module:
        """The input embedding, including any scaling the family applies to it."""

    def layers(self) -> nn.ModuleList:
        """The decoder layers, looked up on every call (engine wrappers and PEFT replace modules)."""

    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[RotaryRows]:
        """The rotary embedding of every layer for this call's (1 or B, T) position ids."""

    def sliding_window(self, layer_idx: int) -> int | None:
        """The layer's sliding window (None: full attention)."""

    def attention_softcap(self, layer_idx: int) -> float | None:
        """The layer's attention logit soft-capping (None: none)."""

    def router(self, layer: nn.Module) -> Router | None:
        """The router of a mixture-of-experts layer, None for a dense layer."""

    def row_working_set(self) -> int:
        """Elements one row of a recomputed chunk keeps alive in a layer's backward, an upper bound."""

    def key_value(self, layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given rows: hidden (B, n, H) -> (B, Hkv, n, D) each."""

    def chunk_forward(self, layer: nn.Module, hidden: torch.Tensor, prefix_key: torch.Tensor | None,
                      prefix_value: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, masks: ChunkMasks,
                      sink: PrefixGradSink | None = None, softcap: float | None = None,
                      router: Router | None = None) -> LayerChunk:
        """The layer for a chunk of rows ``hidden`` (B, c, H) attending to the visible rows before it
        (``prefix_key/value`` (B, Hkv, p, D), None when there are none); ``sink`` collects their K/V
        gradients in backward (see ``chunk_attention``); with a ``router``, its logits for these rows
        are returned too."""
