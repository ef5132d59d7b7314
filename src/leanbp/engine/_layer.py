"""One decoder layer as an autograd Function that keeps only its input.

Forward (no graph): chunk by chunk in sequence order; each chunk computes its own rows' K/V into a
K/V buffer and attends to the buffer's visible rows, so K/V are computed once.

Backward, chunks in reverse order: K/V of all rows are computed once (no graph) to serve as the
prefix that later chunks attend to. Each chunk is then recomputed with a graph -- its queries,
its own K/V rows, attention, MLP -- and backpropagated with its slice of dL/dH_out plus the dK/dV
that later chunks already sent to its rows. Processing in reverse order makes both complete: once
chunk [s, e) is done no other chunk can touch rows [s, e), so dL/dH_in[s:e] is final and the K/V
projection's graph never spans more than one chunk. Prefix rows receive their dK/dV into buffers.

The parameters are explicit inputs of the Function and their chunk gradients are summed before
being returned, so each parameter's gradient reaches autograd (and DDP/FSDP hooks) once.

A mixture-of-experts layer whose load-balancing loss is asked for also returns its rows' summed
router probabilities (E,), and adds that output's gradient to every recomputed chunk (``_moe.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..memory import in_phase
from ._adapter import DecoderFamily, RotaryRows, Router
from ._attention_backends import SdpaSwitches
from ._grads import AutocastState, GradSum
from ._masks import ChunkMasks, Documents, KeyKeep, PrefixGradSink, key_start
from ._moe import RouterStats
from ._offload import HostStore, backward_reads
from ._rng import ChunkDraws
from ._split import FULL, current_pass, wanted
from ._ulysses import Exchange, HeadSplit, SequenceGroup, gather_kv, scatter_kv_grads


@dataclass
class LayerCall:
    """Everything one call of a streamed layer needs besides its input and parameters."""

    adapter: DecoderFamily
    layer: nn.Module
    window: int | None
    softcap: float | None  # attention logit soft-capping
    rope: RotaryRows  # (cos, sin) of rows [s, e), (1 or B, e - s, R), R rotary dims
    key_keep: KeyKeep | None  # None when nothing is padded
    documents: Documents | None  # packed rows, None when every row is one sequence
    chunk_size: int
    autocast: AutocastState
    router: Router | None = None  # of a mixture-of-experts layer whose statistics are asked for
    router_stats: RouterStats | None = None
    offload: HostStore | None = None  # the layer's input, output and their gradients live on the host
    # the attention kernels enabled in forward, replayed for the recompute and its backward
    sdpa: SdpaSwitches = field(default_factory=SdpaSwitches)
    attention: str = "blocks"  # how chunk attention applies its masks (``_masks.ATTENTION_MODES``)
    # sequence parallelism (``_ulysses.py``): the group and its head split; the layer's rows are
    # then this rank's T/P, while window, padding and documents are those of the whole sequence
    sequence: SequenceGroup | None = None
    heads: HeadSplit | None = None
    # whether the output's gradient is a tensor nobody else reads (the next streamed layer's or the
    # head's), which backward may overwrite: not the last layer of a pipeline stage, whose output
    # gradient is the stage's receive buffer (or a caller's tensor)
    owns_grad_out: bool = True

    def chunks(self, length: int) -> list[tuple[int, int]]:
        return [(s, min(s + self.chunk_size, length)) for s in range(0, length, self.chunk_size)]

    def key_begin(self, start: int) -> int:
        """First key row any query row of a chunk starting at ``start`` may see."""
        begin = key_start(start, self.window)
        if self.documents is not None:  # no row sees keys before its document's start
            begin = max(begin, min(self.documents.start_of(b, start) for b in range(len(self.documents.starts))))
        return begin

    def chunk_out(self, hidden_c, prefix_key, prefix_value, start, end, sink=None, exchange=None):
        """The ``LayerChunk`` (output, own key, own value, router logits) of rows [start, end);
        prefix_* are K/V rows [key_begin(start), start), or None when that range is empty. With an
        ``exchange`` (sequence parallel) the rows are local and the attention is the exchange's."""
        if exchange is not None:
            masks = ChunkMasks(start, end, start, None, None, hidden_c.device, exchange=exchange)
        else:
            masks = ChunkMasks(start, end, self.key_begin(start), self.window, self.key_keep, hidden_c.device,
                               self.documents, self.attention)
        return self.adapter.chunk_forward(
            self.layer, hidden_c, prefix_key, prefix_value, *self.rope.rows(start, end), masks,
            sink, self.softcap, self.router if self.router_stats is not None else None,
        )

    def global_masks(self, start: int, end: int, device) -> ChunkMasks:
        """The masks of global rows [start, end) of a sequence-parallel layer."""
        return ChunkMasks(start, end, self.key_begin(start), self.window, self.key_keep, device, self.documents,
                          self.attention)

    def local_key_value(self, rows, chunks) -> list[torch.Tensor]:
        """[K, V] of the rows ``chunks`` cover (from row 0), (B, Hkv, n, D) each, chunk by chunk without a
        graph ([None, None] for no chunks); ``rows(s, e)`` gives the layer input's rows [s, e) on the
        device. Memory: only one chunk's projection temporaries exist at a time, each written into the
        two results as it comes (a list of the chunks' parts and then a cat would hold both at once)."""
        key = value = None
        with torch.no_grad(), self.autocast():
            for s, e in chunks:
                k, v = self.adapter.key_value(self.layer, rows(s, e), *self.rope.rows(s, e))  # (B, Hkv, e - s, D)
                if key is None:
                    n = chunks[-1][1]
                    key = k.new_empty(k.shape[0], k.shape[1], n, k.shape[3])
                    value = v.new_empty(v.shape[0], v.shape[1], n, v.shape[3])
                key[:, :, s:e], value[:, :, s:e] = k, v
                del k, v
        return [key, value]

    def replayed_key_value(self, rows, chunks, draws: ChunkDraws) -> list[torch.Tensor]:
        """``local_key_value`` of a layer whose chunks drew random numbers: the forward's chunks rerun
        in order without a graph, each from the generators' states the forward had before it, so
        the K/V are the forward's own (a K/V projection alone would draw other numbers). Memory:
        as the forward, the buffers cover the rows ``chunks`` cover and one chunk's output at a time."""
        kv = _KeyValueRows(chunks[-1][1] if chunks else 0)  # ([None, None] for no chunks)
        with torch.no_grad(), self.autocast(), self.sdpa():
            for j, (s, e) in enumerate(chunks):
                draws.restore(j)
                chunk = self.chunk_out(rows(s, e), *kv.prefix(self.key_begin(s), s), s, e)
                kv.put(s, e, chunk.key, chunk.value)
                del chunk
        return [kv.key, kv.value]

    def exchange(self, rows, length: int, device: torch.device, chunks, grad: bool) -> Exchange:
        """The layer's sequence-parallel exchange over its ``length`` local rows: every row's K/V for
        this rank's heads (with the sink of their gradients in backward)."""
        key, value = gather_kv(self.sequence, self.heads, self.local_key_value(rows, chunks))
        return Exchange(self.sequence, self.heads, key, value, length,
                        lambda g0, g1: self.global_masks(g0, g1, device),
                        PrefixGradSink(key, value) if grad else None)


