"""Float64 references for gradient checks against plain autograd.

transformers computes some pieces in float32 even in a float64 model (RMSNorm, the eager
attention's softmax, the causal-LM loss; TRL's fused head accumulates in float32), so "plain
transformers in float64" agrees with an exact computation only to ~1e-7. These helpers keep
float64 in float64 on the reference side (the functions computed are the same), so that a
comparison measures leanbp's chunking and nothing else."""

from __future__ import annotations

import contextlib
import copy
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..engine import IGNORE_INDEX
from ..models import adapter_class, adapter_for, supported_model_types
from ..streaming import accept_attention_implementation, stream


def patch_full_precision_norms(model: nn.Module) -> list[nn.Module]:
    """Make the norms in ``model`` keep float64 in float64 (transformers' RMSNorms downcast to
    float32 internally); returns the patched norms. The family adapter says which modules are norms
    and how they compute (e.g. Gemma's scale 1 + weight).

    Without this, a float64 model's norm backward rounds to float32, and any reordering of the same
    sums (which is all a chunked backward is) shows up as ~1e-7 differences that say nothing about
    the chunking. Used for verification only; the function computed is the same.

    Each norm gets a subclass of its class with the float64 forward (``restore_norms`` puts the
    class back), not an instance ``forward``: transformers (5.25 with the ``kernels`` package)
    re-kernelizes a model loaded by ``from_pretrained`` on every ``train()``/``eval()`` switch, and
    that drops any instance ``forward`` of a norm, so GRPO's generate-then-train loop used to run
    its norms in float32 from the first switch on.
    """
    family = adapter_class(model)
    patched = []
    for module in model.modules():
        forward = family.full_precision_norm(module)
        if forward is not None and not getattr(type(module), "_leanbp_full_precision", False):
            module.__class__ = _full_precision_class(type(module), forward)
            patched.append(module)
    return patched


def restore_norms(norms: list[nn.Module]) -> None:
    """Undo ``patch_full_precision_norms`` on the norms it returned."""
    for module in norms:
        if getattr(type(module), "_leanbp_full_precision", False):
            module.__class__ = type(module).__bases__[0]


_FULL_PRECISION_CLASSES: dict = {}


def _full_precision_class(cls: type, forward) -> type:
    key = (cls, forward.func, tuple(forward.keywords.items())) if isinstance(forward, partial) else (cls, forward)
    if key not in _FULL_PRECISION_CLASSES:
        _FULL_PRECISION_CLASSES[key] = type(cls.__name__, (cls,), {
            "forward": lambda self, *args, **kwargs: forward(self, *args, **kwargs),
            "_leanbp_full_precision": True, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _FULL_PRECISION_CLASSES[key]


_EXACT_EAGER = "leanbp_exact_eager"


def _exact_eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                           **kwargs):
    """transformers' eager attention (soft-capping included) with the softmax in the input dtype:
    the eager path computes it in float32, which a float64 check would measure instead of leanbp.
    query (B, Hq, T, D), key/value (B, Hkv, S, D); mask (B, 1, T, S) bool, True = may attend."""
    if dropout:
        raise ValueError("the float64 reference attention has no dropout")
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is None:  # transformers skips the mask when plain causal attention is all it says
        q = torch.arange(key.shape[-2] - query.shape[-2], key.shape[-2])[:, None]  # (T, 1), bottom-right
        k = torch.arange(key.shape[-2])[None]  # (1, S)
        window = kwargs.get("sliding_window")  # (skipped only where the window does not bind; kept exact)
        attention_mask = (k <= q) & ((k > q - window) if window else True)
    scores = scores.masked_fill(~attention_mask[..., : key.shape[-2]].to(scores.device), float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # a row that sees nothing: 0, as SDPA
    return (probs @ value).transpose(1, 2).contiguous(), probs


def _register_exact_eager() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_EXACT_EAGER, _exact_eager_attention)
    # boolean masks (True = may attend), as SDPA takes them; None when transformers skips the mask
    AttentionMaskInterface.register(_EXACT_EAGER, sdpa_mask)
    # plain softmax attention, computed exactly: a model configured with it streams as with "eager"
    accept_attention_implementation(_EXACT_EAGER)


@contextlib.contextmanager
def full_precision_norms(*models: nn.Module):
    """``patch_full_precision_norms`` for the duration of the block; models on the eager attention
    path (its softmax is float32) run ``_exact_eager_attention`` meanwhile."""
    patched = [norm for model in models for norm in patch_full_precision_norms(model)]
    eager = [m for m in models if getattr(getattr(m, "config", None), "_attn_implementation", None) == "eager"]
    if eager:
        _register_exact_eager()
    for model in eager:
        model.config._attn_implementation = _EXACT_EAGER
    try:
        yield
    finally:
        restore_norms(patched)
        for model in eager:
            model.config._attn_implementation = "eager"


def randomize_for_checks(model: nn.Module) -> nn.Module:
    """Random norm weights, biases and routers for a float64 check, so that a wrong fold or a skipped
    term shows up (transformers starts norms at 1, biases at 0 and routers at 0: every expert tied)."""
    offset = adapter_class(model).norm_weight_offset  # (norms that scale by 1 + weight: centred at 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0 if "bias" in name else 1.0 - offset, 0.3)
            elif ".gate." in name:
                p.normal_(0.0, 0.3)
    return model


def reference_causal_lm_loss(model: nn.Module, labels: torch.Tensor, num_items_in_batch=None, **inputs):
    """transformers' causal-LM loss from full logits (plus the load-balancing loss of a
    mixture-of-experts model that asks for it), without its float32 casts for float64 models."""
    routers = _routers(model)
    out = model(**inputs, **({"output_router_logits": True} if routers else {}))
    logits = out.logits.to(torch.promote_types(out.logits.dtype, torch.float32))  # (B, T, V)
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction)
    loss = loss / num_items_in_batch if num_items_in_batch is not None else loss
    if routers:
        aux = reference_load_balancing_loss(out.router_logits, routers[0], inputs.get("attention_mask"))
        loss = loss + model.config.router_aux_loss_coef * aux
    return loss


