"""The conformance suite every registered family adapter runs (tiny configs in conftest.py).

Adding a family: write its adapter (with its ``tiny_config``) and register it; this file then
checks it like every other family: float64 gradients of every parameter against
plain autograd (padding left and right, a prompt boundary inside a chunk, a chunk size that does
not divide T, tied and untied heads, GQA), that the layers really streamed, low-precision error no
worse than plain autograd's, the mixture-of-experts load-balancing loss, and the approx patcher.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from conftest import ALL_FAMILIES, tiny_model
from _helpers import compare_step, make_batch

import leanbp
from leanbp.testing import (full_precision_norms, reference_causal_lm_loss, reference_load_balancing_loss,
                                  relative_errors, streamed_vs_plain)
from leanbp.testing import ChunkCounter
from leanbp.models import adapter_for, supported_model_types

MOE = ("qwen3_moe", "mixtral")


def _errors(model, labels, inputs, ref_inputs=None, **stream_kwargs):
    """{parameter: relative gradient error} of one float64 step, streamed vs plain autograd."""
    reference, _, _ = streamed_vs_plain(model, labels, inputs, stream_kwargs or dict(chunk_size=7),
                                        ref_inputs=ref_inputs)
    return relative_errors(reference, model)


def test_every_registered_family_builds_its_tiny_model():
    assert len(ALL_FAMILIES) >= 10
    for family in supported_model_types():
        model = tiny_model(family, window=16)
        assert model.config.model_type == family and adapter_for(model).model is model


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_adapter_is_what_the_engine_asks_for(family):
    """The engine states what it needs of a family as its own protocol; every registered adapter
    implements it (and is looked up by model_type, nothing else)."""
    from leanbp.engine import DecoderFamily

    adapter = adapter_for(tiny_model(family))
    assert isinstance(adapter, DecoderFamily)
    missing = [name for name in ("key_value", "chunk_forward", "position_embeddings", "row_working_set")
               if getattr(type(adapter), name) is getattr(DecoderFamily, name, None)]
    assert missing == []


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_family_streams_exactly_in_float64(family, padding, tied):
    model = tiny_model(family, window=16, tie_word_embeddings=tied)
    with ChunkCounter() as chunks:
        loss_err, _, errs = compare_step(model, dict(chunk_size=7, head_chunk_size=9), make_batch(padding=padding))
    layers = model.config.num_hidden_layers
    assert chunks.calls >= 2 * layers * 7  # forward + backward, 7 chunks of T=45 per layer: it streamed
    assert loss_err <= 1e-12
    assert max(errs.values()) <= 1e-12, {k: v for k, v in errs.items() if v > 1e-12}
    assert len(errs) == sum(1 for p in model.parameters() if p.requires_grad)  # every parameter got one


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_family_streams_packed_rows_and_inputs_embeds(family):
    """Packed rows (position_ids restarting, no mask; transformers packs only without a cache), and
    the gradient of inputs_embeds."""
    model = tiny_model(family, window=16)
    ids, _, labels = make_batch(B=2, padding="none")
    position_ids = torch.cat([torch.arange(20), torch.arange(25)]).expand(2, -1)
    inputs = dict(input_ids=ids, position_ids=position_ids)
    errs = _errors(model, labels, inputs, dict(inputs, use_cache=False), chunk_size=8, head_chunk_size=16)
    assert max(errs.values()) <= 1e-12, {k: v for k, v in errs.items() if v > 1e-12}
    _, input_err, errs = compare_step(tiny_model(family), dict(chunk_size=7), make_batch(), embeds=True)
    assert input_err <= 1e-12 and max(errs.values()) <= 1e-12


def _errors_vs_float64(family, dtype, autocast):
    base = tiny_model(family, window=16)
    ids, mask, labels = make_batch(padding="left")
    reference = copy.deepcopy(base)
    with full_precision_norms(reference):
        reference_causal_lm_loss(reference, labels, input_ids=ids, attention_mask=mask).backward()
    results = {}
    for name in ("plain", "leanbp"):
        model = copy.deepcopy(base).to(torch.float32 if autocast else dtype)
        if name == "leanbp":
            leanbp.stream(model, chunk_size=7, head_chunk_size=9)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        errs = relative_errors(reference, model)
        results[name] = sum(errs.values()) / len(errs)
    return results


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_family_low_precision_no_worse_than_plain_autograd(family, dtype, autocast):
    errs = _errors_vs_float64(family, dtype, autocast)
    assert errs["plain"] > 0
    assert errs["leanbp"] <= 1.25 * errs["plain"], errs


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True)], ids=["bf16", "autocast"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_family_low_precision_holds_where_onednn_has_no_bf16_path(monkeypatch, family, dtype, autocast):
    """The other branch of PyTorch's CPU probe: where oneDNN reports no bf16 support (CPUs without
    AVX512-BF16 / AMX) bf16 matmuls take ATen's own kernels, with other rounding. Forced here by
    switching oneDNN off, so that both branches run on any CPU (measured on qwen3 bf16: plain 9.88e-3
    both ways, leanbp 1.050e-2 with oneDNN and 1.055e-2 without)."""
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    errs = _errors_vs_float64(family, dtype, autocast)
    assert errs["plain"] > 0
    assert errs["leanbp"] <= 1.25 * errs["plain"], errs


@pytest.mark.parametrize("family", MOE)
def test_load_balancing_loss_and_its_gradient_are_exact(family):
    """The auxiliary loss alone: value and every gradient it reaches, against transformers' formula
    applied to the full router logits."""
    model = tiny_model(family)
    ids, mask, labels = make_batch(padding="left")
    reference = copy.deepcopy(model)
    with full_precision_norms(reference, model):
        out = reference(input_ids=ids, attention_mask=mask, output_router_logits=True)
        router = adapter_for(reference).router(reference.model.layers[0])
        ref_aux = reference_load_balancing_loss(out.router_logits, router, mask)
        ref_aux.backward()
        leanbp.stream(model, chunk_size=7)
        aux = model(input_ids=ids, attention_mask=mask, labels=labels).aux_loss
        aux.backward()
    assert abs(aux.item() - ref_aux.item()) <= 1e-12 * abs(ref_aux.item())
    # the reference formula is transformers' own (which sums in float32)
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    theirs = load_balancing_loss_func(out.router_logits, router.num_experts, router.top_k, mask)
    assert abs(theirs.item() - ref_aux.item()) <= 1e-6 * abs(ref_aux.item())
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        if p.grad is None:  # not reached by the aux loss (experts): the streamed layer returns zeros
            assert q.grad is None or not q.grad.any(), name
            q.grad = None
    errs = relative_errors(reference, model)
    assert errs, "the auxiliary loss reached no parameter"
    assert max(errs.values()) <= 1e-12, {k: v for k, v in errs.items() if v > 1e-12}
    gate = "model.layers.0.mlp.gate.weight"
    assert dict(model.named_parameters())[gate].grad.norm() > 0


def test_load_balancing_loss_off_when_not_asked():
    model = tiny_model("qwen3_moe", output_router_logits=False)
    leanbp.stream(model, chunk_size=7)
    ids, mask, labels = make_batch()
    assert getattr(model(input_ids=ids, attention_mask=mask, labels=labels), "aux_loss", None) is None
    out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    assert torch.isfinite(out.aux_loss)


@pytest.mark.parametrize("family,setting", [("mixtral", dict(router_jitter_noise=0.1)),
                                            ("gemma2", dict(attention_dropout=0.1))])
def test_random_training_ops_are_refused(family, setting):
    model = tiny_model(family, **setting)
    leanbp.stream(model)
    ids, mask, labels = make_batch()
    name = next(iter(setting))
    with pytest.raises(NotImplementedError, match=f"{name}=0.1"):
        model(input_ids=ids, attention_mask=mask, labels=labels)
    model.eval()  # off in evaluation: fine
    assert torch.isfinite(model(input_ids=ids, attention_mask=mask, labels=labels).loss)


def test_bidirectional_gemma3_is_refused():
    with pytest.raises(NotImplementedError, match="bidirectional"):
        leanbp.stream(tiny_model("gemma3_text", use_bidirectional_attention=True))


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_approx_through_the_family_adapter(family):
    """MS-norm folds where the family allows them (``notes`` says where not): the function is unchanged;
    with the 2-bit activations too, streaming the approximated model is exact against the same
    approximated model under plain autograd."""
    model = tiny_model(family)
    ids, mask, labels = make_batch()
    with full_precision_norms(model):  # (transformers' norms round to float32; MS norms do not)
        before = model(input_ids=ids, attention_mask=mask).logits
    leanbp.approx(model, activations=False)
    notes = model._leanbp_approx.notes
    with full_precision_norms(model):
        after = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, rtol=1e-10, atol=1e-10)
    folded = len(model._leanbp_approx.folds)
    assert folded or notes, "neither a fold nor a reason for keeping the norms exact"
    # then with the 2-bit activations where the family's activation has one (Gemma's tanh-GELU: refused)
    leanbp.unapprox(model)
    activations = adapter_for(model).activation_name() in ("silu", "gelu")
    if not activations:
        with pytest.raises(NotImplementedError, match="no 2-bit approximation"):
            leanbp.approx(copy.deepcopy(model))
    leanbp.approx(model, activations=activations)
    errs = _errors(model, labels, dict(input_ids=ids, attention_mask=mask))
    assert max(errs.values()) <= 1e-12, {k: v for k, v in errs.items() if v > 1e-12}


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).double()


def _neox():
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=101,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=0, hidden_dropout=0.0, attention_dropout=0.0,
        tie_word_embeddings=False)).double()


@pytest.mark.parametrize("build", [_gpt2, _neox], ids=["gpt2", "gpt_neox"])
def test_any_other_causal_lm_gets_the_chunked_head(build):
    model = build().train()
    with pytest.raises(NotImplementedError, match=r"leanbp.stream\(model, layers=False\)"):
        leanbp.stream(model)
    ids, mask, labels = make_batch()
    reference = copy.deepcopy(model)
    ref_loss = reference_causal_lm_loss(reference, labels, input_ids=ids, attention_mask=mask)
    ref_loss.backward()
    leanbp.stream(model, layers=False, head_chunk_size=9)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is None  # training: no (B, T, V) logits were built
    out.loss.backward()
    assert abs(out.loss.item() - ref_loss.item()) <= 1e-12 * abs(ref_loss.item())
    errs = relative_errors(reference, model)
    assert len(errs) == sum(1 for p in model.parameters())
    assert max(errs.values()) <= 1e-12, {k: v for k, v in errs.items() if v > 1e-12}
    leanbp.unstream(model)
    assert not leanbp.is_streamed(model)


def test_phi3_with_lora_on_its_fused_projections():
    """PEFT wraps qkv_proj / gate_up_proj: the fused projection runs whole (once per chunk) and the
    K/V of the prefix rows come from the wrapper's output."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("phi3", window=16), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"], init_lora_weights=False))
    ids, mask, labels = make_batch()
    errs = _errors(model, labels, dict(input_ids=ids, attention_mask=mask))
    assert len(errs) == 8 and max(errs.values()) <= 1e-12, errs  # A and B of 2 wrapped linears x 2 layers


def test_moe_with_a_frozen_router_and_trainable_experts():
    """The load-balancing loss's statistics then need no gradient in the first layer: backward skips them."""
    model = tiny_model("qwen3_moe")
    for name, p in model.named_parameters():
        p.requires_grad_(".experts." in name)
    ids, mask, labels = make_batch()
    leanbp.stream(model, chunk_size=7)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_head_only_model_asking_for_router_logits_runs_its_own_forward():
    """A model leanbp streams only the head of cannot add a load-balancing loss it knows nothing
    about: the call runs the model's own forward (with a warning), so nothing is silently dropped."""
    model = tiny_model("qwen3_moe")
    leanbp.stream(model, layers=False)
    ids, mask, labels = make_batch()
    with pytest.warns(leanbp.StreamWarning, match="output_router_logits"):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.aux_loss is not None and out.logits is not None
