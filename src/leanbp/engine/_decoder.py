"""The streamed decoder: embeddings, then every decoder layer as a ``StreamedLayerFunction``.

Every entry point runs it: the backbone forward (so any head on top of ``last_hidden_state``
streams), leanbp's cross-entropy for ``labels`` calls, and TRL's fused head. It returns the last
layer's output *before* the final norm; callers either hand the norm to leanbp's chunked head or
apply it with ``RowwiseFunction`` (which keeps only its input).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from ..distributed import check_layers
from ..memory import in_phase
from ._adapter import DecoderFamily
from ._attention_backends import SdpaSwitches
from ._chunking import pick_chunk_rows
from ._grads import AutocastState, GradSum
from ._layer import LayerCall, StreamedLayerFunction
from ._masks import Documents, KeyKeep
from ._module_call import call_through
from ._moe import RouterStats
from ._offload import HostStore, to_device, to_host
from ._split import wanted
from ._ulysses import HeadSplit, SequenceGroup


def trainable(module: nn.Module) -> list[torch.Tensor]:
    """The parameters of ``module`` that need a gradient now, each once. Looked up on every call,
    so adapters added after ``stream`` (PEFT) and later freezing are always seen."""
    return [p for p in module.parameters() if p.requires_grad]


def check_attention_mask(attention_mask, batch: int, length: int) -> None:
    if attention_mask is None:
        return
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, length):
        raise ValueError(
            f"attention_mask must have shape (batch, seq) = {(batch, length)}, got {tuple(attention_mask.shape)}"
        )


class DecoderOutput(NamedTuple):
    """What a streamed decoder call computed, and what it chose."""

    hidden: torch.Tensor  # (B, T, H): the last layer's output, before the final norm
    router_stats: RouterStats | None  # of the mixture-of-experts layers, when asked for
    chunk_rows: int  # the rows per chunk the layers ran with (what "auto" chose)


def decoder_layers(adapter: DecoderFamily, input_ids=None, inputs_embeds=None, attention_mask=None, position_ids=None,
                   *, chunk_size: int | str, chunk_memory: int | None = None, attention: str = "blocks",
                   offload: bool = False, router_stats: bool = False,
                   sequence: SequenceGroup | None = None, layers: range | None = None,
                   owns_grad_out: bool = True) -> DecoderOutput:
    """Every decoder layer of ``adapter``'s model, streamed, on the embedded input.

    ``chunk_size`` rows per chunk, or "auto" within ``chunk_memory`` bytes (``_chunking.py``);
    ``attention``: how chunk attention applies its masks (``_masks.ATTENTION_MODES``); ``offload``
    keeps the layer boundaries and their gradients in host memory (``_offload.py``);
    ``router_stats`` gathers the statistics of the load-balancing loss (``_moe.py``).

    Packed rows: with ``position_ids`` that restart inside a row and no ``attention_mask``, every
    document attends only to itself (transformers' rule); with an attention mask the position ids
    only place RoPE, as in transformers.

    ``sequence``: sequence parallelism (``_ulysses.py``): the inputs are this rank's T/P rows of the
    sequence (rank r: rows [r T/P, (r+1) T/P), the same count on every rank), ``attention_mask`` and
    ``position_ids`` too (positions default to the rows' global ones); padding and documents are
    read from the whole sequence's (gathered once per forward).

    ``layers``: the indices of the layers to run (a pipeline stage's; default all of them), with
    ``inputs_embeds`` the previous layer's output unless the range starts at layer 0;
    ``owns_grad_out``: whether the gradient of the returned output is a fresh tensor the last layer
    may overwrite (the head's is; a pipeline stage's received gradient is not)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    hidden = adapter.embed_tokens()(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, H)
    if hidden.dim() != 3:
        raise ValueError(f"input_ids must be (batch, seq) and inputs_embeds (batch, seq, hidden); got {tuple(hidden.shape)}")
    B, T = hidden.shape[:2]
    check_attention_mask(attention_mask, B, T)
    if sequence is not None:  # (first: every later exchange assumes it)
        sequence.check_same_rows(B, T)
    documents = None  # packed rows: read from position_ids passed without a mask
    if position_ids is None:
        first = sequence.offset(T) if sequence is not None else 0
        position_ids = torch.arange(first, first + T, device=hidden.device).unsqueeze(0)  # (1, T): one document per row
    else:
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.shape[-1] != T or position_ids.shape[0] not in (1, B):
            raise ValueError(
                f"position_ids must have shape (batch or 1, seq) = ({B}, {T}), got {tuple(position_ids.shape)}")
        position_ids = position_ids.to(hidden.device)
        if attention_mask is None:
            whole = position_ids if sequence is None else sequence.all_gather_rows(position_ids.expand(B, -1))
            documents = Documents.from_position_ids(whole, B)
    rope = adapter.position_embeddings(hidden, position_ids)  # per layer (``RotaryRows``: per chunk when it can)
    if sequence is not None and attention_mask is not None:  # (the keys every rank's queries may see)
        attention_mask = sequence.all_gather_rows(attention_mask)
    key_keep = KeyKeep.from_attention_mask(attention_mask, hidden.device)  # (one host read per forward)
    stats = None
    if router_stats:  # (under sequence parallelism: this rank's rows of the keep mask; sums over the group)
        keep = None if key_keep is None else key_keep.mask
        if keep is not None and sequence is not None:
            keep = keep[:, sequence.offset(T): sequence.offset(T) + T]
        stats = RouterStats(keep, B, T, sequence)
    autocast = AutocastState(hidden.device.type)
    sdpa = SdpaSwitches()  # (replayed around the layers' recompute, as autocast is)
    rows = pick_chunk_rows(chunk_size, chunk_memory, adapter, hidden, attention)
    layers = range(len(adapter.layers())) if layers is None else layers
    check_layers([adapter.layers()[i] for i in layers])
    heads = None
    if sequence is not None:
        _check_sequence_parallel(sequence, rope)
        config = adapter.config
        heads = HeadSplit(config.num_attention_heads,
                          getattr(config, "num_key_value_heads", None) or config.num_attention_heads, sequence.size)
    # (without a graph nothing is kept for backward: nothing to offload)
    store = HostStore(hidden.device) if offload and torch.is_grad_enabled() else None
    if store is not None:  # Memory: the layer boundaries and their gradients wait on the host
        hidden = to_host(hidden, store)
    for i in layers:
        layer = adapter.layers()[i]
        router = adapter.router(layer) if stats is not None else None
        call = LayerCall(adapter=adapter, layer=layer, window=adapter.sliding_window(i),
                         softcap=adapter.attention_softcap(i), rope=rope[i], key_keep=key_keep,
                         documents=documents, chunk_size=rows, autocast=autocast, router=router,
                         router_stats=stats if router is not None else None, offload=store, sdpa=sdpa,
                         attention=attention, sequence=sequence, heads=heads,
                         owns_grad_out=owns_grad_out or i != layers[-1])
        # the layer's own call runs the streamed layer, so engine hooks fire once per layer per step
        hidden = call_through(layer, partial(_streamed_layer, layer, call), hidden)
    if store is not None:  # the final norm and the head take the last layer's output whole
        hidden = to_device(hidden, store)
    return DecoderOutput(hidden, stats, rows)


def _check_sequence_parallel(sequence: SequenceGroup, rope) -> None:
    """What sequence parallelism does not do yet (every rank raises alike: the same settings)."""
    if any(getattr(r, "_table", None) is not None for r in rope):
        raise NotImplementedError("sequence parallelism needs a rotary embedding whose angles depend on the position "
                                  "only (default, linear, llama3, yarn); dynamic NTK and longrope scale by the longest "
                                  "position of the whole sequence")


def _streamed_layer(layer: nn.Module, call: LayerCall, hidden: torch.Tensor) -> torch.Tensor:
    out = StreamedLayerFunction.apply(hidden, call, *trainable(layer))
    if call.router_stats is None:
        return out
    out, prob_sum = out
    call.router_stats.prob_sums.append(prob_sum)
    return out


class RowwiseFunction(torch.autograd.Function):
    """A module that acts on each row independently (a norm), applied chunk by chunk.

    Memory: autograd would keep the module's intermediates for all T rows (an fp32 copy of the input
    and more for an RMSNorm); this keeps only the input and recomputes one chunk at a time in
    backward. Parameter gradients are summed over chunks and returned once."""

    @staticmethod
    @in_phase("final norm")
    def forward(ctx, hidden: torch.Tensor, module: nn.Module, chunk_size: int, autocast: AutocastState, *params):
        with torch.no_grad(), autocast():
            # .forward: the chunks run inside one call of the module (``rowwise``), whose hooks (an
            # engine's parameter gathering) must not fire again per chunk
            out = torch.cat([module.forward(hidden[:, s: s + chunk_size]) for s in range(0, hidden.shape[1], chunk_size)],
                            1)
        ctx.save_for_backward(hidden, *params)
        ctx.module, ctx.chunk_size, ctx.autocast = module, chunk_size, autocast
        return out

    @staticmethod
    @in_phase("final norm")
    def backward(ctx, grad_out: torch.Tensor):
        hidden, *params = ctx.saved_tensors
        need_input, need_params = wanted(ctx, 4)  # (one of them in a split backward's pass)
        trainable_params = [p for p, need in zip(params, need_params) if need]
        if not need_input and not trainable_params:  # (a weight pass of a frozen norm)
            return (None, None, None, None, *[None] * len(params))
        grads = GradSum(trainable_params)
        dhidden = torch.empty_like(hidden) if need_input else None
        for s in range(0, hidden.shape[1], ctx.chunk_size):
            rows = hidden[:, s: s + ctx.chunk_size].detach().requires_grad_(need_input)
            with torch.enable_grad(), ctx.autocast():
                out = ctx.module.forward(rows)
            inputs = ([rows] if need_input else []) + trainable_params
            g = list(torch.autograd.grad(out, inputs, grad_out[:, s: s + ctx.chunk_size], allow_unused=True))
            if need_input:
                dhidden[:, s: s + ctx.chunk_size] = g.pop(0)
            grads.add(g)
        it = iter(grads.result())
        return (dhidden, None, None, None, *[next(it) if need else None for need in need_params])


def rowwise(module: nn.Module, hidden: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``module`` applied to ``hidden`` chunk by chunk (inside one call of the module)."""
    return call_through(module, partial(_rowwise, module, chunk_size), hidden)


def _rowwise(module: nn.Module, chunk_size: int, hidden: torch.Tensor) -> torch.Tensor:
    return RowwiseFunction.apply(hidden, module, chunk_size, AutocastState(hidden.device.type), *trainable(module))
