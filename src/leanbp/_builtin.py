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
