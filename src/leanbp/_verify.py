"""`leanbp verify`: float64 gradients of a streamed model against plain autograd."""

from __future__ import annotations

import re

import torch

from ._verify_utils import relative_errors, streamed_vs_plain

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


def verify(model, seq_len: int = 96, batch: int = 3, chunk_size: int = 17, head_chunk_size: int = 13,
           seed: int = 0) -> dict:
    """Run one float64 step with left padding and prompt-masked labels both ways.

    Returns {"loss": relative loss error, "groups": {group: max relative error}, "params": {...}}.
    """
    model = model.to(torch.float64).train()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g)
    mask = torch.ones_like(ids)
    for b in range(batch):
        mask[b, : (b * 7) % max(1, seq_len // 3)] = 0  # left padding of different lengths
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, : seq_len // 4 + 3] = -100  # a prompt whose end falls inside a chunk
    reference, ref_loss, loss = streamed_vs_plain(
        model, labels, dict(input_ids=ids, attention_mask=mask),
        dict(chunk_size=chunk_size, head_chunk_size=head_chunk_size))
    params = relative_errors(reference, model)
    groups: dict[str, float] = {}
    for name, err in params.items():
        groups[group_of(name)] = max(groups.get(group_of(name), 0.0), err)
    return {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), "groups": groups, "params": params}
