"""The models ``leanbp bench`` measures: the Qwen3-shaped bench model of the core tables (also as a
Gemma3 or Qwen3-MoE model of the same sizes), and the Llama-shaped model of the Approx-BP rows."""

from __future__ import annotations

import transformers

from ..train import qwen3_config

# Qwen3-shaped model used by `leanbp bench` (hidden 512, 4 layers, 8 heads, 4 KV heads, head_dim 64,
# intermediate 1536, vocab 32000)
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

BENCH_MODELS = ("qwen3", "gemma3", "qwen3_moe")


def bench_config(family: str, max_positions: int):
    """The bench model of ``leanbp bench --model``: the Qwen3 bench shape, or the same sizes as a
    Gemma3 (text) model (3 sliding-window layers of 1024, then a global one, as Gemma3's 5:1
    pattern) or a Qwen3-MoE model (8 experts of a third of the dense width, 2 per token, with the
    load-balancing loss on); "llama": the Approx-BP rows' model."""
    if family == "qwen3":
        return qwen3_config(BENCH_QWEN3, max_positions=max_positions)
    if family == "llama":
        return transformers.LlamaConfig(**BENCH_LLAMA, max_position_embeddings=max_positions,
                                        attn_implementation="sdpa")
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


def nf4_reloaded(model, device: str):
    """``model`` saved and loaded again as a QLoRA user loads it: ``from_pretrained`` with
    bitsandbytes' nf4 and double quantization (every linear layer but the head; compute in the
    model's dtype), then PEFT's ``prepare_model_for_kbit_training`` without its checkpointing (each
    method sets its own)."""
    import tempfile

    import peft
    import torch

    dtype = next(model.parameters()).dtype
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        del model
        quantized = transformers.AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=quantization, dtype=dtype, device_map=torch.device(device).type)
    return peft.prepare_model_for_kbit_training(quantized, use_gradient_checkpointing=False)
