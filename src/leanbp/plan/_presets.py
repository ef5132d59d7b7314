"""The shapes of the open models people ask ``leanbp plan`` about, as transformers config values.

Nothing is downloaded: each preset is the architecture part of the model's published
``config.json`` on the Hugging Face Hub (written from those files; the values that set memory and
FLOPs are here: widths, depth, heads, vocabulary, tying, the attention pattern, experts). The
parameter count each one gives is checked against the count its model card publishes
(``tests/plan/test_plan.py``), which catches a wrong width or depth. Values that change neither
memory nor work (RoPE scaling, dropout, initialiser ranges, token ids) are left at transformers'
defaults. A multimodal model (Gemma 3 4B/12B/27B) is planned as its text decoder
(``Gemma3ForCausalLM``, the ``text_config`` of its config.json): the vision tower (about 0.4 B
parameters) is not trained in text fine-tuning and is not in the count.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["PRESETS", "load_config"]


def _qwen3(hidden, layers, heads, inter, tied, kv=8):
    # Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B}/config.json
    return dict(model_type="qwen3", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=128, intermediate_size=inter, vocab_size=151936,
                tie_word_embeddings=tied, rope_theta=1_000_000.0)


def _llama(hidden, layers, heads, inter, vocab=128256, model_type="llama", tied=False, **extra):
    # meta-llama/Llama-3.1-{8B,70B}, Llama-3.2-{1B,3B}, mistralai/Mistral-7B-v0.3 config.json
    return dict(model_type=model_type, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=8, intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied,
                **extra)


def _qwen2(hidden, layers, heads, kv, inter, tied=False):
    # Qwen/Qwen2.5-{1.5B,7B,14B,32B,72B}/config.json
    return dict(model_type="qwen2", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, intermediate_size=inter, vocab_size=152064 if not tied else 151936,
                tie_word_embeddings=tied, rope_theta=1_000_000.0)


def _gemma2(hidden, layers, heads, kv, head_dim, inter, scalar):
    # google/gemma-2-{2b,9b,27b}/config.json: sliding (4096) and global layers alternate (layer_types
    # follows from the defaults), logits soft-capped at 30 and attention scores at 50
    return dict(model_type="gemma2", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, intermediate_size=inter, vocab_size=256000,
                query_pre_attn_scalar=scalar, sliding_window=4096, final_logit_softcapping=30.0,
                attn_logit_softcapping=50.0, tie_word_embeddings=True)


def _gemma3(hidden, layers, heads, kv, head_dim, inter, scalar, vocab=262208, window=1024):
    # google/gemma-3-1b-pt/config.json and the text_config of google/gemma-3-{4b,12b,27b}-pt: five
    # sliding-window layers, then a global one (transformers derives layer_types from that pattern)
    return dict(model_type="gemma3_text", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
                query_pre_attn_scalar=scalar, sliding_window=window, rope_theta=1_000_000.0,
                tie_word_embeddings=True)


PRESETS: dict[str, dict] = {
    "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, tied=True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, tied=True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, tied=True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, tied=False),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408, tied=False),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600, tied=False),
    # Qwen/Qwen3-30B-A3B/config.json: 128 experts of width 768 in every layer, 8 per token
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
                          tie_word_embeddings=False, rope_theta=1_000_000.0),
    "llama-3.2-1b": _llama(2048, 16, 32, 8192, tied=True, rope_theta=500_000.0),
    "llama-3.2-3b": _llama(3072, 28, 24, 8192, tied=True, rope_theta=500_000.0),
    "llama-3.1-8b": _llama(4096, 32, 32, 14336, rope_theta=500_000.0),
    "llama-3.1-70b": _llama(8192, 80, 64, 28672, rope_theta=500_000.0),
    "mistral-7b": _llama(4096, 32, 32, 14336, vocab=32768, model_type="mistral", rope_theta=1_000_000.0),
    "qwen2.5-1.5b": _qwen2(1536, 28, 12, 2, 8960, tied=True),
    "qwen2.5-7b": _qwen2(3584, 28, 28, 4, 18944),
    "qwen2.5-14b": _qwen2(5120, 48, 40, 8, 13824),
    "qwen2.5-32b": _qwen2(5120, 64, 40, 8, 27648),
    "qwen2.5-72b": _qwen2(8192, 80, 64, 8, 29568),
    "gemma2-2b": _gemma2(2304, 26, 8, 4, 256, 9216, 256),
    "gemma2-9b": _gemma2(3584, 42, 16, 8, 256, 14336, 256),
    "gemma2-27b": _gemma2(4608, 46, 32, 16, 128, 36864, 144),
    "gemma3-1b": _gemma3(1152, 26, 4, 1, 256, 6912, 256, vocab=262144, window=512),
    "gemma3-4b": _gemma3(2560, 34, 8, 4, 256, 10240, 256),
    "gemma3-12b": _gemma3(3840, 48, 16, 8, 256, 15360, 256),
    "gemma3-27b": _gemma3(5376, 62, 32, 16, 128, 21504, 168),
}


def load_config(model: str):
    """A transformers config from a preset name (``PRESETS``, any case), a model directory or a
    config.json."""
    import transformers

    preset = PRESETS.get(model.lower())
    if preset is not None:
        kwargs = dict(preset)
        return transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    path = Path(model)
    if path.is_dir() or (path.is_file() and path.suffix == ".json"):
        return transformers.AutoConfig.from_pretrained(str(path))
    raise FileNotFoundError(f"{model!r} is not a preset ({', '.join(PRESETS)}), a model directory or a config.json")
