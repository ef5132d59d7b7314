"""The forwards of a streamed model: which call streams, and what it returns.

Two forwards are replaced per instance (``_stream.py`` installs them):

* the backbone's (``model.model``, the call that returns ``last_hidden_state``): when it builds a
  graph, its layers run as the engine's streamed Functions and the final norm chunk by chunk, so
  any head on top streams (TRL's fused head, a user's own loss, the model's own logits);
* the causal LM's: calls with ``labels`` get leanbp's chunked cross-entropy, TRL's fused-head calls
  (``fused_lm_head=True``) leanbp's chunked per-token log-probs (``_fused_head.py``), neither
  building full logits; everything else runs the model's own forward (whose backbone call streams
  when it builds a graph).

Calls that need a cache, attentions or every layer's hidden states, or build no graph, run the
model's own decoder. A training call with gradients that cannot stream warns once and runs plain.
``token_log_probs`` is the same per-token head for a user's own objective.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from ..distributed import gathers_per_call
from ..engine import (IGNORE_INDEX, AutocastState, HeadCall, LogitTransform, SequenceGroup, check_attention_mask,
                      cross_entropy, decoder_layers, deepspeed_sequence_group, gather_over_group, rowwise,
                      shift_labels, shift_labels_across, sum_over_group, token_stats, trainable)
from ._fused_head import fused_head_spec, fused_output
from ._sequence import rows_of
from ._state import StreamState, causal_lm_of, state_of

# arguments that do not change what a streamed call computes: varlen metadata of packed rows (the
# documents are read from position_ids, as transformers' SDPA path does) and output formatting
_HARMLESS = ("return_dict", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
             "seq_idx")


CHECKPOINTING_IGNORED = (
    "gradient checkpointing is enabled on a streamed model; leanbp ignores it in streamed steps (StreamBP "
    "already keeps only each layer's input). Turn it off to silence this warning."
)


def checkpointing(adapter) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in (adapter.backbone(), *adapter.layers()))


def _arguments(module: nn.Module, args, kwargs) -> dict:
    """The call's arguments by name, bound to the class forward's signature."""
    if not args:
        return dict(kwargs)
    bound = inspect.signature(type(module).forward).bind_partial(module, *args, **kwargs).arguments
    bound.pop("self", None)
    extra = bound.pop("kwargs", {})
    return {**bound, **extra}


def _blocking(arguments: dict) -> list[str]:
    """Arguments that a streamed call cannot honour (each name once)."""
    data = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels", "num_items_in_batch",
            "shift_labels")
    out = []
    for name, value in arguments.items():
        if name in data or name in _HARMLESS or value is None or value is False:
            continue
        if name in ("use_cache", "logits_to_keep") and not value:  # off, or 0 (= every row): nothing asked
            continue
        out.append(name)
    mask = arguments.get("attention_mask")
    if mask is not None and (not torch.is_tensor(mask) or mask.dim() != 2):
        out.append("attention_mask (not a 2D padding mask)")
    return out


def _builds_graph(module: nn.Module, arguments: dict) -> bool:
    if not torch.is_grad_enabled():
        return False
    embeds = arguments.get("inputs_embeds")
    return (embeds is not None and embeds.requires_grad) or any(p.requires_grad for p in module.parameters())


def _check_training_call(state: StreamState, module: nn.Module, used: list[nn.Module]) -> None:
    """A streamed call that builds a graph: every trainable parameter of ``module`` must be in the
    modules the call uses, and nothing may draw random numbers in training (dropout, router jitter)."""
    adapter = state.adapter
    seen = {id(p) for m in used for p in m.parameters()}
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise RuntimeError(
            f"leanbp.stream: {missing[:4]}{' ...' if len(missing) > 4 else ''} need gradients but lie outside "
            "the modules a streamed step computes (embedding, decoder layers, final norm, LM head), so they "
            "would get none. Freeze them, or call leanbp.unstream(model)."
        )
    if module.training:
        random_ops = adapter.training_randomness()
        if random_ops:
            raise NotImplementedError(
                f"{', '.join(random_ops)} in training is not supported by leanbp.stream (a recomputed chunk "
                "would draw different random numbers); set it to 0.0 in the model's config"
            )
    if checkpointing(adapter):
        state.warn_once("checkpointing", CHECKPOINTING_IGNORED)
    if state.sequence is None and state.config.layers and deepspeed_sequence_group() is not None:
        raise RuntimeError(ULYSSES_WITHOUT_SEQUENCE_PARALLEL)


# DeepSpeed's Ulysses replaces the model's attention function; a streamed layer computes its
# attention itself, so without the exchange each rank's slice would attend only to itself
ULYSSES_WITHOUT_SEQUENCE_PARALLEL = (
    "DeepSpeed's Ulysses sequence parallelism is set up (accelerate's ParallelismConfig(sp_size=P) does it in "
    "prepare): each rank holds a slice of every sequence, and a model streamed without sequence_parallel would let "
    "each slice attend only to itself. Stream TRL's trainer with leanbp.integrations.trl.stream_trainer(trainer), "
    "which follows that split; or stream with sequence_parallel=True (it takes DeepSpeed's group) and give each rank "
    "its rows with leanbp.sequence_batch")


def _check_sequence_labels(state: StreamState, arguments: dict) -> None:
    """Under sequence parallelism leanbp shifts the labels across the ranks itself; labels shifted
    on each rank are DeepSpeed's data loader's, whose trainer weighs each rank's loss by that rank's
    label count (leanbp's loss is the whole sequence's on every rank) unless the model was streamed
    for that trainer (``presliced``), which must then pass them."""
    shifted = arguments.get("shift_labels") is not None
    if state.presliced and state.sequence is not None and not shifted and arguments.get("labels") is not None:
        raise ValueError("a model streamed for DeepSpeed's sequence-parallel data loader takes each rank's slice of "
                         "the labels shifted before slicing (shift_labels), as that loader gives them")
    if state.sequence is not None and not state.presliced and shifted:
        raise ValueError("shift_labels under sequence parallelism: leanbp shifts each rank's labels across the "
                         "ranks itself and returns the whole sequence's loss; pass this rank's rows of the unshifted "
                         "labels (leanbp.sequence_batch), or stream the trainer with leanbp.integrations.trl."
                         "stream_trainer, which follows its data loader")


def _check_presliced_aux(state: StreamState, with_aux: bool) -> None:
    if with_aux and state.presliced and state.sequence is not None:
        raise NotImplementedError("the load-balancing loss (output_router_logits) under DeepSpeed's sequence-parallel "
                                  "data loader: use stream_trainer(trainer, sequence_parallel=True) without "
                                  "parallelism_config, where it is exact")


def _presliced_call(state: StreamState, module: nn.Module) -> None:
    """``state.presliced``: a training call streams over DeepSpeed's sequence-parallel group (made by
    accelerate's ``prepare`` after the trainer was streamed, so found at the first call); any other
    call holds whole sequences and runs without it."""
    if not state.presliced:
        return
    if not (module.training and torch.is_grad_enabled()):
        state.sequence = None
    elif state.sequence is None:
        group = deepspeed_sequence_group()
        if group is None:
            raise RuntimeError("the model was streamed for DeepSpeed's sequence parallelism, but DeepSpeed has not set "
                               "up its sequence-parallel group (accelerate does in prepare, at trainer.train())")
        state.sequence = SequenceGroup.of(group)


def _bypass(state: StreamState, module: nn.Module, arguments: dict, reasons: list[str]) -> None:
    if module.training and _builds_graph(module, arguments):
        state.warn_once(
            "bypass:" + ",".join(reasons),
            f"leanbp: a training call with {reasons} cannot be streamed; it runs the model's own forward "
            "(plain autograd, full activations).",
        )


def backbone_forward(backbone: nn.Module, plain, *args, **kwargs):
    """The backbone forward: streamed layers and a chunked final norm when it builds a graph."""
    state = state_of(backbone)
    if state is None:
        return plain(*args, **kwargs)
    _presliced_call(state, backbone)
    arguments = _arguments(backbone, args, kwargs)
    if not _builds_graph(backbone, arguments):
        return plain(*args, **kwargs)
    reasons = _blocking(arguments)
    if reasons:
        _bypass(state, backbone, arguments, reasons)
        return plain(*args, **kwargs)
    from transformers.modeling_outputs import BaseModelOutputWithPast

    adapter = state.adapter
    _check_training_call(state, backbone, [adapter.embed_tokens(), *adapter.layers(), adapter.final_norm()])
    _warn_if_trl_head_outside(state, adapter.model)
    out = _decoder(state, arguments)
    hidden = rowwise(adapter.final_norm(), out.hidden, out.chunk_rows)
    return BaseModelOutputWithPast(last_hidden_state=hidden)


def _data(arguments: dict) -> dict:
    return {k: arguments.get(k) for k in ("input_ids", "inputs_embeds", "attention_mask", "position_ids")}


def _decoder(state: StreamState, arguments: dict, router_stats: bool = False):
    """The streamed decoder on the call's inputs, with the model's settings (the rows per chunk it
    chose are kept for ``chunk_size_used``)."""
    config = state.config
    out = decoder_layers(state.adapter, **_data(arguments), chunk_size=config.chunk_size,
                         chunk_memory=config.chunk_memory, attention=config.attention, offload=config.offload,
                         router_stats=router_stats, sequence=state.sequence)
    state.last_chunk_rows = out.chunk_rows
    return out


def _targets(state: StreamState, labels: torch.Tensor) -> torch.Tensor:
    """Row t's target is label t + 1 of the whole sequence (under sequence parallelism, the next
    rank's first label for this rank's last row)."""
    if state.presliced and state.sequence is not None:
        return labels  # (shifted before slicing: ``_check_sequence_labels`` made them shift_labels)
    if state.sequence is None:
        return shift_labels(labels)
    return shift_labels_across(state.sequence, labels, IGNORE_INDEX)


def _check_targets(arguments: dict, targets: torch.Tensor) -> None:
    """Labels must match (batch, seq), checked before any work is done."""
    rows = arguments.get("input_ids")
    rows = rows if rows is not None else arguments.get("inputs_embeds")
    if rows is not None and tuple(targets.shape) != tuple(rows.shape[:2]):
        raise ValueError(f"labels must have shape {tuple(rows.shape[:2])}, got {tuple(targets.shape)}")


def lm_forward(lm: nn.Module, plain, *args, **kwargs):
    """The causal-LM forward: leanbp's chunked head for ``labels`` and TRL fused-head calls."""
    state = state_of(lm)
    if state is None:
        return plain(*args, **kwargs)
    _presliced_call(state, lm)
    if kwargs.get("fused_lm_head"):
        spec = fused_head_spec(plain)
        if spec is None:  # nobody below handles fused calls the way TRL does: let them answer
            return plain(*args, **kwargs)
        arguments = _arguments(lm, args, {k: v for k, v in kwargs.items() if k != "fused_lm_head"})
        _check_sequence_labels(state, arguments)
        with_aux, reasons = _head_call_reasons(lm, state, arguments)
        if reasons or arguments.get("labels") is None and arguments.get("shift_labels") is None:
            _bypass(state, lm, arguments, reasons or ["no labels"])
            return plain(*args, **kwargs)
        return _fused_head_forward(lm, state, spec, arguments, with_aux)
    arguments = _arguments(lm, args, kwargs)
    _check_sequence_labels(state, arguments)
    if arguments.get("labels") is None:
        return plain(*args, **kwargs)  # the model's own forward; its backbone call streams
    with_aux, reasons = _head_call_reasons(lm, state, arguments)
    if reasons:
        _bypass(state, lm, arguments, reasons)
        return plain(*args, **kwargs)
    return _labels_forward(lm, state, arguments, with_aux)


