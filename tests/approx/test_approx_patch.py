"""leanbp.approx on real transformers models: function unchanged, reversible, plain checkpoints,
real memory sharing, and composition with the streamed engine."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import leanbp
from leanbp.approx import MSRMSNorm, ReSiLU2, approx, unapprox
from conftest import tiny_model
from _helpers import make_batch


def _logits(model, batch):
    """float64 logits (transformers' RMSNorm would round to float32 inside; see full_precision_norms)."""
    from leanbp.testing import full_precision_norms

    ids, mask, _ = batch
    with torch.no_grad(), full_precision_norms(model):
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("activations,norms", [(False, True), (True, False), (True, True)])
def test_folding_leaves_the_function_unchanged(family, activations, norms):
    model = tiny_model(family).eval()
    batch = make_batch()
    before = _logits(model, batch)
    approx(model, activations=activations, norms=norms)
    if norms:
        assert isinstance(model.model.layers[0].input_layernorm, MSRMSNorm)
    if activations:
        assert isinstance(model.model.layers[0].mlp.act_fn, ReSiLU2)
    torch.testing.assert_close(_logits(model, batch), before, rtol=1e-12, atol=1e-12)


def test_unapprox_restores_modules_and_weights():
    model = tiny_model("qwen3")
    original = copy.deepcopy(model.state_dict())
    approx(model)
    unapprox(model)
    assert not leanbp.is_approximated(model)
    assert type(model.model.layers[0].input_layernorm).__name__ == "Qwen3RMSNorm"
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, original[name], rtol=1e-15, atol=0, msg=name)


def test_qwen3_qk_norms_and_tied_final_norm_stay_exact():
    model = tiny_model("qwen3", tie_word_embeddings=True)
    approx(model)
    state = model._leanbp_approx
    assert type(model.model.norm).__name__ == "Qwen3RMSNorm"
    assert type(model.model.layers[0].self_attn.q_norm).__name__ == "Qwen3RMSNorm"
    assert any("tied" in n for n in state.notes) and any("q/k norms" in n for n in state.notes)


def test_save_pretrained_writes_a_plain_checkpoint(tmp_path):
    model = tiny_model("llama").eval()
    batch = make_batch()
    approx(model)
    expected = _logits(model, batch)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert type(loaded.model.layers[0].input_layernorm).__name__ == "LlamaRMSNorm"
    torch.testing.assert_close(_logits(loaded, batch), expected, rtol=1e-12, atol=1e-12)
    assert isinstance(model.model.layers[0].input_layernorm, MSRMSNorm)  # the model itself is untouched


def _storages_saved(model, batch, autocast=False):
    """data_ptr -> how many times autograd saved that storage in one forward."""
    counts: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        counts[ptr] = counts.get(ptr, 0) + 1
        return t

    ids, mask, labels = batch
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids=ids, attention_mask=mask, labels=labels)
    return counts


class _NormOutputs(list):
    """Storage addresses of each layer's input-norm output. The outputs are kept alive so that no
    later tensor can reuse an address during the forward."""

    def __init__(self, model):
        super().__init__()
        self.keep = []
        for layer in model.model.layers:
            layer.input_layernorm.register_forward_hook(self._record)

    def _record(self, module, args, y):
        self.keep.append(y)
        self.append(y.untyped_storage().data_ptr())


_norm_outputs = _NormOutputs


@pytest.mark.parametrize("autocast", [False, True])
def test_norm_output_is_the_tensor_the_next_linear_saves(autocast):
    model = approx(tiny_model("llama", dtype=torch.float32), activations=False)
    outs = _norm_outputs(model)
    counts = _storages_saved(model, make_batch(), autocast=autocast)
    assert outs
    for ptr in outs:
        # saved by the MS norm and by q_proj, k_proj, v_proj: one storage, four references
        assert counts[ptr] >= 4


