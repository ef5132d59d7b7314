"""StreamBP is exact: float64 loss, input gradient and every parameter gradient equal plain autograd."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from _helpers import compare_step, make_batch

TOL = 1e-12


def assert_exact(loss_err, input_err, param_errs):
    assert loss_err <= TOL
    if input_err is not None:
        assert input_err <= TOL
    assert param_errs, "no parameter gradients were compared"
    worst = max(param_errs, key=param_errs.get)
    assert param_errs[worst] <= TOL, f"{worst}: relative error {param_errs[worst]:.3e}"


@pytest.mark.parametrize("padding", ["left", "right", "none"])
@pytest.mark.parametrize("chunk_size,head_chunk_size", [(7, 11), (64, 1000)])  # non-dividing; larger than T
def test_families_padding_chunks(family, padding, chunk_size, head_chunk_size):
    model = tiny_model(family)
    errs = compare_step(model, dict(chunk_size=chunk_size, head_chunk_size=head_chunk_size),
                        make_batch(padding=padding), embeds=True)
    assert_exact(*errs)


@pytest.mark.parametrize("window", [None, 5])
def test_single_mask_attention_path(window):
    """The one-SDPA-call-with-a-mask path (used off CPU) is exact too."""
    model = tiny_model("mistral", sliding_window=window)
    assert_exact(*compare_step(model, dict(chunk_size=7, attention="mask"), make_batch(padding="left"), embeds=True))


def test_batch_of_one_without_mask():
    model = tiny_model("qwen3")
    ids, _, labels = make_batch(B=1, padding="none")
    errs = compare_step(model, dict(chunk_size=10), (ids, None, labels))
    assert_exact(*errs)


def test_tied_embeddings():
    model = tiny_model("qwen3", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_exact(*compare_step(model, dict(chunk_size=9, head_chunk_size=5), make_batch()))


def test_qwen2_has_qkv_biases():
    model = tiny_model("qwen2")
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    loss_err, _, errs = compare_step(model, dict(chunk_size=8), make_batch())
    assert any(n.endswith("q_proj.bias") for n in errs)
    assert_exact(loss_err, None, errs)


@pytest.mark.parametrize("window,chunk_size", [(5, 7), (16, 6), (9, 64)])
def test_mistral_sliding_window(window, chunk_size):
    model = tiny_model("mistral", sliding_window=window)
    assert_exact(*compare_step(model, dict(chunk_size=chunk_size), make_batch(padding="left")))


def test_qwen3_sliding_layers():
    # only layers >= max_window_layers slide: layer 0 full, layer 1 sliding
    model = tiny_model("qwen3", use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert_exact(*compare_step(model, dict(chunk_size=8), make_batch(padding="right")))


def test_frozen_parameters_get_no_gradient():
    model = tiny_model("llama")
    for name, p in model.named_parameters():
        p.requires_grad_("q_proj" in name or "down_proj" in name)
    loss_err, _, errs = compare_step(model, dict(chunk_size=6), make_batch())
    assert set(errs) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert_exact(loss_err, None, errs)


def test_gradient_accumulation_num_items_in_batch():
    """k micro-batches with num_items_in_batch give the gradient of one big batch."""
    import copy

    import leanbp

    model = tiny_model("qwen3")
    ids, mask, labels = make_batch(B=4, padding="left")
    total = int((labels[:, 1:] != -100).sum())
    big = copy.deepcopy(model)
    leanbp.stream(big, chunk_size=7)
    big(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    leanbp.stream(model, chunk_size=7)
    for sl in (slice(0, 1), slice(1, 4)):
        out = model(input_ids=ids[sl], attention_mask=mask[sl], labels=labels[sl],
                    num_items_in_batch=torch.tensor(total))
        out.loss.backward()
    for (name, p), (_, q) in zip(big.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_num_items_in_batch_matches_reference():
    model = tiny_model("llama")
    assert_exact(*compare_step(model, dict(chunk_size=5), make_batch(), num_items_in_batch=torch.tensor(77)))


@pytest.mark.parametrize("family_name", ["llama", "qwen3"])
def test_head_only_mode(family_name):
    """layers=False: transformers' own decoder with leanbp's chunked head + loss."""
    model = tiny_model(family_name)
    assert_exact(*compare_step(model, dict(head_chunk_size=7, layers=False), make_batch(padding="left"),
                               embeds=True))


def test_head_only_mode_composes_with_gradient_checkpointing():
    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_exact(*compare_step(model, dict(head_chunk_size=7, layers=False), make_batch()))


def test_head_that_is_not_a_plain_linear_goes_through_autograd():
    """A wrapped head (as PEFT wraps one) takes the generic per-chunk autograd path; still exact."""

    class WrappedHead(torch.nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.linear = linear

        def forward(self, x):
            return self.linear(x)

    model = tiny_model("qwen2")
    model.lm_head = WrappedHead(model.lm_head)
    assert_exact(*compare_step(model, dict(chunk_size=8, head_chunk_size=6), make_batch(), embeds=True))


def test_peft_lora_model_streams_exactly():
    """PEFT first, then stream the wrapped transformers model: LoRA gradients match plain autograd."""
    peft = pytest.importorskip("peft")
    from leanbp.testing import relative_errors, streamed_vs_plain

    base = tiny_model("qwen3")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():  # lora_B starts at zero; make the adapters matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids, mask, labels = make_batch(padding="left")
    ref, _, _ = streamed_vs_plain(model, labels, dict(input_ids=ids, attention_mask=mask),
                                  dict(chunk_size=7, head_chunk_size=5), stream_target=model.base_model.model)
    errs = relative_errors(ref, model)
    assert errs and all("lora" in n for n in errs)
    assert max(errs.values()) <= 1e-12
