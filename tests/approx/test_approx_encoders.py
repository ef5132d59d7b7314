"""leanbp.approx on the encoder and vision models of the Approx-BP paper: ViT (pre-LN), BERT and
RoBERTa (post-LN, residual through the norm)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from leanbp.approx import MSLayerNorm, ReGELU2, approx, unapprox


def _vit():
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                    num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.ViTForImageClassification(config).double()
    inputs = {"pixel_values": torch.randn(3, 3, 16, 16, dtype=torch.float64)}
    return model, inputs


def _text(kind):
    torch.manual_seed(0)
    cls = {"bert": (transformers.BertConfig, transformers.BertForSequenceClassification),
           "roberta": (transformers.RobertaConfig, transformers.RobertaForSequenceClassification)}[kind]
    config = cls[0](vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                    intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, max_position_embeddings=64)
    model = cls[1](config).double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 99, (2, 17), generator=g)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _randomize_norms(model):
    """Pretrained norms are not identity: give every gamma and beta random values."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.normal_(1.0, 0.3)
                m.bias.normal_(0.0, 0.3)
    return model


MODELS = {"vit": _vit, "bert": lambda: _text("bert"), "roberta": lambda: _text("roberta")}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_function_unchanged_and_reversible(kind, tmp_path):
    model, inputs = MODELS[kind]()
    _randomize_norms(model).eval()
    original = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        before = model(**inputs).logits
    approx(model)
    assert any(isinstance(m, MSLayerNorm) for m in model.modules())
    assert any(isinstance(m, ReGELU2) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, before, rtol=1e-12, atol=1e-12)
    model.save_pretrained(tmp_path)  # an ordinary checkpoint
    loaded = type(model).from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert not any(isinstance(m, MSLayerNorm) for m in loaded.modules())
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, before, rtol=1e-12, atol=1e-12)
    unapprox(model)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, original[name], rtol=1e-13, atol=1e-15, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, before, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_norm_gradients_exact_for_the_folded_model(kind):
    """norms only: the input gradient equals the original model's (float64)."""
    model, inputs = MODELS[kind]()
    _randomize_norms(model)
    ref = copy.deepcopy(model)
    approx(model, activations=False)
    key = "pixel_values" if kind == "vit" else None
    if key is None:  # differentiate w.r.t. the word embeddings' output via inputs_embeds
        embeds = ref.get_input_embeddings()(inputs["input_ids"]).detach()
        ref_in, in_ = embeds.clone().requires_grad_(), embeds.clone().requires_grad_()
        ref_out = ref(inputs_embeds=ref_in, attention_mask=inputs["attention_mask"]).logits
        out = model(inputs_embeds=in_, attention_mask=inputs["attention_mask"]).logits
    else:
        ref_in = inputs[key].clone().requires_grad_()
        in_ = inputs[key].clone().requires_grad_()
        ref_out, out = ref(pixel_values=ref_in).logits, model(pixel_values=in_).logits
    w = torch.randn_like(out)
    (ref_out * w).sum().backward()
    (out * w).sum().backward()
    torch.testing.assert_close(in_.grad, ref_in.grad, rtol=1e-10, atol=1e-12)


def test_vit_norm_output_is_shared_with_qkv():
    model, inputs = _vit()
    approx(model.float(), activations=False)
    outs, keep = [], []

    def record(m, a, y):
        keep.append(y)
        outs.append(y.untyped_storage().data_ptr())

    for layer in model.vit.layers:
        layer.layernorm_before.register_forward_hook(record)
    counts = {}

    def pack(t):
        counts[t.untyped_storage().data_ptr()] = counts.get(t.untyped_storage().data_ptr(), 0) + 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(pixel_values=inputs["pixel_values"].float().requires_grad_())
    assert outs and all(counts[p] == 4 for p in outs)  # the MS norm + q, k, v: one storage


def test_bert_lora_with_nonzero_beta_keeps_norms_exact():
    peft = pytest.importorskip("peft")
    model, _ = _text("bert")
    _randomize_norms(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["query", "key", "value", "dense"]))
    approx(model.base_model.model, activations=False)
    notes = model.base_model.model._leanbp_approx.notes
    assert any("beta cannot be folded through LoRA" in n for n in notes)
