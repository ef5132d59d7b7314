"""The chunked head: per-token log-probs and entropy with exact gradients for any loss built from
them, TRL's logit transforms, the statistics without gradient, and batches with no label."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import leanbp
from conftest import tiny_model
from _helpers import make_batch
from leanbp.testing import full_precision_norms, reference_causal_lm_loss, relative_errors
from leanbp.engine import AutocastState
from leanbp.engine import HeadCall, LogitTransform, shift_labels, token_stats

TOL = 1e-12


def _reference_stats(model, hidden, targets, transform: LogitTransform):
    """Full (B, T, V) logits through plain autograd."""
    logits = model.lm_head(model.model.norm(hidden)) * transform.scale
    if transform.softcap is not None:
        logits = transform.softcap * torch.tanh(logits / transform.softcap)
    z = logits / transform.temperature
    logp_all = torch.log_softmax(z, -1)
    mask = targets != -100
    logp = logp_all.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1) * mask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return {"log_probs": logp, "entropy": entropy, "mean_logits": z.mean(-1) * mask,
            "log_sum_sq_probs": torch.logsumexp(2 * logp_all, -1) * mask,
            "is_top1": (z.argmax(-1) == targets) & mask}


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.5, softcap=3.0, temperature=0.7)],
                         ids=["plain", "scaled-softcapped-tempered"])
@pytest.mark.parametrize("head", ["linear", "wrapped"])
def test_token_stats_values_and_gradients(transform, head):
    """A DPO/GRPO-like loss of log-probs and entropy: gradients equal plain autograd's."""
    model = tiny_model("qwen3")
    if head == "wrapped":  # a head that is not a plain nn.Linear goes through autograd per chunk
        model.lm_head = torch.nn.Sequential(model.lm_head)
    ids, mask, labels = make_batch(padding="left")
    targets = shift_labels(labels)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    w_lp, w_ent = torch.randn(targets.shape, generator=g, dtype=torch.float64), torch.randn(targets.shape, generator=g,
                                                                                           dtype=torch.float64)
    stats = ("entropy", "mean_logits", "log_sum_sq_probs", "is_top1")
    with full_precision_norms(reference, model):
        ref_hidden = reference.model.embed_tokens(ids).detach().requires_grad_()
        ref_h = ref_hidden
        for layer in reference.model.layers:  # the layers themselves are not under test here
            ref_h = layer(ref_h, position_embeddings=reference.model.rotary_emb(ref_h, torch.arange(ref_h.shape[1])[None]))
        expected = _reference_stats(reference, ref_h, targets, transform)
        (expected["log_probs"] * w_lp + expected["entropy"] * w_ent).sum().backward()

        hidden = ref_hidden.detach().clone().requires_grad_()
        h = hidden
        for layer in model.model.layers:
            h = layer(h, position_embeddings=model.model.rotary_emb(h, torch.arange(h.shape[1])[None]))
        call = HeadCall(norm=model.model.norm, lm_head=model.lm_head, targets=targets, chunk_size=7,
                      autocast=AutocastState("cpu"), transform=transform)
        params = [p for m in (model.model.norm, model.lm_head) for p in m.parameters()]
        got = token_stats(h, call, stats, lambda: params)
        (got["log_probs"] * w_lp + got["entropy"] * w_ent).sum().backward()
    for name, value in expected.items():
        if name == "is_top1":
            assert torch.equal(got[name], value)
        else:
            torch.testing.assert_close(got[name], value.detach(), rtol=1e-12, atol=1e-12, msg=name)
    assert ((hidden.grad - ref_hidden.grad).norm() / ref_hidden.grad.norm()).item() <= TOL
    errs = relative_errors(reference, model)
    assert any("lm_head" in n for n in errs) and any("norm" in n for n in errs)
    assert max(errs.values()) <= TOL


def test_entropy_only_and_log_probs_only_gradients():
    model = tiny_model("llama")
    hidden = torch.randn(2, 9, 64, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 101, (2, 9))
    targets[0, :3] = -100
    for use in ("log_probs", "entropy"):
        call = HeadCall(norm=model.model.norm, lm_head=model.lm_head, targets=targets, chunk_size=4,
                      autocast=AutocastState("cpu"))
        got = token_stats(hidden, call, ("entropy",), list)
        expected = _reference_stats(model, hidden, targets, LogitTransform())
        (g_got,) = torch.autograd.grad(got[use].sum(), hidden)
        (g_ref,) = torch.autograd.grad(expected[use].sum(), hidden)
        torch.testing.assert_close(g_got, g_ref, rtol=1e-12, atol=1e-13, msg=use)


def test_a_batch_without_labels_gives_zero_gradients_not_nan():
    """transformers: nan loss, zero gradients. A NaN gradient would poison every weight."""
    model = tiny_model("qwen3")
    leanbp.stream(model, chunk_size=7)
    ids, mask, labels = make_batch()
    for batch_labels, n_items in ((torch.full_like(labels, -100), None), (labels[:, :1], None),
                                  (torch.full_like(labels, -100), torch.tensor(0))):
        model.zero_grad(set_to_none=True)
        batch_ids = ids[:, : batch_labels.shape[1]]
        loss = model(input_ids=batch_ids, labels=batch_labels, num_items_in_batch=n_items).loss
        assert torch.isnan(loss)
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.all(p.grad == 0), name


