"""The model a run trains: a local model directory or config.json, or the built-in Qwen3-shaped
model (random init, byte-level vocabulary), so every command has a default that runs offline."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

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


def model_config(spec: str | None, seq_len: int):
    """The config of the model ``spec`` names (nothing else is read): a local directory or
    config.json, or the built-in model (None)."""
    if spec is None:
        return qwen3_config(TRAIN_QWEN3, max_positions=max(seq_len, 2048))
    path = Path(spec)
    if not ((path.is_file() and path.suffix == ".json") or path.is_dir()):
        raise FileNotFoundError(f"--model {spec!r} is neither a model directory nor a config .json file")
    try:
        return transformers.AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {spec}: not a transformers model ({str(e).splitlines()[0]})") from None


def load_model(spec: str | None, seq_len: int, dtype: torch.dtype, seed: int):
    """A transformers causal LM from a local directory or config.json, or the built-in Qwen3 model.
    A directory with weights is loaded; a bare config is built with random init (seeded)."""
    config = model_config(spec, seq_len)
    if spec is not None and Path(spec).is_dir() and (any(Path(spec).glob("*.safetensors"))
                                                    or any(Path(spec).glob("*.bin"))):
        return transformers.AutoModelForCausalLM.from_pretrained(str(spec), dtype=dtype)
    return build_model(config, dtype, seed)