def _head_call_reasons(lm: nn.Module, state: StreamState, arguments: dict) -> tuple[bool, list[str]]:
    """(does a call leanbp's head answers add the load-balancing loss, why it cannot be streamed).

    The loss is asked for by ``output_router_logits`` (the argument, else the config, as in
    transformers); leanbp adds it from router statistics gathered while streaming its layers, so a
    model whose routers it does not know (head-only mode) runs its own forward instead."""
    reasons = [r for r in _blocking(arguments) if r != "output_router_logits"]
    asked = arguments.get("output_router_logits")
    if asked is None:
        asked = getattr(lm.config, "output_router_logits", False)
    if not asked:
        return False, reasons
    if state.config.layers and any(state.adapter.router(layer) for layer in state.adapter.layers()):
        return True, reasons
    return False, reasons + ["output_router_logits"]


def _hidden_for_head(lm: nn.Module, state: StreamState, arguments: dict, router_stats: bool = False):
    """(hidden rows for the head, the norm the head applies first, whether the rows are scratch,
    the router statistics when asked for)."""
    adapter = state.adapter
    head_modules = [adapter.final_norm(), adapter.lm_head()]
    if not state.config.layers:
        ids = arguments.get("input_ids")
        rows = ids if ids is not None else arguments.get("inputs_embeds")
        if rows is not None:  # (a missing input is the backbone's error to raise)
            check_attention_mask(arguments.get("attention_mask"), rows.shape[0], rows.shape[1])
        out = adapter.backbone()(**_data(arguments), use_cache=False)
        return out.last_hidden_state, nn.Identity(), False, None
    if _builds_graph(lm, arguments):
        _check_training_call(state, lm, [adapter.embed_tokens(), *adapter.layers(), *head_modules])
    hidden, stats, rows = _decoder(state, arguments, router_stats)
    if gathers_per_call(adapter.final_norm()):
        # the head cannot apply the norm inside its own chunks without using the norm's parameters
        # outside the norm's calls: the norm gets its own (chunked) call; costs one (B, T, H) tensor
        return rowwise(adapter.final_norm(), hidden, rows), nn.Identity(), False, stats
    # the last layer's output is read by the head only: its buffer can hold the head's input gradient
    # (never the caller's inputs_embeds, which a model without layers would pass straight through)
    return hidden, adapter.final_norm(), len(adapter.layers()) > 0, stats