def test_num_items_zero_with_labelled_tokens_is_an_error():
    model = tiny_model("qwen3")
    leanbp.stream(model)
    ids, mask, labels = make_batch()
    with pytest.raises(ValueError, match="num_items_in_batch is 0"):
        model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=0)


def test_backward_twice_names_the_cause():
    model = tiny_model("qwen3")
    leanbp.stream(model)
    ids, mask, labels = make_batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="ran twice"):
        loss.backward()


def test_a_hand_written_dpo_loss_on_token_log_probs_is_exact():
    """Objectives on top of the streamed decoder: a sigmoid DPO loss from leanbp.token_log_probs
    (policy with gradients, reference without) equals the same loss from full logits."""
    policy, reference_policy = tiny_model("qwen3"), tiny_model("qwen3", seed=1)
    plain = copy.deepcopy(policy)
    ids, mask, labels = make_batch(B=4, padding="right")  # rows 0, 1 chosen; rows 2, 3 rejected

    def dpo(logps, ref_logps, beta=0.1):
        margin = (logps[:2] - ref_logps[:2]) - (logps[2:] - ref_logps[2:])
        return -F.logsigmoid(beta * margin).mean()

    def full_logps(model):  # plain transformers: full (B, T, V) logits
        targets = shift_labels(labels)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits, -1)
        return (logp.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1) * (targets != -100)).sum(-1)

    with full_precision_norms(plain, policy, reference_policy):
        with torch.no_grad():
            ref_logps = full_logps(reference_policy)
        dpo(full_logps(plain), ref_logps).backward()
        leanbp.stream(policy, chunk_size=7, head_chunk_size=5)
        leanbp.stream(reference_policy, chunk_size=7, head_chunk_size=5)
        with torch.no_grad():
            stream_ref = leanbp.token_log_probs(reference_policy, labels, input_ids=ids, attention_mask=mask)
        torch.testing.assert_close(stream_ref["log_probs"].sum(-1), ref_logps, rtol=1e-12, atol=1e-12)
        logps = leanbp.token_log_probs(policy, labels, input_ids=ids, attention_mask=mask)["log_probs"]
        dpo(logps.sum(-1), stream_ref["log_probs"].sum(-1)).backward()
    errs = relative_errors(plain, policy)
    assert errs and max(errs.values()) <= TOL


def test_zeroed_resident_gradients_are_summed_into_and_every_scale_stays_exact():
    """With gradients zeroed in place, every streamed Function sums into the parameter's own zero
    tensor (no second buffer: the head's is (V, H)); the loss holds the head's until backward. A
    scaled loss and a second micro-batch (non-zero gradients: fresh sums) stay exact."""
    ref = tiny_model("qwen3")
    model = copy.deepcopy(ref)
    ids, mask, labels = make_batch()
    for m in (ref, model):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    resident = {name: p.grad.data_ptr() for name, p in model.named_parameters()}
    with full_precision_norms(ref, model):
        leanbp.stream(model, chunk_size=7)
        for scale in (0.37, -2.0):
            for m in (ref, model):
                loss = (m(input_ids=ids, attention_mask=mask, labels=labels).loss if m is model
                        else reference_causal_lm_loss(m, labels, input_ids=ids, attention_mask=mask))
                if m is model and scale == 0.37:
                    assert model.lm_head.weight.grad is None  # taken over until backward
                (loss * scale).backward()
            if scale == 0.37:  # handed back, not copied
                assert {name: p.grad.data_ptr() for name, p in model.named_parameters()} == resident
            errs = relative_errors(ref, model)
            assert len(errs) == len(resident) and max(errs.values()) <= 1e-12, errs


def test_only_a_zero_gradient_that_owns_its_memory_is_taken_over():
    from leanbp.engine._grads import GradSum

    zero, nonzero, view, low = (torch.nn.Parameter(torch.ones(4, 3)) for _ in range(4))
    low.data = low.data.bfloat16()
    zero.grad = torch.zeros(4, 3)
    nonzero.grad = torch.zeros(4, 3)
    nonzero.grad[2, 1] = 1.0
    bucket = torch.zeros(20)  # an engine's flat buffer (DDP's gradient_as_bucket_view)
    view.grad = bucket[:12].view(4, 3)
    low.grad = torch.zeros(4, 3, dtype=torch.bfloat16)  # its sum is kept in fp32
    kept = {p: p.grad for p in (nonzero, view, low)}
    taken = zero.grad
    sums = GradSum([zero, nonzero, view, low])
    assert zero.grad is None and all(p.grad is g for p, g in kept.items())
    sums.add([torch.full((4, 3), 2.0)] * 4)
    out = sums.result(scale=0.5)
    assert out[0].data_ptr() == taken.data_ptr() and torch.equal(out[0], torch.ones(4, 3))
    assert all(o.data_ptr() != g.data_ptr() and torch.equal(o.float(), torch.ones(4, 3)) for o, g in zip(out[1:], kept.values()))