class _KeyValueRows:
    """The K/V buffers (B, Hkv, rows, D) of a layer's chunks run in sequence order: each chunk
    attends to the rows before it and then adds its own."""

    def __init__(self, rows: int):
        self.rows = rows
        self.key = self.value = None  # allocated by the first chunk (its K/V give shape and dtype)

    def prefix(self, begin: int, start: int):
        """The visible rows [begin, start) of K and V, (None, None) when there are none."""
        if start <= begin:
            return None, None
        return self.key[:, :, begin:start], self.value[:, :, begin:start]

    def put(self, start: int, end: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.key is None:
            self.key = key.new_empty((*key.shape[:2], self.rows, key.shape[3]))
            self.value = value.new_empty((*value.shape[:2], self.rows, value.shape[3]))
        self.key[:, :, start:end], self.value[:, :, start:end] = key, value


def _forward_io(call: LayerCall, hidden: torch.Tensor, reads):
    """(the output, rows(s, e), write(s, e, block)) of a layer's forward: ``rows`` gives the input's
    rows on the device and ``write`` puts a chunk's output in place. With offload, hidden and the
    output are host tensors: rows come to the device in the planned order ``reads`` and each output
    block goes straight back."""
    if call.offload is not None:
        reader = call.offload.reader(reads)
        out = call.offload.empty(hidden.shape, hidden.dtype)

        def rows(s, e):
            return reader.take(hidden, s, e)

        def write(s, e, block):
            call.offload.write(out, s, e, block)
        return out, rows, write
    # Memory: the output (B, T, H) is the next layer's input (or the head's)
    out = torch.empty_like(hidden)

    def rows(s, e):
        return hidden[:, s:e]

    def write(s, e, block):
        out[:, s:e] = block
    return out, rows, write


class StreamedLayerFunction(torch.autograd.Function):
    @staticmethod
    @in_phase("layer forward")
    def forward(ctx, hidden: torch.Tensor, call: LayerCall, *params: torch.Tensor):
        if call.sequence is not None:
            return _sequence_parallel_forward(ctx, hidden, call, params)
        chunks = call.chunks(hidden.shape[1])
        out, rows, write = _forward_io(call, hidden, [(hidden, s, e) for s, e in chunks])
        # Memory: the K/V buffers (B, Hkv, T, D) hold every row's K/V because each chunk attends to
        # all rows before it
        kv = _KeyValueRows(hidden.shape[1])
        prob_sum = None  # (E,) router probabilities summed over the rows, when asked for
        draws = ChunkDraws(call.offload.device if call.offload is not None else hidden.device)
        with torch.no_grad():
            for s, e in chunks:
                draws.mark()
                out_c, key_c, value_c, logits = call.chunk_out(rows(s, e), *kv.prefix(call.key_begin(s), s), s, e)
                write(s, e, out_c)
                del out_c  # Memory: one chunk's output at a time
                if call.router_stats is not None:  # routings counted and probabilities summed
                    chunk_sum = call.router_stats.chunk_prob_sum(logits, s, e, call.router)
                    prob_sum = chunk_sum if prob_sum is None else prob_sum + chunk_sum
                del logits  # Memory: one chunk's router logits at a time
                kv.put(s, e, key_c, value_c)
        if call.offload is not None:
            call.offload.finish()  # out is complete before autograd hands it on
        # Memory: the layer input is the only activation kept until backward (on the host with offload)
        ctx.save_for_backward(hidden, *params)
        ctx.call = call
        draws.drew()  # (kept only when the layer drew: dropout in the layer, replayed in backward)
        ctx.draws = draws
        return out if prob_sum is None else (out, prob_sum)

    @staticmethod
    @in_phase("layer backward")
    def backward(ctx, grad_out: torch.Tensor, grad_prob_sum: torch.Tensor | None = None):
        call: LayerCall = ctx.call
        split = current_pass() != FULL  # a pipeline stage's input or weight pass (``_split.py``)
        if split and (call.sequence is not None or call.offload is not None):  # (Pipeline refuses both)
            raise NotImplementedError("a split backward (pipeline schedule 2bp) with sequence parallelism or offload is "
                                      "not supported yet")
        if call.sequence is not None:
            return _sequence_parallel_backward(ctx, grad_out, grad_prob_sum)
        hidden, *params = ctx.saved_tensors
        T = hidden.shape[1]
        chunks = call.chunks(T)
        if call.offload is not None:  # hidden and grad_out are host tensors: rows come in planned order
            grad_out = call.offload.adopt(grad_out)  # (in the store's layout, whoever made it)
            reader = call.offload.reader(backward_reads(hidden, grad_out, chunks))

            def rows(s, e):
                return reader.take(hidden, s, e)

            def grad_rows(s, e):
                return reader.take(grad_out, s, e)
        else:
            grad_out = grad_out.contiguous()

            def rows(s, e):
                return hidden[:, s:e]

            def grad_rows(s, e):
                return grad_out[:, s:e]
        need_input, need_params = wanted(ctx, 2)
        trainable = [p for p, need in zip(params, need_params) if need]
        if not need_input and not trainable:  # (a weight pass of a frozen layer)
            return (None, None, *[None] * len(params))
        with ctx.draws.replaying():
            return _backward(call, chunks, rows, grad_rows, grad_out, grad_prob_sum, need_input, need_params,
                             trainable, split, ctx.draws)


def _backward(call: LayerCall, chunks, rows, grad_rows, grad_out, grad_prob_sum, need_input, need_params, trainable,
              split: bool, draws: ChunkDraws):
    """The chunk loop of ``StreamedLayerFunction.backward`` (``draws``: the forward's generator
    states, set back before each chunk's recompute when the layer drew random numbers)."""
    grads = GradSum(trainable)

    # Prefix K/V for every chunk, computed once without a graph (the last chunk's own rows are
    # never a prefix, so they are skipped); the (B, Hkv, P, D) buffers are what the chunks attend to
    if draws.replays:
        key, value = call.replayed_key_value(rows, chunks[:-1], draws)
    else:
        key, value = call.local_key_value(rows, chunks[:-1])
    # dL/dK, dL/dV that chunks send to the rows before them
    sink = PrefixGradSink(key, value) if key is not None else None
    # Memory: dL/dH_in[s:e] overwrites dL/dH_out[s:e], which chunk [s, e) was the last to read,
    # when grad_out is the fresh gradient of the next streamed layer or the head (and no weight
    # pass of a split backward reads it again)
    reuse = call.owns_grad_out and not split
    dhidden = (grad_out if reuse else torch.empty_like(grad_out)) if need_input else None

    for j in reversed(range(len(chunks))):
        s, e = chunks[j]
        draws.restore(j)
        kb = call.key_begin(s)
        hidden_c = rows(s, e).detach().requires_grad_(need_input)
        prefix_key = prefix_value = None
        if s > kb:
            # leaves of the visible prefix rows; their gradients go into the sink (or come back
            # as (B, Hkv, s - kb, D) on the single-SDPA path), never as T-row tensors
            prefix_key = key[:, :, kb:s].detach().requires_grad_()
            prefix_value = value[:, :, kb:s].detach().requires_grad_()
        with torch.enable_grad(), call.autocast(), call.sdpa():
            out_c, key_c, value_c, logits = call.chunk_out(hidden_c, prefix_key, prefix_value, s, e, sink)
            prob_sum_c = None
            if grad_prob_sum is not None:  # the load-balancing loss's share of this chunk
                prob_sum_c = call.router_stats.chunk_prob_sum(logits, s, e)
        outputs, grad_outputs = [out_c], [grad_rows(s, e)]
        if prob_sum_c is not None and prob_sum_c.requires_grad:  # (not with a frozen router and input)
            outputs.append(prob_sum_c)
            grad_outputs.append(grad_prob_sum)
        if sink is not None and sink.dkey is not None:  # what later chunks sent to this chunk's own rows
            for own, d in ((key_c, sink.dkey), (value_c, sink.dvalue)):
                if own.requires_grad:
                    outputs.append(own)
                    grad_outputs.append(d[:, :, s:e])
        prefix = [t for t in (prefix_key, prefix_value) if t is not None and key_c.requires_grad]
        inputs = ([hidden_c] if need_input else []) + prefix + trainable
        with call.sdpa():  # (the attention's backward picks its kernel too)
            g = list(torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True))
        if need_input:  # final: no other chunk reaches rows [s, e)
            if call.offload is not None:
                call.offload.write(dhidden, s, e, g.pop(0))
            else:
                dhidden[:, s:e] = g.pop(0)
        if prefix:
            dprefix_key, dprefix_value = g.pop(0), g.pop(0)
            if dprefix_key is not None:  # the single-SDPA path returns them instead of sinking them
                sink.add(kb, s, dprefix_key, dprefix_value)
            del dprefix_key, dprefix_value
        grads.add(g)
        del out_c, key_c, value_c, logits, prob_sum_c, g

    if call.offload is not None:
        call.offload.finish()  # dhidden is complete before autograd hands it on
    it = iter(grads.result())
    return (dhidden, None, *[next(it) if need else None for need in need_params])