def _head_params(norm: nn.Module, lm_head: nn.Module) -> list[torch.Tensor]:
    return list(dict.fromkeys(trainable(norm) + trainable(lm_head)))


def _head_loss(state: StreamState, hidden: torch.Tensor, norm: nn.Module, scratch: bool, labels: torch.Tensor,
               denominator, defer_param_grads: bool = False) -> tuple[torch.Tensor, HeadCall]:
    """The causal-LM loss of ``hidden`` (the last layer's output; ``norm`` applied inside the head's
    chunks) against ``labels``: summed over labelled rows, divided by ``denominator`` (None: their
    count; under sequence parallelism, the whole sequence's)."""
    targets = _targets(state, labels.to(hidden.device))
    whole = state.sequence is not None and not state.presliced  # (the whole sequence's loss on every rank)
    if denominator is None:
        denominator = (targets != IGNORE_INDEX).sum()
        if whole:
            denominator = state.sequence.all_reduce_sum(denominator)
    elif torch.is_tensor(denominator):
        denominator = denominator.to(hidden.device)
    lm_head = state.adapter.lm_head()
    grad = torch.is_grad_enabled()
    call = HeadCall(norm=norm, lm_head=lm_head, targets=targets, chunk_size=state.config.head_chunk_size,
                    autocast=AutocastState(hidden.device.type), transform=state.adapter.logit_transform(),
                    input_is_scratch=scratch and grad, defer_param_grads=defer_param_grads)
    loss = cross_entropy(hidden, call, denominator, partial(_head_params, norm, lm_head))
    if whole:  # each rank backpropagates its rows' share
        loss = sum_over_group(loss, state.sequence, _grad_scale(state))
    return loss, call