def _routers(model: nn.Module) -> list:
    """The routers of a mixture-of-experts model whose config asks for the load-balancing loss."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False) or config.model_type not in supported_model_types():
        return []
    adapter = adapter_for(model)
    return [r for r in map(adapter.router, adapter.layers()) if r is not None]


def reference_load_balancing_loss(router_logits, router, attention_mask=None) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` from every layer's (B*T, E) router logits, all at
    once and in the logits' dtype (transformers sums the probabilities in float32)."""
    logits = torch.cat(list(router_logits), 0)  # (L*B*T, E)
    probs = torch.softmax(logits, -1)
    chosen = torch.topk(probs, router.top_k, -1).indices  # (N, k)
    routed = F.one_hot(chosen, router.num_experts).sum(1).to(probs.dtype)  # (N, E)
    weights = torch.ones(len(logits), 1, dtype=probs.dtype, device=probs.device)
    if attention_mask is not None:
        weights = attention_mask.reshape(-1, 1).repeat(len(router_logits), 1).to(probs)
    rows = weights.sum()
    fraction = (routed * weights).sum(0) / rows
    return (fraction * ((probs * weights).sum(0) / rows)).sum() * router.num_experts


def streamed_vs_plain(model: nn.Module, labels: torch.Tensor, inputs: dict, stream_kwargs: dict | None = None,
                      ref_inputs: dict | None = None, num_items_in_batch=None, stream_target: nn.Module | None = None):
    """One float64 step of a deep copy of ``model`` with plain autograd and of ``model`` streamed
    (``stream_target``, default the model itself, is what gets streamed, e.g. the transformers
    model inside a PEFT wrapper), both with float64-preserving norms.

    Returns (reference model, reference loss, streamed loss); gradients are left on both models.
    ``ref_inputs`` lets the reference take its own leaf tensors (to compare input gradients)."""
    reference = copy.deepcopy(model)
    ref_loss = plain_step(reference, labels, ref_inputs if ref_inputs is not None else inputs, num_items_in_batch)
    loss = streamed_step(model, labels, inputs, stream_kwargs, num_items_in_batch, stream_target)
    return reference, ref_loss, loss


def plain_step(model: nn.Module, labels: torch.Tensor, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
    """The reference half of ``streamed_vs_plain``: ``model``'s loss with plain autograd, float64
    kept in float64, backpropagated (the gradients are left on ``model``)."""
    with full_precision_norms(model):
        loss = reference_causal_lm_loss(model, labels, num_items_in_batch=num_items_in_batch, **inputs)
        loss.backward()
    return loss


def streamed_step(model: nn.Module, labels: torch.Tensor, inputs: dict, stream_kwargs: dict | None = None,
                  num_items_in_batch=None, stream_target: nn.Module | None = None) -> torch.Tensor:
    """The streamed half of ``streamed_vs_plain``: ``model`` streamed (``stream_target``, default
    the model itself) with ``stream_kwargs``, its loss backpropagated (the gradients are left on it)."""
    with full_precision_norms(model):
        stream(stream_target if stream_target is not None else model, **(stream_kwargs or {}))
        loss = model(labels=labels, num_items_in_batch=num_items_in_batch, **inputs).loss
        loss.backward()
    return loss


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
