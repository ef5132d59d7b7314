"""What the engine promises besides exactness: gradients once, K/V once, nothing T*T or T*V,
reversible, checkpoints plain transformers can load, clear errors."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import leanbp
from conftest import tiny_model
from _helpers import make_batch


def test_each_parameter_gradient_arrives_once():
    model = tiny_model("qwen3", tie_word_embeddings=True)
    leanbp.stream(model, chunk_size=6, head_chunk_size=4)
    calls = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    ids, mask, labels = make_batch()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert calls == {name: 1 for name, _ in model.named_parameters()}


def test_no_per_chunk_prefix_recomputation():
    """K/V rows: each computed once in forward and at most twice in backward (once without a graph
    as a prefix for later chunks, once inside its own chunk's graph), never once per chunk."""
    model = tiny_model("llama")
    B, T, chunk = 3, 45, 6
    leanbp.stream(model, chunk_size=chunk)
    rows = {"k": 0, "q": 0}

    def counter(key):
        return lambda module, args, out: rows.__setitem__(key, rows[key] + args[0].shape[:-1].numel())

    for layer in model.model.layers:
        layer.self_attn.k_proj.register_forward_hook(counter("k"))
        layer.self_attn.q_proj.register_forward_hook(counter("q"))
    ids, mask, labels = make_batch(B=B, T=T)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    n_layers, last_chunk = len(model.model.layers), T - (T - 1) // chunk * chunk
    assert rows == {"k": n_layers * B * T, "q": n_layers * B * T}  # forward: every row once
    loss.backward()
    # backward: the prefix pass skips the last chunk's rows, the chunk graphs cover every row once
    assert rows == {"k": n_layers * B * (3 * T - last_chunk), "q": 2 * n_layers * B * T}


class _Shapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("padding", ["left", "none"])
def test_no_dense_mask_and_no_full_logits(padding):
    T, chunk, head_chunk = 128, 8, 16
    model = tiny_model("qwen2", dtype=torch.float32)  # vocab 101
    leanbp.stream(model, chunk_size=chunk, head_chunk_size=head_chunk)
    ids, mask, labels = make_batch(T=T, padding=padding, prompt=3)
    with _Shapes() as seen:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert seen.shapes
    V = model.config.vocab_size
    for shape in seen.shapes:
        assert sum(d >= T for d in shape) <= 1, f"T x T tensor {shape}"
        if shape and shape[-1] == V:
            rows = torch.Size(shape[:-1]).numel()
            assert rows <= head_chunk or shape == (V, model.config.hidden_size)[::-1], f"logits {shape}"


def test_unstream_restores_plain_forward():
    model = tiny_model("qwen3")
    ids, mask, labels = make_batch()
    plain = model(input_ids=ids, attention_mask=mask, labels=labels)
    leanbp.stream(model)
    streamed = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert streamed.logits is None
    leanbp.unstream(model)
    assert not leanbp.is_streamed(model)
    again = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert again.logits is not None
    torch.testing.assert_close(again.logits, plain.logits, rtol=0, atol=0)


def test_streamed_model_without_labels_returns_logits():
    model = tiny_model("llama")
    ids, mask, _ = make_batch()
    expected = model(input_ids=ids, attention_mask=mask).logits
    leanbp.stream(model)
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, expected, rtol=0, atol=0)


def test_save_pretrained_writes_a_plain_checkpoint(tmp_path):
    model = tiny_model("qwen3", dtype=torch.float32)
    leanbp.stream(model, chunk_size=5)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(loaded) is type(model) and not leanbp.is_streamed(loaded)
    for (name, p), (_, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)


def test_dropout_is_refused_in_training():
    model = tiny_model("llama", attention_dropout=0.1)
    leanbp.stream(model)
    ids, mask, labels = make_batch()
    with pytest.raises(NotImplementedError, match="attention_dropout=0.1"):
        model(input_ids=ids, attention_mask=mask, labels=labels)
    model.eval()  # dropout is off in eval: fine
    assert torch.isfinite(model(input_ids=ids, attention_mask=mask, labels=labels).loss)


def test_unsupported_model_family_is_named():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(NotImplementedError, match="model_type='gpt2'.*gemma2.*leanbp.stream\\(model, layers=False\\)"):
        leanbp.stream(model)


def test_unsupported_attention_implementation_and_options():
    model = tiny_model("qwen3", attn_implementation="flex_attention")
    with pytest.raises(NotImplementedError, match="flex_attention"):
        leanbp.stream(model)
    model = tiny_model("qwen3")
    leanbp.stream(model)
    with pytest.raises(ValueError, match="already streamed"):
        leanbp.stream(model)
    with pytest.raises(ValueError, match="chunk_size"):
        leanbp.stream(tiny_model("qwen3"), chunk_size=0)
