"""Shared pieces of the engine tests: a batch with padding and prompt masks, and the reference step."""

from __future__ import annotations

import copy

import torch

from leanbp._verify_utils import full_precision_norms, reference_causal_lm_loss, relative_errors


def make_batch(B=3, T=45, vocab=101, padding="left", prompt=13, seed=1):
    """Token ids, a padding mask (rows padded by different amounts) and prompt-masked labels whose
    prompt boundary falls inside a chunk."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if padding != "none":
        for b, n_pad in enumerate([5, 11, 0, 3][:B]):
            if n_pad:
                if padding == "left":
                    mask[b, :n_pad] = 0
                else:
                    mask[b, T - n_pad:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[:, :prompt] = -100
    return ids, mask, labels


def compare_step(model, stream_kwargs, batch, embeds=False, num_items_in_batch=None):
    """Loss, input gradient and all parameter gradients of leanbp vs plain autograd (float64 norms).

    Returns (loss error, input-gradient relative error, {param: relative error})."""
    import leanbp

    ids, mask, labels = batch
    ref = copy.deepcopy(model)
    with full_precision_norms(ref, model):
        kw = dict(attention_mask=mask)
        ref_in = model_in = None
        if embeds:
            ref_in = ref.get_input_embeddings()(ids).detach().requires_grad_()
            model_in = ref_in.detach().clone().requires_grad_()
            ref_kw, model_kw = dict(kw, inputs_embeds=ref_in), dict(kw, inputs_embeds=model_in)
        else:
            ref_kw = model_kw = dict(kw, input_ids=ids)
        ref_loss = reference_causal_lm_loss(ref, labels, num_items_in_batch=num_items_in_batch, **ref_kw)
        ref_loss.backward()
        leanbp.stream(model, **stream_kwargs)
        loss = model(labels=labels, num_items_in_batch=num_items_in_batch, **model_kw).loss
        loss.backward()
    loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    input_err = None
    if embeds:
        input_err = ((model_in.grad - ref_in.grad).norm() / ref_in.grad.norm()).item()
    return loss_err, input_err, relative_errors(ref, model)
