"""Streaming lives at the decoder: any head on ``last_hidden_state`` streams, packed rows attend
within their documents, PEFT works in either order, evaluation behaves as in transformers, and
nothing bypasses streaming silently."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

import leanbp
from conftest import tiny_model
from _helpers import make_batch
from leanbp.testing import full_precision_norms, reference_causal_lm_loss, relative_errors
from leanbp.engine import StreamedLayerFunction

TOL = 1e-12


def _worst(ref, model):
    errs = relative_errors(ref, model)
    assert errs, "no parameter gradients were compared"
    return max(errs.values())


class _CountLayers:
    """Counts StreamedLayerFunction.apply calls that build a graph (one per decoder layer per streamed
    training forward; stream()'s probe runs each layer once without one)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = StreamedLayerFunction.apply

        def counting(*args):
            self.calls += torch.is_grad_enabled()
            return original(*args)

        monkeypatch.setattr(StreamedLayerFunction, "apply", counting)


def _own_head_loss(model, ids, mask):
    """A user's own loss on the backbone output (not a causal-LM call)."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    weights = torch.linspace(-1, 1, hidden.shape[-1], dtype=hidden.dtype)
    return (hidden.sin() * weights).sum()


@pytest.mark.parametrize("family_name", ["llama", "qwen3"])
def test_any_head_on_the_backbone_streams_exactly(family_name, monkeypatch):
    model = tiny_model(family_name)
    reference = copy.deepcopy(model)
    ids, mask, _ = make_batch(padding="left")
    counter = _CountLayers(monkeypatch)
    with full_precision_norms(reference, model):
        _own_head_loss(reference, ids, mask).backward()
        leanbp.stream(model, chunk_size=7)
        _own_head_loss(model, ids, mask).backward()
    assert counter.calls == len(model.model.layers)
    assert _worst(reference, model) <= TOL


def test_call_without_labels_streams_its_decoder_and_returns_logits(monkeypatch):
    """A training call without labels (label smoothing, compute_loss_func) gets full logits, as
    asked, from a streamed decoder."""
    model = tiny_model("qwen2")
    reference = copy.deepcopy(model)
    ids, mask, labels = make_batch(padding="right")
    counter = _CountLayers(monkeypatch)

    def smoothed(m):
        logits = m(input_ids=ids, attention_mask=mask).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                 label_smoothing=0.1)

    with full_precision_norms(reference, model):
        smoothed(reference).backward()
        leanbp.stream(model, chunk_size=9)
        smoothed(model).backward()
    assert counter.calls == len(model.model.layers)
    assert _worst(reference, model) <= TOL


def _packed_batch(B=2, T=45, vocab=101, seed=3):
    """Rows holding several documents each (position_ids restart), boundaries differing per row,
    one at a chunk edge (7, 14, ...) and one document longer than a chunk. (transformers separates
    the documents only with use_cache=False, as TRL calls it: with a cache it ignores packing.)"""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    lengths = [[14, 3, 20, 8], [5, 1, 30, 9]][:B]
    pos = torch.cat([torch.cat([torch.arange(n) for n in row]).unsqueeze(0) for row in lengths])
    labels = ids.clone()
    labels[pos == 0] = -100  # a document's first token is not predicted from the previous one
    return ids, pos, labels


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("chunk_size", [7, 16])
def test_packed_rows_match_transformers_packed_path(B, chunk_size):
    model = tiny_model("qwen3")
    ids, pos, labels = _packed_batch(B=B)
    reference = copy.deepcopy(model)
    with full_precision_norms(reference, model):
        ref_loss = reference_causal_lm_loss(reference, labels, input_ids=ids, position_ids=pos, use_cache=False)
        ref_loss.backward()
        leanbp.stream(model, chunk_size=chunk_size, head_chunk_size=11)
        loss = model(input_ids=ids, position_ids=pos, labels=labels).loss
        loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
    assert _worst(reference, model) <= TOL


def test_packed_rows_differ_from_one_long_sequence():
    """The documents really are separated: treating the row as one sequence gives another loss."""
    model = tiny_model("llama")
    ids, pos, labels = _packed_batch(B=1)
    leanbp.stream(model, chunk_size=8)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, labels=labels).loss
        whole = model(input_ids=ids, labels=labels).loss
    assert abs(packed.item() - whole.item()) > 1e-3


@pytest.mark.parametrize("attention", ["blocks", "mask"])
def test_packed_rows_with_sliding_window(attention):
    model = tiny_model("mistral", sliding_window=6)
    ids, pos, labels = _packed_batch(B=2)
    reference = copy.deepcopy(model)
    with full_precision_norms(reference, model):
        reference_causal_lm_loss(reference, labels, input_ids=ids, position_ids=pos, use_cache=False).backward()
        leanbp.stream(model, chunk_size=5, attention=attention)
        model(input_ids=ids, position_ids=pos, labels=labels).loss.backward()
    assert _worst(reference, model) <= TOL


def test_position_ids_with_an_attention_mask_only_place_rope():
    """As in transformers: with an attention mask, restarting position ids do not split documents."""
    model = tiny_model("qwen3")
    ids, pos, labels = _packed_batch(B=2)
    mask = torch.ones_like(ids)
    reference = copy.deepcopy(model)
    with full_precision_norms(reference, model):
        reference_causal_lm_loss(reference, labels, input_ids=ids, position_ids=pos, attention_mask=mask).backward()
        leanbp.stream(model, chunk_size=6)
        model(input_ids=ids, position_ids=pos, attention_mask=mask, labels=labels).loss.backward()
    assert _worst(reference, model) <= TOL


def test_bad_shapes_get_clear_errors():
    model = tiny_model("qwen3")
    leanbp.stream(model)
    ids, mask, labels = make_batch(B=3)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(input_ids=ids, attention_mask=torch.ones(4, ids.shape[1], dtype=torch.long), labels=labels)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(input_ids=ids, attention_mask=torch.ones(1, ids.shape[1], dtype=torch.long), labels=labels)
    with pytest.raises(ValueError, match="position_ids must have shape"):
        model(input_ids=ids, position_ids=torch.arange(ids.shape[1] + 1)[None], labels=labels)
    with pytest.raises(ValueError, match="labels must have shape"):
        model(input_ids=ids, labels=labels[:, :-1])


def _lora(model):
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():  # lora_B starts at zero; make the adapters matter
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(hash(name) % 1000))
    return wrapped


@pytest.mark.parametrize("order", ["stream_then_peft", "peft_then_stream_wrapper", "peft_then_stream_inner"])
def test_lora_in_any_order(order, monkeypatch):
    ids, mask, labels = make_batch(padding="left")
    reference = _lora(tiny_model("qwen3"))
    counter = _CountLayers(monkeypatch)
    if order == "stream_then_peft":
        model = _lora(leanbp.stream(tiny_model("qwen3"), chunk_size=7, head_chunk_size=5))
    else:
        model = _lora(tiny_model("qwen3"))
        leanbp.stream(model if order.endswith("wrapper") else model.base_model.model, chunk_size=7, head_chunk_size=5)
    assert leanbp.is_streamed(model)
    with full_precision_norms(reference, model):
        reference_causal_lm_loss(reference, labels, input_ids=ids, attention_mask=mask).backward()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert counter.calls == 2
    errs = relative_errors(reference, model)
    assert errs and all("lora" in n for n in errs), sorted(errs)
    assert max(errs.values()) <= TOL


def test_trainable_parameters_outside_the_streamed_modules_are_an_error():
    model = tiny_model("llama")
    model.model.extra_scale = torch.nn.Parameter(torch.ones(()))  # trained, but no streamed module uses it
    leanbp.stream(model)
    ids, mask, labels = make_batch()
    with pytest.raises(RuntimeError, match="extra_scale"):
        model(input_ids=ids, attention_mask=mask, labels=labels)
    model.model.extra_scale.requires_grad_(False)
    assert torch.isfinite(model(input_ids=ids, attention_mask=mask, labels=labels).loss)


def test_eval_calls_with_labels_return_logits_unless_asked_not_to():
    model = tiny_model("qwen3").eval()
    ids, mask, labels = make_batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, labels=labels)
        leanbp.stream(model, chunk_size=8)
        got = model(input_ids=ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.loss, expected.loss.to(got.loss.dtype), rtol=1e-6, atol=0)
        leanbp.unstream(model)
        leanbp.stream(model, chunk_size=8, eval_logits=False)
        assert model(input_ids=ids, attention_mask=mask, labels=labels).logits is None
    model.train()  # a training step never returns full logits
    leanbp.unstream(model)
    leanbp.stream(model)
    assert model(input_ids=ids, attention_mask=mask, labels=labels).logits is None


def test_generate_runs_the_models_own_decoder(monkeypatch):
    model = tiny_model("llama", dtype=torch.float32).eval()
    ids = torch.randint(0, 101, (1, 6))
    expected = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    leanbp.stream(model)
    counter = _CountLayers(monkeypatch)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0), expected)
    assert counter.calls == 0


def test_gradient_checkpointing_switched_on_after_streaming_is_ignored_with_a_warning(monkeypatch):
    model = tiny_model("qwen3")
    reference = copy.deepcopy(model)
    ids, mask, labels = make_batch()
    leanbp.stream(model, chunk_size=7)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    counter = _CountLayers(monkeypatch)
    with full_precision_norms(reference, model):
        reference_causal_lm_loss(reference, labels, input_ids=ids, attention_mask=mask).backward()
        with pytest.warns(leanbp.StreamWarning, match="gradient checkpointing"):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert counter.calls == 2
    assert _worst(reference, model) <= TOL


def test_training_calls_that_cannot_stream_warn_once(monkeypatch):
    model = tiny_model("qwen3")
    leanbp.stream(model)
    ids, mask, labels = make_batch()
    counter = _CountLayers(monkeypatch)
    with pytest.warns(leanbp.StreamWarning, match="output_hidden_states"):
        out = model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    assert out.hidden_states is not None and counter.calls == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: no warning
        model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
        with torch.no_grad():  # no graph: the model's own decoder, nothing to warn about
            model.model(input_ids=ids, attention_mask=mask, output_attentions=True)


def test_streamed_model_pickles_and_stays_streamed(monkeypatch):
    model = tiny_model("qwen3")
    leanbp.stream(model, chunk_size=6)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert leanbp.is_streamed(loaded) and loaded._leanbp_stream.config.chunk_size == 6
    counter = _CountLayers(monkeypatch)
    ids, mask, labels = make_batch()
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask, labels=labels).loss,
                               model(input_ids=ids, attention_mask=mask, labels=labels).loss, rtol=0, atol=0)
    assert counter.calls == 4
    leanbp.unstream(loaded)
    assert not leanbp.is_streamed(loaded) and "forward" not in vars(loaded) and "forward" not in vars(loaded.model)


def test_float64_model_under_bf16_autocast_runs_as_plain_transformers():
    model = tiny_model("qwen3")
    ids, mask, labels = make_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        leanbp.stream(model, chunk_size=7)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-6 * abs(expected.item())


@pytest.mark.parametrize("family,rope_scaling,per_chunk", [
    ("qwen3", None, True),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}, True),
    ("llama", {"rope_type": "dynamic", "factor": 2.0}, False),  # rescaled by the longest position
])
def test_rope_rows_equal_the_whole_table(family, rope_scaling, per_chunk):
    """Each chunk's (cos, sin) are the rows of one call over all positions, bit for bit; only the
    position-local rotary types compute them per chunk (no (T, R) table kept)."""
    from leanbp.models import adapter_for

    extra = {} if rope_scaling is None else {"rope_scaling": rope_scaling}
    model = tiny_model(family, dtype=torch.float32, **extra)
    adapter = adapter_for(model)
    hidden = torch.zeros(2, 300, model.config.hidden_size)
    position_ids = torch.arange(300).unsqueeze(0)
    rope = adapter.position_embeddings(hidden, position_ids)[0]
    assert (rope._table is None) == per_chunk
    cos, sin = adapter.backbone().rotary_emb(hidden, position_ids)
    for s, e in [(0, 37), (37, 74), (259, 300)]:
        cos_c, sin_c = rope.rows(s, e)
        assert torch.equal(cos_c, cos[:, s:e]) and torch.equal(sin_c, sin[:, s:e])