@pytest.mark.parametrize("autocast", [False, True])
def test_sharing_survives_peft_lora(autocast):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("llama", dtype=torch.float32), peft.LoraConfig(
        r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    approx(model.base_model.model, activations=False)
    outs = _norm_outputs(model.base_model.model)
    counts = _storages_saved(model, make_batch(), autocast=autocast)
    # layer 0's input (a frozen embedding) needs no gradient: only the three lora_A save the output
    assert counts[outs[0]] == 3
    for ptr in outs[1:]:
        # the norm's saved output is the same storage every lora_A saves (base weights are frozen)
        assert counts[ptr] == 4


def test_frozen_consumers_cannot_share():
    """Nothing downstream saves the norm output when the next linears are frozen without LoRA:
    the norm's saved output is then its own cost (the same as an exact norm saving its input)."""
    model = approx(tiny_model("llama", dtype=torch.float32), activations=False)
    for name, p in model.named_parameters():
        p.requires_grad_("mlp" in name)
    outs = _norm_outputs(model)
    counts = _storages_saved(model, make_batch())
    assert outs[0] not in counts  # layer 0's input needs no gradient: nothing saved at all
    assert all(counts[ptr] == 1 for ptr in outs[1:])


def test_approx_composes_with_stream():
    """A streamed + approximated model gives exactly the approximated model's plain-autograd gradients."""
    from leanbp.testing import relative_errors, streamed_vs_plain

    model = approx(tiny_model("qwen3"))
    ids, mask, labels = make_batch(padding="left")
    ref, _, _ = streamed_vs_plain(model, labels, dict(input_ids=ids, attention_mask=mask),
                                  dict(chunk_size=7, head_chunk_size=5))
    errs = relative_errors(ref, model)
    assert errs and max(errs.values()) <= 1e-12


def test_approx_after_stream_restreams():
    model = leanbp.stream(tiny_model("llama"), chunk_size=9)
    approx(model)
    assert leanbp.is_streamed(model) and model._leanbp_stream.config.chunk_size == 9
    ids, mask, labels = make_batch()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_unsupported_family_is_named():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(NotImplementedError, match="gpt2"):
        approx(model)


# -- exact round trips and conversions (issue: dtype/device mixing, 1-ulp losses) ------------------

def _small_gamma_model(dtype):
    model = tiny_model("llama", dtype=torch.float32)
    with torch.no_grad():  # small gammas: the case where fold/unfold by division loses most
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.01, 0.08)
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unapprox_restores_every_weight_bit_for_bit(dtype):
    model = _small_gamma_model(dtype)
    original = copy.deepcopy(model.state_dict())
    approx(model)
    unapprox(model)
    for name, value in model.state_dict().items():
        assert value.dtype == original[name].dtype and torch.equal(value, original[name]), name


def test_cast_after_approx_is_the_cast_of_the_original(tmp_path):
    """approx, then model.to(float64): unapprox and save_pretrained give what .to(float64) of the
    original model gives, every tensor float64 (the kept norms follow the cast)."""
    model = _small_gamma_model(torch.float32)
    expected = copy.deepcopy(model).to(torch.float64).state_dict()
    approx(model)
    model.to(torch.float64)
    model.save_pretrained(tmp_path)
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).state_dict()
    unapprox(model)
    for name, value in expected.items():
        got = model.state_dict()[name]
        assert got.dtype == torch.float64 and torch.equal(got, value), name
        assert torch.equal(saved[name], value), name


def test_trained_weights_are_unfolded_by_division():
    model = tiny_model("llama")
    batch = make_batch()
    approx(model)
    ids, mask, labels = batch
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.1 * p.grad)
    expected = _logits(model, batch)
    unapprox(model)
    torch.testing.assert_close(_logits(model, batch), expected, rtol=1e-10, atol=1e-10)


def test_approximated_model_pickles(tmp_path):
    model = tiny_model("llama")
    approx(model)
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert leanbp.is_approximated(loaded)
    batch = make_batch()
    torch.testing.assert_close(_logits(loaded, batch), _logits(model, batch), rtol=0, atol=0)
    unapprox(loaded)
    assert type(loaded.model.layers[0].input_layernorm).__name__ == "LlamaRMSNorm"
