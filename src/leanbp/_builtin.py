"""The built-in model shapes and the bundled text, so every command has a default that runs offline."""

from __future__ import annotations

import gzip
from importlib import resources

import torch
import transformers

# Qwen3-shaped model used by `leanbp bench` (issue bar: hidden 512, 4 layers, 8 heads, 4 KV heads,
# head_dim 64, intermediate 1536, vocab 32000)
BENCH_QWEN3 = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=32000,
)

# Llama-shaped model of the Approx-BP / MS-BP rows of `leanbp bench` (hidden 512, 4 layers,
# intermediate 1376, vocab 32000)
BENCH_LLAMA = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=1376,
    vocab_size=32000,
    tie_word_embeddings=False,
)

# Qwen3-shaped model trained by `leanbp train` with no arguments: byte-level vocabulary so that the
# bundled text needs no downloaded tokenizer
TRAIN_QWEN3 = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=768,
    vocab_size=256,
)


def bench_config(family: str, max_positions: int):
    """The bench model of ``leanbp bench --model``: the Qwen3 bench shape, or the same sizes as a
    Gemma3 (text) model (3 sliding-window layers of 1024, then a global one, as Gemma3's 5:1
    pattern) or a Qwen3-MoE model (8 experts of a third of the dense width, 2 per token, with the
    load-balancing loss on)."""
    if family == "qwen3":
        return qwen3_config(BENCH_QWEN3, max_positions=max_positions)
    common = dict(BENCH_QWEN3, max_position_embeddings=max_positions, tie_word_embeddings=False,
                  attn_implementation="sdpa")
    if family == "gemma3":
        layers = ["sliding_attention"] * (common["num_hidden_layers"] - 1) + ["full_attention"]
        return transformers.Gemma3TextConfig(**common, query_pre_attn_scalar=common["head_dim"], sliding_window=1024,
                                             layer_types=layers)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=common["intermediate_size"] // 3,
                                           output_router_logits=True, rope_theta=1_000_000.0)
    raise ValueError(f"unknown bench model {family!r}; choose from {BENCH_MODELS}")


BENCH_MODELS = ("qwen3", "gemma3", "qwen3_moe")


def qwen3_config(shape: dict, max_positions: int = 65536, **overrides) -> transformers.Qwen3Config:
    kwargs = dict(shape, max_position_embeddings=max_positions, tie_word_embeddings=False,
                  attn_implementation="sdpa", rope_theta=1_000_000.0)
    kwargs.update(overrides)
    return transformers.Qwen3Config(**kwargs)


def build_model(config, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def bundled_text() -> str:
    """Genesis and Ruth from the King James Bible (public domain), as shipped in leanbp/data."""
    data = resources.files("leanbp").joinpath("data/kjv_genesis_ruth.txt.gz").read_bytes()
    return gzip.decompress(data).decode("utf-8")
