"""The strongest exact single-device peers of leanbp, as ``leanbp bench --suite peers`` runs them.

    ckpt_tiled_loss  transformers' gradient checkpointing + a tiled LM-head loss (DeepSpeed's
                     ``TiledFusedLogitsLoss``): no full logits, the layers as checkpointing has them
    alst             ALST's single-device recipe (Arctic Long Sequence Training; its pieces ship in
                     DeepSpeed): checkpointing + DeepSpeed's ``TiledMLP`` on every MLP (the MLP's
                     intermediate activations one tile at a time) + the tiled loss
    alst_1gib        the same with the loss tiles ArcticTraining's trainer picks: as few as hold at
                     most 1 GiB of fp32 logits each (one tile up to 8192 tokens of a 32k vocabulary)

Both are wired as their authors' trainers wire them, with one correction that exactness needs:
``TiledFusedLogitsLoss`` runs each tile's backward inside its forward with an incoming gradient of
1.0 and scales only the hidden states' gradient afterwards, so the LM head's weight gradient is
that of the *sum* of the tiles' outputs. A loss normalised after the Function (each tile's mean
times its count, summed, divided by the total count, as ArcticTraining's trainer does) leaves the
head's gradient T-1 times too large on one device. Here every tile returns its summed
cross-entropy divided by the whole batch's label count, and the Function sums the tiles: the loss
is the mean, and every gradient is exact (``tests/bench/test_peers.py``, float64 against plain
autograd).

Tiles: the loss takes ``head_chunk_size`` rows per tile (leanbp's head chunk: the same logits
memory on both sides: the strongest ALST, the baseline of the suite), or ArcticTraining's own rule
(``alst_1gib``); TiledMLP takes ALST's own rule, ceil(T / hidden) shards. ALST also offloads
the checkpointed layer inputs to the host on a GPU; on a CPU there is no host to offload to, so the
recipe runs without it (``checkpoint_offload`` says which was used).
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..engine import IGNORE_INDEX
from ..models import adapter_for
from ..streaming import causal_lm_of


@dataclass(frozen=True)
class Peer:
    name: str
    label: str
    tiled_mlp: bool
    # the loss tiles: leanbp's head chunk of rows, or ArcticTraining's at most 1 GiB of fp32 logits
    gib_tiles: bool = False


PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer("ckpt_tiled_loss", "checkpointing + tiled loss", tiled_mlp=False),
    Peer("alst", "ALST (checkpointing + TiledMLP + tiled loss)", tiled_mlp=True),
    Peer("alst_1gib", "ALST, ArcticTraining's 1 GiB loss tiles", tiled_mlp=True, gib_tiles=True),
)}


def _ulysses():
    try:
        from deepspeed.runtime.sequence_parallel import ulysses_sp
    except ImportError:
        raise ImportError("the ALST peers run DeepSpeed's TiledMLP and TiledFusedLogitsLoss: "
                          "pip install -e '.[deepspeed]'") from None
    return ulysses_sp


def prepare_peer(model: nn.Module, name: str) -> nn.Module:
    """Set a transformers causal LM up as peer ``name``: checkpointing (non-reentrant, as
    transformers' Trainer enables it), and for ALST every decoder layer's MLP tiled."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; choose from {list(PEERS)}")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if PEERS[name].tiled_mlp:
        _ulysses()
        for layer in adapter_for(causal_lm_of(model)).layers():
            layer.mlp.forward = types.MethodType(_tiled_mlp_forward, layer.mlp)
    return model


def _mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's own forward on a tile (its class's, not the tiled one installed on the instance)."""
    return type(mlp).forward(mlp, x)


def _tiled_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """ALST's MLP: DeepSpeed's TiledMLP with ceil(T / hidden) shards, as ALST sets it."""
    shards = math.ceil(x.shape[-2] / x.shape[-1])
    return _ulysses().TiledMLP.apply(_mlp_forward, self, x, shards, list(self.parameters()))


def peer_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, tile_rows: int,
              peer: str = "alst", **inputs) -> torch.Tensor:
    """The causal-LM loss (mean over the labelled tokens, as transformers') through DeepSpeed's
    tiled fused loss, each tile normalised by the whole batch's label count inside the Function;
    ``tile_rows`` rows per tile, or the tiles of ``peer``'s own rule."""
    backbone = model.get_decoder()
    hidden = backbone(input_ids=input_ids, use_cache=False, **inputs).last_hidden_state  # (B, T, H)
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # (B, T): row t predicts token t + 1
    count = (targets != IGNORE_INDEX).sum().clamp(min=1)
    head = model.get_output_embeddings()

    def tile_loss(_, x, y):  # x (rows, H), y (rows,)
        logits = head(x)  # (rows, V)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum") / count

    if PEERS[peer].gib_tiles:  # ArcticTraining: ceil(logits bytes in fp32 / 1 GiB)
        shards = math.ceil(targets.numel() * head.out_features * 4 / 2**30)
    else:
        shards = math.ceil(targets.numel() / tile_rows)
    shards = max(1, shards)
    return _ulysses().TiledFusedLogitsLoss.apply(tile_loss, model, hidden, targets, None, shards,
                                                 list(head.parameters()), "sum")


__all__ = ["PEERS", "Peer", "peer_loss", "prepare_peer"]