# -- sequence parallelism (``_ulysses.py``) ------------------------------------------------------

def _sequence_parallel_forward(ctx, hidden: torch.Tensor, call: LayerCall, params) -> torch.Tensor:
    """The layer on this rank's rows: every row's K/V for this rank's heads first (one exchange),
    then chunk by chunk, every rank on the same chunk index together. With offload, the input and
    the output are host tensors, read twice (K/V, then the chunks) and written block by block."""
    chunks = call.chunks(hidden.shape[1])
    out, rows, write = _forward_io(call, hidden, [(hidden, s, e) for s, e in chunks] * 2)
    device = call.offload.device if call.offload is not None else hidden.device
    prob_sum = None  # (E,) router probabilities summed over this rank's rows, when asked for
    draws = ChunkDraws(device)  # (before the exchange's K/V, then before each chunk)
    with torch.no_grad():
        draws.mark()
        exchange = call.exchange(rows, hidden.shape[1], device, chunks, grad=False)
        for s, e in chunks:
            draws.mark()
            chunk = call.chunk_out(rows(s, e), None, None, s, e, exchange=exchange)
            write(s, e, chunk.out)
            if call.router_stats is not None:  # routings counted and probabilities summed (local rows)
                chunk_sum = call.router_stats.chunk_prob_sum(chunk.router_logits, s, e, call.router)
                prob_sum = chunk_sum if prob_sum is None else prob_sum + chunk_sum
            del chunk  # Memory: one chunk's output and router logits at a time
    del exchange  # Memory: the gathered K/V live for one layer's forward
    if call.offload is not None:
        call.offload.finish()  # out is complete before autograd hands it on
    ctx.save_for_backward(hidden, *params)
    ctx.call = call
    draws.drew()
    ctx.draws = draws
    return out if prob_sum is None else (out, prob_sum)


