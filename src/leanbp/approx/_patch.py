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

ViT (pre-LayerNorm): layernorm_before -> q/k/v_proj, layernorm_after -> mlp.fc1, final layernorm
-> classifier; gamma goes into the weights and beta into the biases (b' = b + W beta).
BERT / RoBERTa (post-LayerNorm): a norm's output feeds linears *and* the next residual sum, so
the norm emits the plain normalized rows (saved once, shared with the linears) and the residual
branch multiplies gamma and adds beta back; the embedding LayerNorm (followed by dropout) and the
last layer's (read by task heads) stay exact. A LayerNorm beta cannot go through a LoRA adapter
(lora_A has no bias): such norms stay exact, and ``notes`` says so.

In full fine-tuning a folded gamma/beta is no longer a parameter of its own: it is absorbed into
the following weights (and, post-LN, kept fixed on the residual branch).

The change is reversible (:func:`unapprox`), and ``save_pretrained`` of an approximated model
writes an ordinary transformers checkpoint (weights unfolded, norm weights restored).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
from torch import nn

from ._activations import ReGELU2, ReSiLU2
from ._norms import MSLayerNorm, MSRMSNorm


@dataclass
class _Fold:
    parent: nn.Module  # module holding the norm
    attr: str  # attribute name of the norm on parent
    norm: nn.Module  # the original norm (kept, with its gamma/beta, for unfolding and restoring)
    # (weight name, weight, bias name, bias): each weight's input columns were scaled by gamma and
    # beta went into its bias (b' = b + W beta)
    consumers: list[tuple[str, torch.Tensor, str | None, torch.Tensor | None]]
    residual: nn.Module | None = None  # post-LN: the module whose residual input needs gamma, beta back


@dataclass
class _ApproxState:
    activations: bool
    norms: bool
    folds: list[_Fold] = field(default_factory=list)
    acts: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)  # (owner, attr, original)
    lora_casts: list[nn.Module] = field(default_factory=list)  # LoRA layers whose input cast we turned off
    notes: list[str] = field(default_factory=list)


@dataclass
class _NormSite:
    """A norm whose output feeds ``consumers`` (linear layers) and, for post-LN blocks, the
    residual input of ``residual`` (a module called as ``residual(hidden, input_tensor)``)."""

    parent: nn.Module
    attr: str
    consumers: list[nn.Module]
    residual: nn.Module | None = None


def is_approximated(model: nn.Module) -> bool:
    return "_leanbp_approx" in vars(model)


def _consumer_params(linear: nn.Module, prefix: str):
    """[(weight name, weight, bias name, bias)] whose input is the norm output: a Linear, or for
    a PEFT LoRA layer its base layer and every lora_A."""
    if isinstance(linear, nn.Linear):
        return [(f"{prefix}.weight", linear.weight, f"{prefix}.bias" if linear.bias is not None else None,
                 linear.bias)]
    if hasattr(linear, "base_layer") and hasattr(linear, "lora_A"):
        if getattr(linear, "use_dora", {}) and any(linear.use_dora.values()):
            raise NotImplementedError(f"{prefix}: DoRA adapters cannot be folded; use plain LoRA")
        base = linear.base_layer
        out = [(f"{prefix}.base_layer.weight", base.weight,
                f"{prefix}.base_layer.bias" if base.bias is not None else None, base.bias)]
        out += [(f"{prefix}.lora_A.{name}.weight", a.weight, None, None) for name, a in linear.lora_A.items()]
        return out
    raise NotImplementedError(f"{prefix} is a {type(linear).__name__}; only nn.Linear and PEFT LoRA layers can be folded")


def _foldable(site: _NormSite, names) -> str | None:
    """Why this norm cannot be folded, or None."""
    norm = getattr(site.parent, site.attr)
    gamma = norm.weight.detach()
    if bool((gamma == 0).any()):
        return f"{names[norm]} kept exact: a zero gamma entry cannot be folded and unfolded"
    beta = getattr(norm, "bias", None)
    if beta is not None and bool(beta.detach().ne(0).any()):
        for linear in site.consumers:
            if not isinstance(linear, nn.Linear):
                return f"{names[norm]} kept exact: its beta cannot be folded through LoRA adapters"
            if linear.bias is None:
                return f"{names[norm]} kept exact: {names[linear]} has no bias to take beta"
    return None


