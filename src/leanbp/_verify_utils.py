"""Helpers for float64 gradient checks against plain autograd."""

from __future__ import annotations

import contextlib
import copy
import types

import torch
import torch.nn.functional as F
from torch import nn


def _rmsnorm_full_precision(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # transformers' RMSNorm computes in float32 even for a float64 model; here float64 stays float64
    dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    x = hidden_states.to(dtype)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(hidden_states.dtype)


def patch_full_precision_norms(model: nn.Module) -> list[nn.Module]:
    """Make transformers' RMSNorms in ``model`` keep float64 in float64 (they downcast to float32
    internally); returns the patched norms.

    Without this, a float64 model's norm backward rounds to float32, and any reordering of the same
    sums (which is all a chunked backward is) shows up as ~1e-7 differences that say nothing about
    the chunking. Used for verification only; the function computed is the same.
    """
    patched = []
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rmsnorm_full_precision, module)
            patched.append(module)
    return patched


@contextlib.contextmanager
def full_precision_norms(*models: nn.Module):
    """``patch_full_precision_norms`` for the duration of the block."""
    patched = [norm for model in models for norm in patch_full_precision_norms(model)]
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def reference_causal_lm_loss(model: nn.Module, labels: torch.Tensor, num_items_in_batch=None, **inputs):
    """transformers' causal-LM loss from full logits, without its float32 cast for float64 models."""
    logits = model(**inputs).logits  # (B, T, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    targets = F.pad(labels, (0, 1), value=-100)[:, 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def streamed_vs_plain(model: nn.Module, labels: torch.Tensor, inputs: dict, stream_kwargs: dict | None = None,
                      ref_inputs: dict | None = None, num_items_in_batch=None, stream_target: nn.Module | None = None):
    """One float64 step of a deep copy of ``model`` with plain autograd and of ``model`` streamed
    (``stream_target``, default the model itself, is what gets streamed, e.g. the transformers
    model inside a PEFT wrapper), both with float64-preserving norms.

    Returns (reference model, reference loss, streamed loss); gradients are left on both models.
    ``ref_inputs`` lets the reference take its own leaf tensors (to compare input gradients)."""
    from .engine import stream

    reference = copy.deepcopy(model)
    with full_precision_norms(reference, model):
        ref_loss = reference_causal_lm_loss(reference, labels, num_items_in_batch=num_items_in_batch,
                                            **(ref_inputs if ref_inputs is not None else inputs))
        ref_loss.backward()
        stream(stream_target if stream_target is not None else model, **(stream_kwargs or {}))
        loss = model(labels=labels, num_items_in_batch=num_items_in_batch, **inputs).loss
        loss.backward()
    return reference, ref_loss, loss


def relative_errors(reference: nn.Module, candidate: nn.Module, floor: float = 1e-2) -> dict[str, float]:
    """||g_ref - g|| / max(||g_ref||, floor * ||all reference gradients||) for every parameter.

    A gradient that is zero in exact arithmetic (q/k of a layer whose tokens see only themselves,
    rows that reach no loss) comes out as float64 rounding noise, ~1e-16 of the total gradient norm,
    on both sides, and noise against noise has a relative error near 1. So a gradient smaller than
    ``floor`` of the total is compared at that scale: below a 1e-12 tolerance that still fails every
    error above 1e-14 of the total norm, a hundred times the rounding noise."""
    cand = dict(candidate.named_parameters())
    pairs = [(name, p.grad, cand[name].grad) for name, p in reference.named_parameters()
             if p.grad is not None or cand[name].grad is not None]
    total = sum(float(g.double().norm()) ** 2 for _, g, _ in pairs if g is not None) ** 0.5
    out = {}
    for name, ref_grad, grad in pairs:
        if ref_grad is None or grad is None:
            out[name] = float("inf")
            continue
        diff = (ref_grad.double() - grad.double()).norm().item()
        denom = max(ref_grad.double().norm().item(), floor * total)
        out[name] = diff / denom if denom > 0 else diff
    return out


class _ExactTrlLogProbs:
    """TRL's ``ChunkedLogProbFunction.apply``, computed from full logits with plain autograd in the
    input dtype. TRL's own kernel accumulates in fp32 even for a float64 model (~1e-7), so a float64
    comparison of "the same TRL trainer without leanbp" needs this in its place."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):
        z = F.linear(hidden, weight, bias) * logit_scale  # (N, V)
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        if final_logit_softcapping is not None:
            z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
        z = z / temperature
        logp_all = torch.log_softmax(z, -1)
        logprobs = logp_all.gather(-1, targets[:, None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1) if "entropy" in outputs else None
        with torch.no_grad():
            lss = torch.logsumexp(2 * logp_all, -1) if "log_sum_sq_probs" in outputs else None
            mean = z.mean(-1) if "mean_logits" in outputs else None
            top1 = z.argmax(-1) == targets if "is_top1" in outputs else None
        return logprobs, entropy, lss, mean, top1


@contextlib.contextmanager
def exact_trl_head():
    """Run TRL's fused LM head through ``_ExactTrlLogProbs`` (float64 stays float64)."""
    import trl.trainer.utils as trl_utils

    saved = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = _ExactTrlLogProbs
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction = saved