def _grad_scale(state: StreamState) -> float:
    """What a rank's share of a sum over the group is multiplied by in backward: P for whole-sequence
    calls (the trainer's engine averages the ranks' gradients), else 1 (``reduce_sequence_gradients``
    sums them)."""
    return state.sequence.size if state.sequence is not None and state.whole_sequences else 1


def _labels_forward(lm: nn.Module, state: StreamState, arguments: dict, with_aux: bool):
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    if state.whole_sequences:  # (a trainer's whole sequences: this rank's rows of them)
        whole = {**_whole_inputs(state, arguments), "labels": arguments["labels"]}
        arguments = {**arguments, **rows_of(state.sequence, whole)}
    presliced = state.presliced and state.sequence is not None
    labels = arguments["shift_labels"] if presliced else arguments["labels"]
    _check_targets(arguments, labels)
    _check_presliced_aux(state, with_aux)
    hidden, norm, scratch, router_stats = _hidden_for_head(lm, state, arguments, router_stats=with_aux)
    # (under sequence parallelism num_items_in_batch is the whole sequence's)
    loss, call = _head_loss(state, hidden, norm, scratch, labels, arguments.get("num_items_in_batch"))
    lm_head, grad = call.lm_head, torch.is_grad_enabled()
    logits = None
    if not grad and not lm.training and state.config.eval_logits:
        with call.autocast():
            logits = lm_head(norm(hidden))  # (B, T, V): evaluation asked for them, as in transformers
        logits = call.transform.applied(logits)
    if router_stats is None:
        return CausalLMOutputWithPast(loss=loss, logits=logits)
    aux_loss = router_stats.loss(_grad_scale(state))
    # transformers weighs it with the model's attribute (set from the config when the model was built)
    coef = getattr(lm, "router_aux_loss_coef", None)
    loss = loss + (lm.config.router_aux_loss_coef if coef is None else coef) * aux_loss.to(loss.dtype)
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits)


