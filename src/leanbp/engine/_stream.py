"""``leanbp.stream(model)``: a transformers causal LM whose training step runs StreamBP.

The model object stays the same: only its ``forward`` is replaced (per instance, reversibly), so
parameters, state dict, ``save_pretrained``, optimizers and distributed wrappers are untouched.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch import nn

from ..models import adapter_for
from ._grads import AutocastState
from ._head import ChunkedHeadLossFunction, HeadRun, IGNORE_INDEX, shift_labels
from ._layer import LayerRun, StreamedLayerFunction

_SUPPORTED_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class StreamConfig:
    """How a streamed model chunks its work.

    chunk_size: rows of the sequence recomputed and backpropagated at once in a decoder layer.
    head_chunk_size: labelled rows whose logits exist at once in the LM head + loss.
    layers: stream the decoder layers (StreamBP). False keeps the model's own decoder (plain
        autograd, or its gradient checkpointing) and chunks only the LM head + loss.
    """

    chunk_size: int = 1024
    head_chunk_size: int = 256
    layers: bool = True

    def __post_init__(self):
        for name in ("chunk_size", "head_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass
class _StreamState:
    config: StreamConfig
    adapter: object
    layer_param_names: list[list[str]]
    head_param_names: list[str]


def is_streamed(model: nn.Module) -> bool:
    return "_leanbp_stream" in vars(model)


def stream(model: nn.Module, chunk_size: int = 1024, head_chunk_size: int = 256, layers: bool = True) -> nn.Module:
    """Make ``model(input_ids, labels=...)`` + ``loss.backward()`` run exact StreamBP.

    Only calls with ``labels`` are streamed (they return ``loss`` and ``logits=None``); calls
    without labels run the model's own forward. ``layers=False`` chunks only the LM head + loss
    (no full logits) and leaves the decoder to transformers. Undo with :func:`unstream`.
    """
    config = StreamConfig(chunk_size=chunk_size, head_chunk_size=head_chunk_size, layers=layers)
    if is_streamed(model):
        raise ValueError("model is already streamed; call leanbp.unstream(model) first to change chunk sizes")
    adapter = adapter_for(model)
    attn_impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if attn_impl not in _SUPPORTED_ATTENTION:
        raise NotImplementedError(
            f"attn_implementation={attn_impl!r} is not supported by leanbp.stream (it computes chunk "
            f"attention itself with SDPA); load the model with attn_implementation='sdpa'."
        )
    if layers and (getattr(model, "is_activation_checkpointing", None) or getattr(model.model, "gradient_checkpointing", False)):
        raise ValueError(
            "gradient checkpointing is enabled; StreamBP already keeps only each layer's input. "
            "Call model.gradient_checkpointing_disable() before leanbp.stream(model)."
        )
    layers = adapter.layers()
    module_names = {m: n for n, m in model.named_modules()}
    # without streamed layers the decoder applies the final norm itself
    head_modules = [adapter.final_norm(), adapter.lm_head()] if layers else [adapter.lm_head()]
    state = _StreamState(
        config=config,
        adapter=adapter,
        # names, not tensors: resolved on every call so that later freezing, PEFT or a
        # distributed wrapper that swaps parameter tensors is always seen
        layer_param_names=[[n for n, _ in layer.named_parameters()] for layer in layers],
        head_param_names=[f"{module_names[m]}.{n}" for m in head_modules for n, _ in m.named_parameters()],
    )
    model._leanbp_stream = state
    model.forward = types.MethodType(_streamed_forward, model)
    return model


def unstream(model: nn.Module) -> nn.Module:
    """Return a streamed model to plain transformers behaviour."""
    if not is_streamed(model):
        raise ValueError("model is not streamed")
    del model._leanbp_stream
    del model.forward  # the class's forward shows through again
    return model


def _trainable(module: nn.Module, names: list[str]) -> list[torch.Tensor]:
    """The parameters (by name, each once) that need a gradient now."""
    found = {id(p): p for p in (module.get_parameter(n) for n in names) if p.requires_grad}
    return list(found.values())


def _check_call(model, kwargs, attention_mask, position_ids):
    unsupported = {k: v for k, v in kwargs.items() if v not in (None, False)}
    if unsupported:
        raise NotImplementedError(
            f"leanbp.stream does not support {sorted(unsupported)} in a call with labels "
            "(a streamed training step returns only the loss); call leanbp.unstream(model) for that."
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(
            "leanbp.stream takes a 2D (batch, seq) padding attention_mask; custom 4D masks are not supported"
        )
    if position_ids is not None and attention_mask is None:
        expected = torch.arange(position_ids.shape[-1], device=position_ids.device)
        if not bool((position_ids - position_ids[..., :1] == expected).all()):
            raise NotImplementedError(
                "position_ids that restart inside a row (packed sequences) are not supported yet; "
                "pad the sequences instead"
            )
    if model.training:
        for i in range(len(model._leanbp_stream.adapter.layers())):
            if model._leanbp_stream.adapter.attention_dropout(i) > 0:
                raise NotImplementedError(
                    "attention dropout > 0 in training is not supported by leanbp.stream (a recomputed "
                    "chunk would draw a different mask); set config.attention_dropout = 0.0"
                )


def _streamed_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    inputs_embeds=None,
    labels=None,
    num_items_in_batch=None,
    use_cache=None,
    past_key_values=None,
    cache=None,
    output_attentions=None,
    output_hidden_states=None,
    return_dict=None,
    logits_to_keep=0,
    **kwargs,
):
    state: _StreamState = self._leanbp_stream
    if labels is None:
        # no loss to stream: plain forward (it builds full logits, as the caller asked for them)
        passed = dict(use_cache=use_cache, past_key_values=past_key_values, cache=cache,
                      output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                      return_dict=return_dict, num_items_in_batch=num_items_in_batch)
        passed = {k: v for k, v in passed.items() if v is not None}
        return type(self).forward(
            self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, logits_to_keep=logits_to_keep, **passed, **kwargs,
        )
    if not state.config.layers:
        return _head_only_forward(self, state, input_ids, attention_mask, position_ids, inputs_embeds, labels,
                                  num_items_in_batch, kwargs)
    _check_call(
        self,
        {"use_cache": use_cache, "past_key_values": past_key_values, "cache": cache,
         "output_attentions": output_attentions, "output_hidden_states": output_hidden_states, **kwargs},
        attention_mask,
        position_ids,
    )
    adapter, config = state.adapter, state.config
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    hidden = adapter.embed_tokens()(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, H)
    T = hidden.shape[1]
    if position_ids is None:
        position_ids = torch.arange(T, device=hidden.device).unsqueeze(0)  # (1, T)
    cos, sin = adapter.position_embeddings(hidden, position_ids)
    key_keep = None
    if attention_mask is not None and not bool(attention_mask.all()):
        key_keep = attention_mask.to(device=hidden.device, dtype=torch.bool)
    autocast = AutocastState(hidden.device.type)

    for i, layer in enumerate(adapter.layers()):
        run = LayerRun(
            adapter=adapter,
            layer=layer,
            window=adapter.sliding_window(i),
            cos=cos,
            sin=sin,
            key_keep=key_keep,
            chunk_size=config.chunk_size,
            autocast=autocast,
        )
        hidden = StreamedLayerFunction.apply(hidden, run, *_trainable(layer, state.layer_param_names[i]))

    # the last layer's output is read by the head only: its buffer can hold the head's input gradient
    # (never the caller's inputs_embeds, which a model without layers would pass straight through)
    return _loss_output(self, state, hidden, adapter.final_norm(), labels, num_items_in_batch,
                        input_is_scratch=len(adapter.layers()) > 0)


def _loss_output(model, state: _StreamState, hidden, norm, labels, num_items_in_batch, input_is_scratch=False):
    """The chunked head + loss on the last decoder output (B, T, H)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if labels.shape != hidden.shape[:2]:
        raise ValueError(f"labels must have shape {tuple(hidden.shape[:2])}, got {tuple(labels.shape)}")
    targets = shift_labels(labels.to(hidden.device))
    if num_items_in_batch is not None:
        denominator = num_items_in_batch
        if torch.is_tensor(denominator):
            denominator = denominator.to(hidden.device)
    else:
        denominator = (targets != IGNORE_INDEX).sum()
    head = HeadRun(
        norm=norm,
        lm_head=state.adapter.lm_head(),
        targets=targets,
        denominator=denominator,
        chunk_size=state.config.head_chunk_size,
        autocast=AutocastState(hidden.device.type),
        grad_enabled=torch.is_grad_enabled(),
        input_is_scratch=input_is_scratch,
    )
    loss = ChunkedHeadLossFunction.apply(hidden, head, *_trainable(model, state.head_param_names))
    return CausalLMOutputWithPast(loss=loss, logits=None)


def _head_only_forward(model, state, input_ids, attention_mask, position_ids, inputs_embeds, labels,
                       num_items_in_batch, kwargs):
    """The model's own decoder (final norm included), then the chunked head + loss."""
    out = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      inputs_embeds=inputs_embeds, use_cache=False, **kwargs)
    return _loss_output(model, state, out.last_hidden_state, nn.Identity(), labels, num_items_in_batch)
