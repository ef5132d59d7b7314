"""Tiny random-init models of every supported family, built from configs (never downloaded)."""

from __future__ import annotations

import os

# Triton kernels run on CPU tensors only in its interpreter; set before anything imports triton
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import transformers

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_config(family: str, **overrides):
    """A 2-layer model small enough for float64 gradient checks in well under a second."""
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
    common.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    if family == "mistral":
        common.setdefault("sliding_window", None)
    return cls(**common)


def tiny_model(family: str, dtype=torch.float64, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    # random biases and norm weights, so that a wrong fold or a skipped term shows up
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model.train()


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param
