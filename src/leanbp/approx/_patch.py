"""``leanbp.approx(model)``: ReSiLU2/ReGELU2 activations and memory-sharing norms, patched in place.

Which norms feed which linear layers, and which modules own the MLP activation, is the family's
knowledge (``FamilyAdapter.norm_sites`` / ``activation_owners`` in ``leanbp.models``). A pre-norm
whose output feeds only linear layers becomes an MS-RMSNorm / MS-LayerNorm and its gamma is folded
into those layers' input columns, e.g. for Llama:

    input_layernorm          -> q_proj, k_proj, v_proj
    post_attention_layernorm -> gate_proj, up_proj
    model.norm (final)       -> lm_head (only when untied: a tied head shares its weight with the
                                embedding, which must not be scaled; the final norm then stays exact)

A norm with nowhere to fold (per-head q/k norms feed RoPE; post-sublayer norms feed the residual
sum; a ``1 + weight`` scale) stays exact, and the adapter says why in ``notes``. With PEFT LoRA on
a consuming linear, gamma is folded into the frozen base weight and into every lora_A, so the
function is unchanged and the LoRA input is the shared norm output itself; apply ``approx`` after
``peft.get_peft_model`` so that PEFT's input cast (which copies the input under autocast) can be
turned off for those layers.

Pre-LayerNorm encoders (ViT): gamma goes into the weights and beta into the biases
(b' = b + W beta). Post-LayerNorm encoders (BERT / RoBERTa): a norm's output feeds linears *and*
the next residual sum, so the norm emits the plain normalized rows (saved once, shared with the
linears) and the residual branch multiplies gamma and adds beta back (``NormSite.residual``). A
LayerNorm beta cannot go through a LoRA adapter (lora_A has no bias): such norms stay exact, and
``notes`` says so.

In full fine-tuning a folded gamma/beta is no longer a parameter of its own: it is absorbed into
the following weights (and, post-LN, kept fixed on the residual branch).

The change is reversible (:func:`unapprox`), and ``save_pretrained`` of an approximated model
writes an ordinary transformers checkpoint (weights unfolded, norm weights restored). Weights that
were not trained since folding come back bit for bit (``_restore.FoldRecord``), also after the model
was moved or cast with ``.to`` (the kept norms follow the same conversion).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from .._patching import install, uninstall
from ..models import NormSite, approx_recipe_for
from ._activations import ReGELU2, ReSiLU2
from ._inverted import FUNCTIONS as INVERTIBLE, InvertedActivation, canonical
from ._norms import MSLayerNorm, MSRMSNorm
from ._restore import FoldRecord


@dataclass
class _Fold:
    parent: nn.Module  # module holding the norm
    attr: str  # attribute name of the norm on parent
    # the original norm, kept with its gamma/beta for unfolding and restoring. Not a submodule (its
    # parameters must not be trained or saved), so ``model.to`` does not reach it: ``restored_norm``
    # applies the conversion the consumers went through since folding
    norm: nn.Module
    # (weight name, bias name or None): each weight's input columns were scaled by gamma and beta
    # went into its bias (b' = b + W beta); names, looked up in the model when needed
    consumers: list[tuple[str, str | None]]
    records: list[FoldRecord]  # how to restore each consumer exactly
    dtype: torch.dtype  # the consumers' dtype and device when folded
    device: torch.device
    residual: nn.Module | None = None  # post-LN: the module whose residual input needs gamma, beta back

    def tensors(self, model: nn.Module):
        """[(weight, bias or None)] of the consumers, as they are now."""
        return [(model.get_parameter(w), model.get_parameter(b) if b else None) for w, b in self.consumers]

    def restored_norm(self, model: nn.Module) -> nn.Module:
        """A copy of the original norm, moved and cast as the model was since folding (the kept one
        stays as folded: its gamma is what the records undo)."""
        w = model.get_parameter(self.consumers[0][0])
        return copy.deepcopy(self.norm).to(device=w.device, dtype=w.dtype if w.dtype != self.dtype else None)


@dataclass
class _ApproxState:
    activations: str | None  # "2bit", "inverted" or None
    norms: bool
    folds: list[_Fold] = field(default_factory=list)
    acts: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)  # (owner, attr, original)
    lora_casts: list[nn.Module] = field(default_factory=list)  # LoRA layers whose input cast we turned off
    notes: list[str] = field(default_factory=list)


def is_approximated(model: nn.Module) -> bool:
    return "_leanbp_approx" in vars(model)


def _consumer_params(linear: nn.Module, prefix: str):
    """[(weight name, bias name or None)] whose input is the norm output: a Linear, or for a PEFT
    LoRA layer its base layer and every lora_A."""
    if isinstance(linear, nn.Linear):
        return [(f"{prefix}.weight", f"{prefix}.bias" if linear.bias is not None else None)]
    if hasattr(linear, "base_layer") and hasattr(linear, "lora_A"):
        if getattr(linear, "use_dora", {}) and any(linear.use_dora.values()):
            raise NotImplementedError(f"{prefix}: DoRA adapters cannot be folded; use plain LoRA")
        base = linear.base_layer
        out = [(f"{prefix}.base_layer.weight", f"{prefix}.base_layer.bias" if base.bias is not None else None)]
        out += [(f"{prefix}.lora_A.{name}.weight", None) for name in linear.lora_A]
        return out
    raise NotImplementedError(f"{prefix} is a {type(linear).__name__}; only nn.Linear and PEFT LoRA layers can be folded")


def _foldable(site: NormSite, names) -> str | None:
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


def _residual_forward(module, plain, norm, hidden_states, input_tensor, *args, **kwargs):
    """Post-LN: the residual branch gets gamma * n + beta back (no saved activation: gamma and
    beta are constants here, so the product needs only gamma for its backward)."""
    input_tensor = input_tensor * norm.weight.detach().to(input_tensor)
    if getattr(norm, "bias", None) is not None:
        input_tensor = input_tensor + norm.bias.detach().to(input_tensor)
    return plain(hidden_states, input_tensor, *args, **kwargs)


def _fold_norm(state: _ApproxState, model: nn.Module, names, site: NormSite) -> None:
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
    records = []
    with torch.no_grad():
        for w_name, b_name in consumers:
            w = model.get_parameter(w_name)
            b = model.get_parameter(b_name) if b_name else None
            g = gamma.to(w.dtype)
            original_w, original_b = w.detach().clone(), None if b is None else b.detach().clone()
            if beta is not None and b is not None:
                b.add_(w @ beta.detach().to(w.dtype))  # b' = b + W beta (W before scaling)
            w.mul_(g)  # W' = W diag(gamma): (out, in) * (in,)
            folded_b = b if beta is not None and b is not None else None
            records.append(FoldRecord(original_w, w, g, original_b if folded_b is not None else None, folded_b))
            del original_w, original_b
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
        install(site.residual, "forward", _residual_forward, bound=(norm,))
    first = model.get_parameter(consumers[0][0])
    state.folds.append(_Fold(site.parent, site.attr, norm, consumers, records, first.dtype, first.device,
                             site.residual))


_TWO_BIT = {"silu": ReSiLU2, "swish": ReSiLU2, "gelu": ReGELU2}
# how ``approx(activations=...)`` replaces the MLP activation: its 2-bit step-function backward, or
# the inverted form (the saved output and 1 bit per element)
ACTIVATION_MODES = ("2bit", "inverted")

# what the command lines offer: exact, the 2-bit activations, the memory-sharing norms, both, the
# inverted activations, and those with the norms
VARIANTS = ("none", "act", "norm", "both", "inverted", "inverted+norm")


def variant_settings(variant: str) -> dict:
    """The ``approx`` arguments of a variant name (``VARIANTS``)."""
    if variant not in VARIANTS:
        raise ValueError(f"approx must be one of {VARIANTS}, got {variant!r}")
    activations = "2bit" if variant in ("act", "both") else "inverted" if variant.startswith("inverted") else False
    return {"activations": activations, "norms": variant in ("norm", "both", "inverted+norm")}


def _activation_mode(activations) -> str | None:
    if activations is True:
        return "2bit"
    if activations is False or activations is None:
        return None
    if activations not in ACTIVATION_MODES:
        raise ValueError(f"activations must be True (= '2bit'), False or one of {ACTIVATION_MODES}, got {activations!r}")
    return activations


def _replacement(mode: str, act_name: str | None):
    """A factory of the module that replaces an MLP activation named ``act_name`` (ACT2FN)."""
    if mode == "2bit":
        module = _TWO_BIT.get(act_name)
        if module is None:
            raise NotImplementedError(
                f"the MLP activation {act_name!r} has no 2-bit approximation (silu, gelu); "
                "activations='inverted' covers silu, gelu and gelu_pytorch_tanh, and "
                "leanbp.approx(model, activations=False) still gives the memory-sharing norms")
        return module
    if act_name not in INVERTIBLE and act_name != "swish":
        raise NotImplementedError(f"the MLP activation {act_name!r} has no inverted form ({', '.join(INVERTIBLE)}); "
                                  "leanbp.approx(model, activations=False) still gives the memory-sharing norms")
    kind = canonical(act_name)
    return lambda: InvertedActivation(kind)


def approx(model: nn.Module, activations: bool | str = True, norms: bool = True) -> nn.Module:
    """Opt in to Approx-BP and/or MS-BP, in place; reversible with :func:`unapprox`; composes with
    ``leanbp.stream``.

    ``activations``: ``True`` or ``"2bit"``: ReSiLU2/ReGELU2, a 4-level step-function backward from
    2 bits per element; ``"inverted"``: Inverted Activations, the derivative from the saved output
    (shared with the next op) and 1 bit per element, within about 2.5e-4 of the exact one in fp32;
    ``False``: the exact activation. Both change gradients: *approximate*.
    ``norms``: memory-sharing norms with folded affines (exact gradients of the folded
    parameterization).

    Families: every family leanbp streams (``leanbp.models.supported_model_types()``), ViT, BERT and
    RoBERTa."""
    if is_approximated(model):
        raise ValueError("model is already approximated; call leanbp.unapprox(model) first")
    mode = _activation_mode(activations)
    recipe = approx_recipe_for(model)  # the family's adapter: fold sites and activation owners
    state = _ApproxState(activations=mode, norms=norms)
    names = {m: n for n, m in model.named_modules()}
    sites, act_owners = recipe.norm_sites(state.notes), recipe.activation_owners()
    if mode is not None:
        replacement = _replacement(mode, recipe.activation_name())
        for owner, attr in act_owners:
            state.acts.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, replacement())
    if norms:
        for site in sites:
            _fold_norm(state, model, names, site)
    model._leanbp_approx = state
    install(model, "save_pretrained", _save_pretrained_unfolded)
    return model  # a streamed model sees the new modules: it looks them up on every call


def unapprox(model: nn.Module) -> nn.Module:
    """Undo :func:`approx`: original activations and norms, weights unfolded."""
    if not is_approximated(model):
        raise ValueError("model is not approximated")
    state: _ApproxState = vars(model).pop("_leanbp_approx")
    uninstall(model, "save_pretrained", _save_pretrained_unfolded)
    with torch.no_grad():
        for fold in reversed(state.folds):
            for i, (w, b) in enumerate(fold.tensors(model)):
                for target, value in zip((w, b), _unfolded(fold, i, w, b)):
                    if target is not None:
                        target.copy_(value)
            setattr(fold.parent, fold.attr, fold.restored_norm(model))
            if fold.residual is not None:
                uninstall(fold.residual, "forward", _residual_forward)
    for owner, attr, act in state.acts:
        setattr(owner, attr, act)
    for linear in state.lora_casts:
        linear.cast_input_dtype_enabled = True
    return model


def _unfolded(fold: _Fold, i: int, w: torch.Tensor, b: torch.Tensor | None):
    """(W, b) of consumer ``i`` before folding: exactly the original while it was not trained since,
    else W = W' / gamma and b = b' - W beta."""
    w0 = fold.records[i].weight(w, fold.norm.weight.detach())
    beta = getattr(fold.norm, "bias", None)
    b0 = None
    if b is not None:
        b0 = fold.records[i].bias_or_none(b) if beta is not None else b.detach().clone()
        if b0 is None:
            b0 = b.detach() - w0 @ beta.detach().to(w0)
    return w0, b0


def unfolded_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the unapproximated model, computed without touching the model."""
    state: _ApproxState = model._leanbp_approx
    names = {m: n for n, m in model.named_modules()}
    sd = dict(model.state_dict())
    for fold in state.folds:
        for i, ((w_name, b_name), (w, b)) in enumerate(zip(fold.consumers, fold.tensors(model))):
            w0, b0 = _unfolded(fold, i, w, b)
            sd[w_name] = w0
            if b_name is not None:
                sd[b_name] = b0
        prefix = f"{names[fold.parent]}.{fold.attr}".lstrip(".")
        for pname, p in fold.restored_norm(model).named_parameters():
            sd[f"{prefix}.{pname}"] = p.detach()
    return sd


def _save_pretrained_unfolded(model, plain, save_directory, *args, **kwargs):
    kwargs.setdefault("state_dict", unfolded_state_dict(model))
    return plain(save_directory, *args, **kwargs)
