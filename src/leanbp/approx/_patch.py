"""``leanbp.approx(model)``: ReSiLU2/ReGELU2 activations and memory-sharing norms, patched in place.

Llama-family decoder (Llama, Mistral, Qwen2, Qwen3): each RMSNorm whose output feeds linear layers
becomes an MS-RMSNorm and its gamma is folded into those layers' input columns:

    input_layernorm          -> q_proj, k_proj, v_proj
    post_attention_layernorm -> gate_proj, up_proj
    model.norm (final)       -> lm_head (only when untied: a tied head shares its weight with the
                                embedding, which must not be scaled; the final norm then stays exact)

Qwen3's per-head q/k norms feed RoPE, not a linear layer, so there is nowhere to fold them: they
stay exact RMSNorms. With PEFT LoRA on a consuming linear, gamma is folded into the frozen base
weight and into every lora_A, so the function is unchanged and the LoRA input is the shared norm
output itself; apply ``approx`` after ``peft.get_peft_model`` so that PEFT's input cast (which
copies the input under autocast) can be turned off for those layers.

The change is reversible (:func:`unapprox`), and ``save_pretrained`` of an approximated model
writes an ordinary transformers checkpoint (weights unfolded, norm weights restored).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
from torch import nn

from ._activations import ReGELU2, ReSiLU2
from ._norms import MSRMSNorm

_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class _Fold:
    parent: nn.Module  # module holding the norm
    attr: str  # attribute name of the norm on parent
    norm: nn.Module  # the original norm (kept, with its gamma, for unfolding and restoring)
    weights: list[tuple[str, torch.Tensor]]  # (qualified name, weight whose columns were scaled)


@dataclass
class _ApproxState:
    activations: bool
    norms: bool
    folds: list[_Fold] = field(default_factory=list)
    acts: list[tuple[nn.Module, nn.Module]] = field(default_factory=list)  # (mlp, original act_fn)
    lora_casts: list[nn.Module] = field(default_factory=list)  # LoRA layers whose input cast we turned off
    notes: list[str] = field(default_factory=list)


def is_approximated(model: nn.Module) -> bool:
    return "_leanbp_approx" in vars(model)


def _consumer_weights(linear: nn.Module, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """Weights whose input columns multiply the norm output: a Linear's weight, or for a PEFT
    LoRA layer its base weight and every lora_A weight."""
    if isinstance(linear, nn.Linear):
        return [(f"{prefix}.weight", linear.weight)]
    if hasattr(linear, "base_layer") and hasattr(linear, "lora_A"):
        if getattr(linear, "use_dora", {}) and any(linear.use_dora.values()):
            raise NotImplementedError(f"{prefix}: DoRA adapters cannot be folded; use plain LoRA")
        out = [(f"{prefix}.base_layer.weight", linear.base_layer.weight)]
        out += [(f"{prefix}.lora_A.{name}.weight", a.weight) for name, a in linear.lora_A.items()]
        return out
    raise NotImplementedError(f"{prefix} is a {type(linear).__name__}; only nn.Linear and PEFT LoRA layers can be folded")


def _fold_norm(state, model_names, parent, attr, consumers):
    norm = getattr(parent, attr)
    gamma = norm.weight.detach()
    if bool((gamma == 0).any()):
        raise ValueError(f"{model_names[norm]} has a zero gamma entry; it cannot be folded and unfolded")
    weights = []
    for linear in consumers:
        weights += _consumer_weights(linear, model_names[linear])
    with torch.no_grad():
        for _, w in weights:
            w.mul_(gamma.to(w.dtype))  # W' = W diag(gamma): (out, in) * (in,)
    for linear in consumers:
        # PEFT casts a LoRA layer's input to lora_A's dtype; under autocast that makes lora_A save a
        # copy instead of the norm's output (the sharing is silently lost). When the adapter and
        # base weights share a dtype the cast is a no-op outside autocast, so it can be turned off.
        if getattr(linear, "cast_input_dtype_enabled", False) and all(
            a.weight.dtype == linear.base_layer.weight.dtype for a in linear.lora_A.values()
        ):
            linear.cast_input_dtype_enabled = False
            state.lora_casts.append(linear)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    setattr(parent, attr, MSRMSNorm(eps))
    state.folds.append(_Fold(parent, attr, norm, weights))


def approx(model: nn.Module, activations: bool = True, norms: bool = True) -> nn.Module:
    """Opt in to Approx-BP (``activations``: ReSiLU2/ReGELU2 backward, *approximate gradients*)
    and/or MS-BP (``norms``: memory-sharing norms with folded affines, exact gradients of the
    folded parameterization). Reversible with :func:`unapprox`. Composes with ``leanbp.stream``."""
    from ..engine import is_streamed, stream, unstream

    if is_approximated(model):
        raise ValueError("model is already approximated; call leanbp.unapprox(model) first")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _FAMILIES:
        raise NotImplementedError(
            f"leanbp.approx has no recipe for model_type={model_type!r}; supported: {', '.join(_FAMILIES)}"
        )
    restream = None
    if is_streamed(model):  # the engine records parameter names; re-stream after the norms change
        restream = model._leanbp_stream.config
        unstream(model)
    state = _ApproxState(activations=activations, norms=norms)
    names = {m: n for n, m in model.named_modules()}
    decoder = model.model
    if activations:
        act_name = getattr(model.config, "hidden_act", None)
        replacement = {"silu": ReSiLU2, "swish": ReSiLU2, "gelu": ReGELU2}.get(act_name)
        if replacement is None:
            raise NotImplementedError(f"hidden_act={act_name!r} has no 2-bit approximation (silu, gelu)")
        for layer in decoder.layers:
            state.acts.append((layer.mlp, layer.mlp.act_fn))
            layer.mlp.act_fn = replacement()
    if norms:
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            _fold_norm(state, names, layer, "input_layernorm", [attn.q_proj, attn.k_proj, attn.v_proj])
            _fold_norm(state, names, layer, "post_attention_layernorm", [mlp.gate_proj, mlp.up_proj])
        head = model.get_output_embeddings()
        if head.weight is model.get_input_embeddings().weight:
            state.notes.append("final norm kept exact: the LM head is tied to the embedding")
        else:
            _fold_norm(state, names, decoder, "norm", [head])
        if hasattr(decoder.layers[0].self_attn, "q_norm"):
            state.notes.append("q/k norms kept exact: they feed RoPE, not a linear layer")
    model._leanbp_approx = state
    model.save_pretrained = types.MethodType(_save_pretrained_unfolded, model)
    if restream is not None:
        stream(model, chunk_size=restream.chunk_size, head_chunk_size=restream.head_chunk_size)
    return model


def unapprox(model: nn.Module) -> nn.Module:
    """Undo :func:`approx`: original activations and norms, weights unfolded."""
    from ..engine import is_streamed, stream, unstream

    if not is_approximated(model):
        raise ValueError("model is not approximated")
    restream = model._leanbp_stream.config if is_streamed(model) else None
    if restream is not None:
        unstream(model)
    state: _ApproxState = vars(model).pop("_leanbp_approx")
    del model.save_pretrained
    with torch.no_grad():
        for fold in reversed(state.folds):
            gamma = fold.norm.weight.detach()
            for _, w in fold.weights:
                w.div_(gamma.to(w.dtype))
            setattr(fold.parent, fold.attr, fold.norm)
    for mlp, act in state.acts:
        mlp.act_fn = act
    for linear in state.lora_casts:
        linear.cast_input_dtype_enabled = True
    if restream is not None:
        stream(model, chunk_size=restream.chunk_size, head_chunk_size=restream.head_chunk_size)
    return model


def unfolded_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the unapproximated model, computed without touching the model."""
    state: _ApproxState = model._leanbp_approx
    names = {m: n for n, m in model.named_modules()}
    sd = dict(model.state_dict())
    for fold in state.folds:
        gamma = fold.norm.weight.detach()
        for name, w in fold.weights:
            sd[name] = w.detach() / gamma.to(w.dtype)
        sd[f"{names[fold.parent]}.{fold.attr}.weight".lstrip(".")] = gamma
    return sd


def _save_pretrained_unfolded(self, save_directory, *args, **kwargs):
    kwargs.setdefault("state_dict", unfolded_state_dict(self))
    return type(self).save_pretrained(self, save_directory, *args, **kwargs)