def _residual_with_affine(module: nn.Module, norm: nn.Module):
    """Post-LN: the residual branch gets gamma * n + beta back (no saved activation: gamma and
    beta are constants here, so the product needs only gamma for its backward)."""
    original = module.forward

    def forward(hidden_states, input_tensor, *args, **kwargs):
        input_tensor = input_tensor * norm.weight.detach().to(input_tensor.dtype)
        if getattr(norm, "bias", None) is not None:
            input_tensor = input_tensor + norm.bias.detach().to(input_tensor.dtype)
        return original(hidden_states, input_tensor, *args, **kwargs)

    module.forward = forward


def _fold_norm(state: _ApproxState, names, site: _NormSite) -> None:
    reason = _foldable(site, names)
    if reason is not None:
        state.notes.append(reason)
        return
    norm = getattr(site.parent, site.attr)
    gamma = norm.weight.detach()
    beta = getattr(norm, "bias", None)
    consumers = []
    for linear in site.consumers:
        consumers += _consumer_params(linear, names[linear])
    with torch.no_grad():
        for _, w, _, b in consumers:
            if beta is not None and b is not None:
                b.add_(w @ beta.detach().to(w.dtype))  # b' = b + W beta (W before scaling)
            w.mul_(gamma.to(w.dtype))  # W' = W diag(gamma): (out, in) * (in,)
    for linear in site.consumers:
        # PEFT casts a LoRA layer's input to lora_A's dtype; under autocast that makes lora_A save a
        # copy instead of the norm's output (the sharing is silently lost). When the adapter and
        # base weights share a dtype the cast is a no-op outside autocast, so it can be turned off.
        if getattr(linear, "cast_input_dtype_enabled", False) and all(
            a.weight.dtype == linear.base_layer.weight.dtype for a in linear.lora_A.values()
        ):
            linear.cast_input_dtype_enabled = False
            state.lora_casts.append(linear)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    ms = MSLayerNorm(eps) if isinstance(norm, nn.LayerNorm) else MSRMSNorm(eps)
    setattr(site.parent, site.attr, ms)
    if site.residual is not None:
        _residual_with_affine(site.residual, norm)
    state.folds.append(_Fold(site.parent, site.attr, norm, consumers, site.residual))


# -- family recipes: which norms feed which linears, and which activation to swap ------------------
def _llama_sites(model, notes):
    decoder, sites = model.model, []
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        sites.append(_NormSite(layer, "input_layernorm", [attn.q_proj, attn.k_proj, attn.v_proj]))
        sites.append(_NormSite(layer, "post_attention_layernorm", [mlp.gate_proj, mlp.up_proj]))
    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        notes.append("final norm kept exact: the LM head is tied to the embedding")
    else:
        sites.append(_NormSite(decoder, "norm", [head]))
    if hasattr(decoder.layers[0].self_attn, "q_norm"):
        notes.append("q/k norms kept exact: they feed RoPE, not a linear layer")
    return sites, [(layer.mlp, "act_fn") for layer in decoder.layers]


def _vit_sites(model, notes):
    vit = model.vit if hasattr(model, "vit") else model
    sites = []
    for layer in vit.layers:
        attn = layer.attention
        sites.append(_NormSite(layer, "layernorm_before", [attn.q_proj, attn.k_proj, attn.v_proj]))
        sites.append(_NormSite(layer, "layernorm_after", [layer.mlp.fc1]))
    if isinstance(getattr(model, "classifier", None), nn.Linear):
        sites.append(_NormSite(vit, "layernorm", [model.classifier]))
    else:
        notes.append("final layernorm kept exact: it feeds no linear layer leanbp can fold into")
    return sites, [(layer.mlp, "activation_fn") for layer in vit.layers]


def _bert_sites(model, notes):
    base = getattr(model, model.base_model_prefix, model)
    layers = base.encoder.layer
    sites = []
    for i, layer in enumerate(layers):
        # post-LN: each norm's output feeds linears *and* the next residual sum
        sites.append(_NormSite(layer.attention.output, "LayerNorm", [layer.intermediate.dense], layer.output))
        if i + 1 < len(layers):
            nxt = layers[i + 1].attention
            sites.append(_NormSite(layer.output, "LayerNorm", [nxt.self.query, nxt.self.key, nxt.self.value],
                                   nxt.output))
    notes.append("embedding and last-layer LayerNorms kept exact: dropout follows the first, "
                 "task heads read the second")
    return sites, [(layer.intermediate, "intermediate_act_fn") for layer in layers]


