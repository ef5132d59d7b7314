"""Tiny random-init models of every supported family, built from configs (never downloaded)."""

from __future__ import annotations

import os

# Triton kernels run on CPU tensors only in its interpreter; set before anything imports triton
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import transformers

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # the Llama family: the deepest engine tests run on it

_TWO_KINDS = ["sliding_attention", "full_attention"]  # one local and one global layer
# per model_type: the config class and what it needs besides the common sizes. Every family the
# registry knows must be here (tests/test_families.py checks): adding a family = an adapter + a line.
_FAMILY_CONFIGS = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {}),
    # soft-capping small enough that tanh is far from linear; SDPA cannot soft-cap: eager
    "gemma2": (transformers.Gemma2Config, dict(query_pre_attn_scalar=24, sliding_window=16, layer_types=_TWO_KINDS,
                                               attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                                               attn_implementation="eager")),
    "gemma3_text": (transformers.Gemma3TextConfig, dict(query_pre_attn_scalar=24, sliding_window=16,
                                                        layer_types=_TWO_KINDS)),
    "phi3": (transformers.Phi3Config, dict(partial_rotary_factor=0.5, sliding_window=20, pad_token_id=0,
                                           bos_token_id=1, eos_token_id=2)),
    "olmo2": (transformers.Olmo2Config, dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # the second layer dense (mlp_only_layers), the load-balancing loss on with a large weight, and
    # the experts' eager loop (torch's grouped matmul has no float64 kernel)
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                    mlp_only_layers=[1], output_router_logits=True,
                                                    router_aux_loss_coef=0.5, experts_implementation="eager")),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                                                 output_router_logits=True, router_aux_loss_coef=0.5,
                                                 experts_implementation="eager")),
}
ALL_FAMILIES = tuple(_FAMILY_CONFIGS)


def tiny_config(family: str, **overrides):
    """A 2-layer model small enough for float64 gradient checks in well under a second."""
    cls, specific = _FAMILY_CONFIGS[family]
    common = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    common.update(specific)
    common.update(overrides)
    return cls(**common)


def tiny_model(family: str, dtype=torch.float64, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    # random biases and norm weights, so that a wrong fold or a skipped term shows up
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                # (Gemma's norms scale by 1 + weight: centred at 0 they still scale by about 1)
                centre = 0.0 if "bias" in name or config.model_type.startswith("gemma") else 1.0
                p.normal_(centre, 0.3)
            elif ".gate." in name:  # routers: transformers starts them at zero, i.e. every expert tied
                p.normal_(0.0, 0.3)
    return model.train()


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param