def _sequence_parallel_backward(ctx, grad_out: torch.Tensor, grad_prob_sum: torch.Tensor | None = None):
    """Each chunk recomputed and backpropagated through everything but its K/V projections (its
    queries' gradient comes back through the exchange; dK/dV of every row it saw go into the sink);
    then dK/dV return to the rows' ranks in one exchange and go through the K/V projections.

    With offload (host input, output gradient and input gradient), the rows are read in the order
    of those three passes: the input for the exchange's K/V; the input and the output gradient per
    chunk, last chunk first (the chunk's input gradient written over its output gradient); the input
    and that partial input gradient per chunk, which the K/V projections complete."""
    with ctx.draws.replaying():
        return _sequence_parallel_chunks(ctx, grad_out, grad_prob_sum, ctx.draws)


def _sequence_parallel_chunks(ctx, grad_out, grad_prob_sum, draws: ChunkDraws):
    """``_sequence_parallel_backward``'s three passes; when the layer drew, each pass starts from
    the generators' states the forward had there (state 0: before the exchange's K/V, which the K/V
    projections redraw; state 1 + j: before chunk j)."""
    call: LayerCall = ctx.call
    hidden, *params = ctx.saved_tensors
    T = hidden.shape[1]
    chunks = call.chunks(T)
    need_input = ctx.needs_input_grad[0]
    trainable = [p for p, need in zip(params, ctx.needs_input_grad[2:]) if need]
    grads = GradSum(trainable)
    store = call.offload
    if store is not None:
        grad_out = store.adopt(grad_out)  # (in the store's layout, whoever made it)
        kv_pass = [(hidden, s, e) for s, e in chunks]
        chunk_pass = [(t, s, e) for s, e in reversed(chunks) for t in (hidden, grad_out)]
        # (the partial input gradient lives in grad_out's rows, written by the chunk pass)
        projection_pass = [(t, s, e) for s, e in chunks for t in ((hidden, grad_out) if need_input else (hidden,))]
        reader = store.reader(kv_pass + chunk_pass + projection_pass)
        device = store.device

        def rows(t, s, e):
            return reader.take(t, s, e)

        def write(t, s, e, block):
            store.write(t, s, e, block)
    else:
        grad_out = grad_out.contiguous()
        device = hidden.device

        def rows(t, s, e):
            return t[:, s:e]

        def write(t, s, e, block):
            t[:, s:e] = block
    draws.restore(0)
    exchange = call.exchange(lambda s, e: rows(hidden, s, e), T, device, chunks, grad=True)
    # Memory: dL/dH_in[s:e] overwrites dL/dH_out[s:e] once chunk [s, e) has read it
    dhidden = grad_out if need_input else None
    for j in reversed(range(len(chunks))):
        s, e = chunks[j]
        draws.restore(1 + j)
        hidden_c = rows(hidden, s, e).detach().requires_grad_(need_input)
        grad_c = rows(grad_out, s, e)
        with torch.enable_grad(), call.autocast(), call.sdpa():
            chunk = call.chunk_out(hidden_c, None, None, s, e, exchange=exchange)
            outputs, grad_outputs = [chunk.out], [grad_c]
            if grad_prob_sum is not None:  # the load-balancing loss's share of this chunk
                prob_sum_c = call.router_stats.chunk_prob_sum(chunk.router_logits, s, e)
                if prob_sum_c.requires_grad:  # (not with a frozen router and input)
                    outputs.append(prob_sum_c)
                    grad_outputs.append(grad_prob_sum)
        del chunk
        inputs = ([hidden_c] if need_input else []) + trainable
        with call.sdpa():
            g = list(torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True))
        if need_input:
            write(dhidden, s, e, g.pop(0))
        grads.add(g)
        del outputs, g
    sink = exchange.sink
    all_rows = [sink.dkey if sink.dkey is not None else torch.zeros_like(exchange.key),
                sink.dvalue if sink.dvalue is not None else torch.zeros_like(exchange.value)]
    del exchange, sink  # Memory: the gathered K/V and the sink's references go before the exchange
    dkey, dvalue = scatter_kv_grads(call.sequence, call.heads, all_rows, T)  # (B, Hkv, T/P, D); empties all_rows
    draws.restore(0)  # (the projections draw what the forward's exchange drew, chunk by chunk in order)
    for s, e in chunks:  # the K/V projections of the local rows, with what every rank's queries sent
        hidden_c = rows(hidden, s, e).detach().requires_grad_(need_input)
        with torch.enable_grad(), call.autocast():
            key_c, value_c = call.adapter.key_value(call.layer, hidden_c, *call.rope.rows(s, e))
        inputs = ([hidden_c] if need_input else []) + trainable
        g = list(torch.autograd.grad([key_c, value_c], inputs, [dkey[:, :, s:e].to(key_c.dtype),
                                                                    dvalue[:, :, s:e].to(value_c.dtype)],
                                     allow_unused=True))
        if need_input:
            write(dhidden, s, e, rows(dhidden, s, e) + g.pop(0))
        grads.add(g)
    if store is not None:
        store.finish()  # dhidden is complete before autograd hands it on
    it = iter(grads.result())
    return (dhidden, None, *[next(it) if need else None for need in ctx.needs_input_grad[2:]])
