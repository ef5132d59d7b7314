"""The peers of `leanbp bench --suite peers` are exact: float64 gradients of every parameter equal
plain autograd's, so their memory and time are those of a correct training step."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from leanbp.bench._peers import PEERS, peer_loss, prepare_peer
from leanbp.testing import full_precision_norms, plain_step, relative_errors

pytest.importorskip("deepspeed")


def _model():
    config = transformers.Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64).train()


@pytest.mark.parametrize("peer", list(PEERS))
def test_a_peer_gives_the_gradients_of_plain_autograd(peer):
    reference = _model()
    ids = torch.randint(0, 97, (2, 75), generator=torch.Generator().manual_seed(1))  # (T: 75 rows, 3 MLP tiles)
    labels = ids.clone()
    labels[:, :9] = -100  # (a prompt: the label count, not T, normalises)
    plain_step(reference, labels, {"input_ids": ids})
    model = prepare_peer(copy.deepcopy(reference), peer)
    model.zero_grad(set_to_none=True)
    with full_precision_norms(model):
        loss = peer_loss(model, ids, labels, tile_rows=16, peer=peer)  # (150 rows: 10 tiles, the last short)
        loss.backward()
    worst = max(relative_errors(reference, model).values())
    assert worst < 1e-12, (peer, worst)
    assert model.lm_head.weight.grad is not None and model.model.layers[0].mlp.up_proj.weight.grad is not None
