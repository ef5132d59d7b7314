"""The check at ``stream()`` time: leanbp's computation against the model's own, on a short probe.

A family's adapter re-expresses transformers' layer (its projections, norms, residuals, attention)
and the head's logit transform; a config field no adapter reads, a modeling file that changed in a
new transformers release, or a head-only model whose logits are scaled in its own way would make a
streamed step differ from plain autograd without an error. No list of attributes catches them all,
so ``stream()`` runs both on a few rows and refuses where they differ:

* each streamed layer, run by the engine in small chunks (so the prefix attention is used) on the
  input the model's own forward gave that layer, against that layer's own output;
* the head: leanbp's logits (final norm, LM head, logit transform; in head-only mode on the
  backbone's output) against the model's own logits.

Cost: one forward of the model on 1 x 16 tokens and one streamed pass of each layer on them, in
evaluation mode and without a graph (milliseconds for the tiny models, a fraction of a second for
a 8B model on a GPU). Skipped where there is nothing to run: parameters on the meta device or fake
(``leanbp plan``), or sharded by FSDP2 or ZeRO-3. ``StreamConfig(check=False)`` turns it off.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..engine import decoder_layers, has_values

PROBE_ROWS = 16
PROBE_CHUNK = 5  # chunks [0, 5), [5, 10), [10, 15), [15, 16): every kind of prefix


def _tolerance(dtype: torch.dtype) -> float:
    """Relative error allowed between two exact computations in ``dtype`` that round differently
    (chunked against whole-sequence attention; transformers' float32 norms in a float64 model)."""
    return {torch.float64: 1e-5, torch.float32: 1e-3}.get(dtype, 6e-2)


def _roundest(module: nn.Module, output: torch.Tensor) -> torch.dtype:
    """The least precise floating dtype the computation of ``output`` by ``module`` rounds to: the
    output's, its floating parameters' (PEFT's LoRA adapters may be bf16 on a float32 model, as TRL
    casts them on a 4-bit one) and bitsandbytes' compute dtype (``compute_dtype``)."""
    dtypes = {output.dtype, *(p.dtype for p in module.parameters() if p.dtype.is_floating_point)}
    dtypes |= {d for m in module.modules() if isinstance(d := getattr(m, "compute_dtype", None), torch.dtype)}
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def _runnable(model: nn.Module) -> bool:
    """Whether every parameter holds its values here: not on the meta device, not fake (a planned
    step), not a DTensor shard (FSDP2), not partitioned by ZeRO-3 (``ds_id``)."""
    return all(p.device.type != "meta" and has_values(p.data) and not isinstance(p.data, DTensor)
               and not hasattr(p, "ds_id") for p in model.parameters())


@contextmanager
def _evaluation(model: nn.Module):
    """Every module in evaluation mode (no dropout, no router jitter: both sides compute one
    function), and back as it was. bitsandbytes' quantized linears keep their mode: in eval mode
    a call without a graph repacks their 4-bit weights for inference, which breaks the next
    training step's gradients."""
    modes = [(m, m.training) for m in model.modules()]
    for m in model.modules():
        if not type(m).__module__.startswith("bitsandbytes"):
            m.training = False
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class _LayerIO:
    """The input and output of each decoder layer in the model's own forward (forward hooks)."""

    def __init__(self, layers):
        self.inputs, self.outputs, self._handles = {}, {}, []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._before(i), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._after(i)))

    def _before(self, i):
        def hook(module, args, kwargs):
            self.inputs[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _after(self, i):
        def hook(module, args, output):
            self.outputs[i] = _first(output)
        return hook

    def remove(self):
        for h in self._handles:
            h.remove()


def _relative(ours: torch.Tensor, theirs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per row: |ours - theirs| / |scale| (B*T,), in float64."""
    diff = (ours.double() - theirs.double()).flatten(0, -2).norm(dim=-1)
    return diff / scale.double().flatten(0, -2).norm(dim=-1).clamp(min=1e-30)


def _differs(errors: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the probe's rows disagree beyond rounding: any row in float32/64; in 16-bit more
    than a quarter of the rows (a near-tie can route a row of a mixture-of-experts layer to other
    experts on either side, while a wrong adapter moves every row)."""
    bad = errors > _tolerance(dtype)
    if dtype in (torch.float64, torch.float32):
        return bool(bad.any())
    return bool(bad.float().mean() > 0.25)


def check_streamed(lm: nn.Module, adapter, layers: bool) -> None:
    """Refuse (``NotImplementedError``) where leanbp's layers or head compute other numbers than
    ``lm``'s own forward on a short probe (see the module's docstring)."""
    if not _runnable(lm):
        return
    embed = adapter.embed_tokens()
    vocab = getattr(embed, "num_embeddings", None) or lm.config.vocab_size
    device = embed.weight.device
    ids = torch.randint(0, vocab, (1, PROBE_ROWS), generator=torch.Generator().manual_seed(0)).to(device)
    decoder_layers_ = adapter.layers() if layers else []
    io = _LayerIO(decoder_layers_)
    try:
        with _evaluation(lm), torch.no_grad():
            own = lm(input_ids=ids, use_cache=False)
            problems = [p for i in range(len(decoder_layers_)) if (p := _layer_problem(adapter, i, io)) is not None]
            if not problems:  # (the head is only judged on layers that agree)
                head = _head_problem(lm, adapter, ids, own.logits, io, layers)
                problems = [head] if head is not None else []
    finally:
        io.remove()
    if problems:
        name = type(lm).__name__
        raise NotImplementedError(
            f"leanbp.stream: on a {PROBE_ROWS}-token probe, leanbp's computation of {name} differs from the "
            f"model's own forward: {'; '.join(problems)}. Streaming it would train on other numbers than "
            "the model computes. This family's modeling code may use a setting or a transformers version "
            "leanbp's adapter does not know (see docs/families.md); leanbp.stream(model, layers=False) "
            "streams only the head (which is checked as well). If you have verified the model otherwise, "
            "leanbp.stream(model, check=False) skips this check."
        )


def _layer_problem(adapter, i: int, io: _LayerIO) -> str | None:
    if i not in io.inputs or i not in io.outputs:
        return f"decoder layer {i} was not called by the model's forward"
    hidden, theirs = io.inputs[i], io.outputs[i]
    ours = decoder_layers(adapter, inputs_embeds=hidden, chunk_size=PROBE_CHUNK, layers=range(i, i + 1)).hidden
    if ours.shape != theirs.shape:
        return f"decoder layer {i} returns shape {tuple(ours.shape)}, the model's {tuple(theirs.shape)}"
    errors = _relative(ours, theirs, theirs - hidden)  # (relative to the layer's update of the rows)
    if _differs(errors, _roundest(adapter.layers()[i], theirs)):
        return f"decoder layer {i} (relative error {errors.max().item():.2e} of its update)"
    return None


def _head_problem(lm, adapter, ids, theirs: torch.Tensor, io: _LayerIO, layers: bool) -> str | None:
    n = len(io.outputs)
    if layers and n:
        hidden = adapter.final_norm()(io.outputs[n - 1])
    elif layers:
        hidden = adapter.final_norm()(adapter.embed_tokens()(ids))
    else:
        hidden = adapter.backbone()(input_ids=ids, use_cache=False).last_hidden_state
    transform = adapter.logit_transform()
    logits = transform.applied(adapter.lm_head()(hidden))
    if logits.shape != theirs.shape:
        return f"the logits have shape {tuple(logits.shape)}, the model's {tuple(theirs.shape)}"
    errors = _relative(logits, theirs, theirs)
    if _differs(errors, _roundest(adapter.lm_head(), theirs)):
        return (f"the logits (relative error {errors.max().item():.2e}; leanbp applies {transform} after "
                "the LM head)")
    return None


__all__ = ["PROBE_ROWS", "check_streamed"]