def stage_hidden(model: nn.Module, layers: range, *, input_ids=None, inputs_embeds=None, attention_mask=None,
                 position_ids=None, owns_grad_out: bool = False) -> torch.Tensor:
    """The output of the streamed decoder layers ``layers`` of ``model`` (a pipeline stage's, before
    the final norm): on ``input_ids`` embedded when the range starts at layer 0, else on the previous
    layer's output ``inputs_embeds`` (B, T, H). Mask and positions are the whole batch row's.
    ``owns_grad_out``: the output's gradient will be a fresh tensor (the last stage's head gives
    one), which backward may overwrite; a received or caller's gradient is left alone."""
    lm = causal_lm_of(model)
    state = state_of(lm)
    if state is None or not state.config.layers:
        raise ValueError("a pipeline stage needs a model streamed with its layers (leanbp.stream(model))")
    if lm.training and torch.is_grad_enabled():  # (the stage's own parameters are all it trains)
        _check_training_call(state, lm, [lm])
    arguments = dict(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                     position_ids=position_ids)
    config = state.config
    out = decoder_layers(state.adapter, **arguments, chunk_size=config.chunk_size, chunk_memory=config.chunk_memory,
                         attention=config.attention, offload=config.offload, sequence=state.sequence, layers=layers,
                         owns_grad_out=owns_grad_out)
    state.last_chunk_rows = out.chunk_rows
    return out.hidden


def stage_loss(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, denominator,
               defer_param_grads: bool = False) -> torch.Tensor:
    """The causal-LM loss of the last layer's output ``hidden`` (a pipeline's last stage: final
    norm and LM head inside leanbp's chunked head, no full logits), summed over the labelled rows of
    ``labels`` and divided by ``denominator`` (the whole batch's count, so that micro-batches add up).
    ``defer_param_grads``: the head's parameter gradients wait for the weight pass (2BP), which
    recomputes the logits, instead of being summed in forward and held until then."""
    lm = causal_lm_of(model)
    state = state_of(lm)
    if state is None:
        raise ValueError("stage_loss needs a streamed model: call leanbp.stream(model) first")
    if tuple(labels.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"labels must have shape {tuple(hidden.shape[:2])}, got {tuple(labels.shape)}")
    return _head_loss(state, hidden, state.adapter.final_norm(), False, labels, denominator, defer_param_grads)[0]


def token_log_probs(model: nn.Module, labels: torch.Tensor, *, input_ids=None, inputs_embeds=None,
                    attention_mask=None, position_ids=None, stats: tuple[str, ...] = (), temperature: float = 1.0
                    ) -> dict[str, torch.Tensor]:
    """Per-token log-probabilities of the next-token ``labels`` under a streamed model, as (B, T)
    tensors with a real backward: row t is scored against ``labels[:, t + 1]``, as in a causal-LM
    loss; rows whose next label is -100 (and the last row) are 0. Under sequence parallelism the
    inputs, labels and results are this rank's rows; sums over a sequence go through
    ``sequence_sum``. Any objective built on them (DPO,
    GRPO, a weighted SFT loss) gets exact gradients; neither the decoder's activations nor the
    logits are kept for all T.

    ``stats`` adds "entropy" (differentiable), "log_sum_sq_probs", "mean_logits", "is_top1".
    """
    lm = causal_lm_of(model)
    state = state_of(lm)
    if state is None:
        raise ValueError("token_log_probs needs a streamed model: call leanbp.stream(model) first")
    arguments = dict(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                     position_ids=position_ids)
    transform = replace(state.adapter.logit_transform(), temperature=temperature)
    return _token_stats(lm, state, arguments, _targets(state, labels), transform, False, tuple(stats))[0]


def _token_stats(lm: nn.Module, state: StreamState, arguments: dict, targets: torch.Tensor,
                 transform: LogitTransform, fp32_head: bool, stats: tuple[str, ...], with_aux: bool = False):
    """(per-token statistics, the load-balancing loss when ``with_aux`` else None)."""
    _check_targets(arguments, targets)
    hidden, norm, scratch, router_stats = _hidden_for_head(lm, state, arguments, router_stats=with_aux)
    lm_head = state.adapter.lm_head()
    call = HeadCall(norm=norm, lm_head=lm_head, targets=targets.to(hidden.device),
                    chunk_size=state.config.head_chunk_size, autocast=AutocastState(hidden.device.type),
                    transform=transform, fp32_head=fp32_head, input_is_scratch=scratch and torch.is_grad_enabled())
    out = token_stats(hidden, call, stats, partial(_head_params, norm, lm_head))
    return out, None if router_stats is None else router_stats.loss(_grad_scale(state))


