"""The check at stream() time: leanbp's layers and head against the model's own forward."""

from __future__ import annotations

import pytest
import torch
import transformers

import leanbp
from _helpers import make_batch
from conftest import tiny_model
from leanbp.models._llama import LlamaAdapter
from leanbp.testing import full_precision_norms, reference_causal_lm_loss


def test_an_adapter_that_computes_another_layer_is_refused(monkeypatch):
    """A test double of a wrong adapter: layer 1's MLP residual is off by a little."""
    mlp_residual = LlamaAdapter.mlp_residual

    def wrong(self, layer, hidden):
        out = mlp_residual(self, layer, hidden)
        return out * 1.01 if layer is self.layers()[1] else out

    monkeypatch.setattr(LlamaAdapter, "mlp_residual", wrong)
    model = tiny_model("llama")
    with pytest.raises(NotImplementedError, match="decoder layer 1 ") as refused:
        leanbp.stream(model)
    assert "decoder layer 0" not in str(refused.value) and "check=False" in str(refused.value)
    assert not leanbp.is_streamed(model)  # (refused before anything was installed)
    leanbp.stream(model, check=False)  # the opt-out
    assert leanbp.is_streamed(model)


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "phi3", "qwen3_moe"])
def test_every_family_passes_its_probe_in_16_bit_too(family):
    leanbp.stream(tiny_model(family, dtype=torch.bfloat16))


def _falcon_h1(multiplier=0.25):
    config = transformers.FalconH1Config(
        vocab_size=101, hidden_size=64, intermediate_size=80, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        mamba_chunk_size=32, lm_head_multiplier=multiplier)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)


def _llama4():
    config = transformers.Llama4TextConfig(
        vocab_size=101, hidden_size=64, intermediate_size=64, intermediate_size_mlp=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2, interleave_moe_layer_step=2)
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(config).to(torch.float64)


@pytest.mark.parametrize("build", [_falcon_h1, _llama4], ids=["falcon_h1", "llama4"])
def test_head_only_models_with_their_own_transform_or_backbone_are_exact(build):
    model = build().train()
    ids, mask, labels = make_batch(B=2, T=21, padding="none")
    with full_precision_norms(model):
        expected = reference_causal_lm_loss(model, labels, input_ids=ids).item()
    leanbp.stream(model, layers=False)
    with full_precision_norms(model):
        got = model(input_ids=ids, labels=labels).loss.item()
    assert got == pytest.approx(expected, rel=1e-10)


def test_a_head_transform_leanbp_does_not_know_is_refused_by_the_probe(monkeypatch):
    from leanbp.models import _head_only

    monkeypatch.delitem(_head_only._HEAD_SCALES, "falcon_h1")
    with pytest.raises(NotImplementedError, match="the logits"):
        leanbp.stream(_falcon_h1(), layers=False)