_RECIPES = {"llama": _llama_sites, "mistral": _llama_sites, "qwen2": _llama_sites, "qwen3": _llama_sites,
            "vit": _vit_sites, "bert": _bert_sites, "roberta": _bert_sites}
_ACTIVATIONS = {"silu": ReSiLU2, "swish": ReSiLU2, "gelu": ReGELU2}


def approx(model: nn.Module, activations: bool = True, norms: bool = True) -> nn.Module:
    """Opt in to Approx-BP (``activations``: ReSiLU2/ReGELU2 backward, *approximate gradients*)
    and/or MS-BP (``norms``: memory-sharing norms with folded affines, exact gradients of the
    folded parameterization). Reversible with :func:`unapprox`. Composes with ``leanbp.stream``.

    Families: Llama, Mistral, Qwen2, Qwen3 (pre-RMSNorm), ViT (pre-LayerNorm), BERT and RoBERTa
    (post-LayerNorm: the residual branch gets gamma and beta back)."""
    if is_approximated(model):
        raise ValueError("model is already approximated; call leanbp.unapprox(model) first")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _RECIPES:
        raise NotImplementedError(
            f"leanbp.approx has no recipe for model_type={model_type!r}; supported: {', '.join(sorted(_RECIPES))}"
        )
    state = _ApproxState(activations=activations, norms=norms)
    names = {m: n for n, m in model.named_modules()}
    sites, act_owners = _RECIPES[model_type](model, state.notes)
    if activations:
        act_name = getattr(model.config, "hidden_act", None)
        replacement = _ACTIVATIONS.get(act_name)
        if replacement is None:
            raise NotImplementedError(f"hidden_act={act_name!r} has no 2-bit approximation (silu, gelu)")
        for owner, attr in act_owners:
            state.acts.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, replacement())
    if norms:
        for site in sites:
            _fold_norm(state, names, site)
    model._leanbp_approx = state
    model.save_pretrained = types.MethodType(_save_pretrained_unfolded, model)
    return model  # a streamed model sees the new modules: it looks them up on every call


def unapprox(model: nn.Module) -> nn.Module:
    """Undo :func:`approx`: original activations and norms, weights unfolded."""
    if not is_approximated(model):
        raise ValueError("model is not approximated")
    state: _ApproxState = vars(model).pop("_leanbp_approx")
    del model.save_pretrained
    with torch.no_grad():
        for fold in reversed(state.folds):
            for _, w, _, b in fold.consumers:
                for target, value in zip((w, b), _unfolded(fold, w, b)):
                    if target is not None:
                        target.copy_(value)
            setattr(fold.parent, fold.attr, fold.norm)
            if fold.residual is not None:
                del fold.residual.forward
    for owner, attr, act in state.acts:
        setattr(owner, attr, act)
    for linear in state.lora_casts:
        linear.cast_input_dtype_enabled = True
    return model


def _unfolded(fold: _Fold, w: torch.Tensor, b: torch.Tensor | None):
    """(W, b) before folding: W = W' / gamma, b = b' - W beta."""
    gamma = fold.norm.weight.detach().to(w.dtype)
    w0 = w.detach() / gamma
    beta = getattr(fold.norm, "bias", None)
    b0 = None
    if b is not None:
        b0 = b.detach() - w0 @ beta.detach().to(w.dtype) if beta is not None else b.detach().clone()
    return w0, b0


def unfolded_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the unapproximated model, computed without touching the model."""
    state: _ApproxState = model._leanbp_approx
    names = {m: n for n, m in model.named_modules()}
    sd = dict(model.state_dict())
    for fold in state.folds:
        for w_name, w, b_name, b in fold.consumers:
            w0, b0 = _unfolded(fold, w, b)
            sd[w_name] = w0
            if b_name is not None:
                sd[b_name] = b0
        prefix = f"{names[fold.parent]}.{fold.attr}".lstrip(".")
        for pname, p in fold.norm.named_parameters():
            sd[f"{prefix}.{pname}"] = p.detach()
    return sd


def _save_pretrained_unfolded(self, save_directory, *args, **kwargs):
    kwargs.setdefault("state_dict", unfolded_state_dict(self))
    return type(self).save_pretrained(self, save_directory, *args, **kwargs)
