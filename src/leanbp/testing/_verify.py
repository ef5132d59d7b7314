"""``leanbp verify``: float64 gradients of a streamed model against plain autograd.

One step with left padding of different lengths and prompt-masked labels, run once with plain
autograd (float64 kept in float64, ``_references.py``) and streamed at each chunking: the chunk
sizes the user trains with, and small ones that cut the sequence in many places (chunk and prompt
boundaries that fall inside each other), so that a short check exercises what a long run does.
"""

from __future__ import annotations

import copy
import re

import torch

from ..engine import IGNORE_INDEX
from ..streaming import StreamConfig
from ._references import plain_step, relative_errors, streamed_step

# (chunk_size, head_chunk_size) that divide no sequence length evenly, checked beside the user's
BOUNDARY_CHUNKINGS = ((17, 13),)

_GROUPS = (
    ("embedding", r"embed_tokens"),
    ("attention", r"self_attn\.(q|k|v|o)_proj"),
    ("q/k norms", r"self_attn\.(q|k)_norm"),
    ("mlp", r"\.mlp\."),
    ("layer norms", r"(input|post_attention)_layernorm"),
    ("final norm", r"model\.norm\."),
    ("lm head", r"lm_head"),
)


def group_of(name: str) -> str:
    for group, pattern in _GROUPS:
        if re.search(pattern, name):
            return group
    return "other"


def verify(model, seq_len: int = 96, batch: int = 3, config: StreamConfig | None = None, seed: int = 0) -> dict:
    """Check one float64 step of ``model`` streamed with ``config`` (and at ``BOUNDARY_CHUNKINGS``)
    against plain autograd.

    Returns {"chunkings": [{"chunk_size", "head_chunk_size", "loss": relative loss error,
    "groups": {group: max relative error}, "params": {name: relative error}}, ...], "worst": float}.
    """
    if seq_len < 8:
        raise ValueError(f"--seq-len {seq_len} is too short to check anything: use at least 8 (left padding, a "
                         "prompt and labelled tokens)")
    if batch < 1:
        raise ValueError(f"--batch must be >= 1, got {batch}")
    config = config or StreamConfig()
    model = model.to(torch.float64).train()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g)
    mask = torch.ones_like(ids)
    for b in range(batch):
        mask[b, : (b * 7) % max(1, seq_len // 3)] = 0  # left padding of different lengths
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[:, : seq_len // 4 + 3] = IGNORE_INDEX  # a prompt whose end falls inside a chunk
    inputs = dict(input_ids=ids, attention_mask=mask)
    reference = copy.deepcopy(model)  # one plain step serves every chunking
    ref_loss = plain_step(reference, labels, inputs)
    chunkings = list(dict.fromkeys([(config.chunk_size, config.head_chunk_size), *BOUNDARY_CHUNKINGS]))
    results = []
    for chunk_size, head_chunk_size in chunkings:
        candidate = copy.deepcopy(model)  # (each chunking streams its own copy; gradients start at none)
        settings = {**vars(config), "chunk_size": chunk_size, "head_chunk_size": head_chunk_size,
                    "chunk_memory": config.chunk_memory if chunk_size == config.chunk_size else None}
        loss = streamed_step(candidate, labels, inputs, settings)
        params = relative_errors(reference, candidate)
        groups: dict[str, float] = {}
        for name, err in params.items():
            groups[group_of(name)] = max(groups.get(group_of(name), 0.0), err)
        results.append({"chunk_size": chunk_size, "head_chunk_size": head_chunk_size,
                        "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), "groups": groups,
                        "params": params})
    worst = max(max([r["loss"], *r["groups"].values()]) for r in results)
    return {"chunkings": results, "worst": worst}