def _fused_head_forward(lm: nn.Module, state: StreamState, spec, arguments: dict, with_aux: bool):
    """TRL's ``fused_lm_head=True`` call, answered by leanbp's chunked per-token head with TRL's
    settings (temperature, logit scale, soft-capping, fp32 head, requested outputs)."""
    pre_shifted = arguments.get("shift_labels")
    targets = pre_shifted if pre_shifted is not None else shift_labels(arguments["labels"])
    _check_presliced_aux(state, with_aux)
    if state.sequence is None or state.presliced:  # (a slice's results are the slice's)
        stats, aux_loss = _token_stats(lm, state, arguments, targets, spec.transform, spec.fp32_head, spec.outputs,
                                       with_aux)
    else:
        stats, aux_loss = _whole_sequence_stats(lm, state, spec, arguments, targets, with_aux)
    if pre_shifted is None:  # TRL scores rows 0..T-2 against labels 1..T-1
        stats = {name: t[:, :-1] for name, t in stats.items()}
        targets = targets[:, :-1]
    # TRL weighs the load-balancing loss with the config's coefficient (its trainers set it there)
    aux = None if aux_loss is None else (aux_loss, getattr(lm.config, "router_aux_loss_coef", 0.0))
    return fused_output(stats, targets.to(stats["log_probs"].device) != IGNORE_INDEX,
                        arguments.get("num_items_in_batch"), aux)


def _whole_sequence_stats(lm: nn.Module, state: StreamState, spec, arguments: dict, targets: torch.Tensor,
                          with_aux: bool):
    """A fused-head call under sequence parallelism: TRL passes whole sequences and reads the
    per-token results by their position in them (its masks, advantages and sums are (B, T)), so
    this rank scores its rows of the targets (shifted over the whole sequence first) and the
    results are gathered. Memory: what crosses ranks is (B, T) per statistic, not the logits."""
    sp = state.sequence
    if not state.whole_sequences:
        raise NotImplementedError("TRL's fused-head calls on a model streamed with sequence_parallel: stream the "
                                  "trainer instead, leanbp.integrations.trl.stream_trainer(trainer, "
                                  "sequence_parallel=...), which hands each rank its rows of TRL's whole sequences")
    T = targets.shape[1]
    rows = rows_of(sp, {**_whole_inputs(state, arguments), "labels": targets})
    local_targets = rows.pop("labels")
    stats, aux_loss = _token_stats(lm, state, {**arguments, **rows}, local_targets, spec.transform, spec.fp32_head,
                                   spec.outputs, with_aux)
    return {name: _gathered(t, sp)[:, :T] for name, t in stats.items()}, aux_loss


def _whole_inputs(state: StreamState, arguments: dict) -> dict:
    """The inputs of a whole-sequence call, checked to be the same on every rank of the group."""
    if arguments.get("inputs_embeds") is not None:
        raise NotImplementedError("sequence parallelism with whole-sequence calls takes input_ids, not inputs_embeds")
    state.sequence.check_same_tensor(arguments["input_ids"], "input_ids")
    return {k: arguments.get(k) for k in ("input_ids", "attention_mask", "position_ids")}


def _gathered(t: torch.Tensor, sp) -> torch.Tensor:
    """This rank's per-token results -> the whole sequence's (gloo gathers no bools)."""
    if t.dtype == torch.bool:
        return sp.all_gather_rows(t.to(torch.uint8)).bool()
    return gather_over_group(t, sp, grad_scale=sp.size)  # (whole-sequence calls only: see _grad_scale)


def _warn_if_trl_head_outside(state: StreamState, lm: nn.Module) -> None:
    if fused_head_spec(vars(lm).get("forward")) is not None:
        state.warn_once(
            "trl-outside",
            "TRL's fused LM head was added after leanbp.stream: the decoder streams, but TRL computes the "
            "log-probs itself (4096-row tiles). Call leanbp.integrations.trl.stream_trainer(trainer) after "
            "building the trainer to let leanbp's chunked head do it.",
        )
