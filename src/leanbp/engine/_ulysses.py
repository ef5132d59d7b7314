"""Sequence parallelism inside the streamed layer: DeepSpeed-Ulysses' head exchange around the
chunk attention, so that one sequence spreads over P processes.

Each rank of the sequence-parallel group holds T/P consecutive rows of every layer boundary (rank
r: global rows [r T/P, (r+1) T/P)). Attention needs every earlier row, so the exchange swaps the
split: for the attention only, a rank holds *all* rows of a group of heads (H/P query heads and
their K/V heads), and every rank computes attention for its heads over the whole sequence.

A streamed layer on rank r, forward:

    1. K/V of the local rows, chunk by chunk (no graph) -> one all-to-all -> K/V of all T rows for
       the rank's K/V heads, (B, Hkv/P, T, D) (K/V heads are replicated when Hkv < P, as Ulysses
       does; each rank then holds one)
    2. for each chunk i of the local rows, on every rank in step: queries of the chunk ->
       all-to-all -> the rank's query heads for chunk i of *every* rank (P blocks of c rows, each
       at its global position) -> causal chunk attention of each block against the K/V rows it may
       see (the existing (out, lse) kernels, by global position: padding, windows and packed
       documents as in one process) -> the inverse all-to-all -> the chunk's output for all heads
       -> o_proj, norms and the MLP on the local rows.

Backward mirrors it: step 1 again with a sink for dK/dV of all T rows of the rank's heads; each
chunk recomputed and backpropagated (its queries' gradient comes back by the inverse exchange;
dK/dV of every row it saw goes into the sink); then one all-to-all returns dK/dV to the ranks that
own the rows, and each rank backpropagates them through its K/V projections, chunk by chunk.

Every rank does all queries for its heads, so the attention work is balanced by construction (no
causal load imbalance); the exchanges carry the K/V once per layer each way and each chunk's
queries and outputs once each way, as DeepSpeed's Ulysses does for the whole sequence at once.
The parameters' gradients of each rank are those of its own rows: a loss built from several ranks'
rows takes its sums through ``sum_over_group`` (the value of the whole sequence on every rank, the
gradient of this rank's share), and the gradients are summed over the group once per step
(``reduce_gradients``), as data parallelism averages them. Labels are shifted by global position
(``shift_labels_across``): a rank's last row is scored against the next rank's first label.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._attention import chunk_attention
from ._masks import ChunkMasks, PrefixGradSink


@dataclass(frozen=True)
class SequenceGroup:
    """The processes that share one sequence: ``group`` (None: the default group), this process's
    rank in it, and the group's size P."""

    group: object
    rank: int
    size: int

    @staticmethod
    def of(group=None) -> "SequenceGroup":
        if not dist.is_initialized():
            raise RuntimeError("sequence_parallel needs torch.distributed initialized (torchrun, or "
                               "init_process_group) with the sequence-parallel ranks in one group")
        return SequenceGroup(group, dist.get_rank(group), dist.get_world_size(group))

    @staticmethod
    def set_up() -> "SequenceGroup":
        """The group ``sequence_parallel=True`` means: the sequence-parallel group DeepSpeed has set
        up, else every process."""
        return SequenceGroup.of(deepspeed_sequence_group())

    def offset(self, local_rows: int) -> int:
        """Global row of this rank's first local row."""
        return self.rank * local_rows

    def check_same_rows(self, batch: int, rows: int) -> None:
        """Every rank holds the same (batch, rows), else every rank raises the same error."""
        shapes = [None] * self.size
        dist.all_gather_object(shapes, (batch, rows), group=self.group)
        if len(set(shapes)) != 1:
            raise ValueError(f"sequence parallelism needs the same batch and number of rows on every rank (a sequence "
                             f"whose length is a multiple of {self.size}); the ranks hold (batch, rows) {shapes}: pad "
                             "the sequence (labels -100, attention mask 0)")

    def check_same_tensor(self, t: torch.Tensor, what: str) -> None:
        """Every rank holds the same ``t`` (its shape and two checksums agree), else every rank raises
        the same error: whole sequences that a trainer built on each rank of a group."""
        flat = t.reshape(-1).long()
        weights = torch.arange(1, flat.numel() + 1, device=flat.device)
        mine = (tuple(t.shape), int(flat.sum()), int((flat * weights).sum()))  # (int64 wraps alike everywhere)
        seen = [None] * self.size
        dist.all_gather_object(seen, mine, group=self.group)
        if len(set(seen)) != 1:
            raise ValueError(f"the ranks of a sequence-parallel group were given different {what}: they must score the "
                             "same sequences (same batches, and for GRPO/RLOO the same sampled completions)")

    def all_gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """(B, T/P, ...) on every rank -> (B, T, ...), the ranks' rows in order."""
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=self.group)
        return t

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        """All-to-all along dim 0: send[p] goes to rank p; the result's [q] came from rank q."""
        send = send.contiguous()
        out = torch.empty_like(send)
        dist.all_to_all_single(out, send, group=self.group)
        return out


def deepspeed_sequence_group():
    """DeepSpeed's sequence-parallel process group of this rank, or None where there is none.
    DeepSpeed makes it in ``UlyssesSPAttentionHF.register_with_transformers`` (which accelerate's
    ``ParallelismConfig(sp_size=P, sp_backend="deepspeed")`` calls in ``prepare``; the parallel-state
    module keeps it), or in ``deepspeed.initialize(mpu=..., mesh_param=(dp, sp))`` (the groups
    module). Only looked up where DeepSpeed is imported already: leanbp never imports it for this."""
    import sys

    state = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    if state is not None and getattr(state, "_SEQUENCE_PARALLEL_GROUP", None) is not None:
        return state._SEQUENCE_PARALLEL_GROUP
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None and (getattr(groups, "mpu", None) is not None or getattr(groups, "mesh_device", None)):
        try:
            return groups._get_sequence_parallel_group()
        except (KeyError, ValueError, AssertionError, AttributeError, RuntimeError):  # (an mpu or mesh without it)
            return None
    return None


@dataclass(frozen=True)
class HeadSplit:
    """Which heads each rank attends with: query heads [p Hq/P, (p+1) Hq/P) and the K/V heads they
    use, a range of Hkv/P heads, or one head shared by P/Hkv ranks when Hkv < P."""

    q_heads: int
    kv_heads: int
    size: int

    def __post_init__(self):
        if self.q_heads % self.size:
            raise ValueError(f"sequence parallelism over {self.size} ranks splits the {self.q_heads} query heads: "
                             "the group size must divide the number of query heads")
        if self.kv_heads % self.size and self.size % self.kv_heads:
            raise ValueError(f"{self.kv_heads} K/V heads over {self.size} ranks: the group size must divide the K/V "
                             "heads or be a multiple of them")

    @property
    def kv_per_rank(self) -> int:
        return max(1, self.kv_heads // self.size)

    def kv_of(self, p: int) -> slice:
        """The K/V heads rank ``p`` attends with."""
        if self.kv_heads >= self.size:
            return slice(p * self.kv_per_rank, (p + 1) * self.kv_per_rank)
        head = p // (self.size // self.kv_heads)
        return slice(head, head + 1)


def gather_kv(sp: SequenceGroup, heads: HeadSplit, local: list) -> list[torch.Tensor]:
    """Local ``[key, value]`` (B, Hkv, T/P, D) each -> K/V of every row for this rank's heads,
    (B, Hkv/P, T, D) each. Memory: ``local`` is emptied, each tensor dropped once its send buffer
    is made, and each send buffer once it is sent (the caller keeps no other reference)."""
    out = []
    while local:
        x = local.pop(0)
        B, _, n, D = x.shape
        send = torch.stack([x[:, heads.kv_of(p)] for p in range(sp.size)])  # (P, B, Hkv/P, T/P, D)
        del x
        recv = sp.exchange(send)  # [q]: rank q's rows
        del send
        # (B, Hkv/P, T, D): a view of recv when B = 1 and Hkv/P = 1
        out.append(recv.permute(1, 2, 0, 3, 4).reshape(B, heads.kv_per_rank, sp.size * n, D))
        del recv
    return out


def scatter_kv_grads(sp: SequenceGroup, heads: HeadSplit, grads: list, local_rows: int):
    """dK/dV of every row for this rank's heads, ``grads = [dkey, dvalue]`` (B, Hkv/P, T, D) each ->
    dK/dV of the local rows for all heads (B, Hkv, T/P, D), summed over the ranks that share a
    replicated head. Memory: ``grads`` is emptied, each tensor dropped once it is sent (the caller
    keeps no other reference), so the step holds at most one all-rows gradient beside what came
    back, never both with their copies."""
    out = []
    while grads:
        d = grads.pop(0)
        B, h, _, D = d.shape
        send = d.view(B, h, sp.size, local_rows, D).permute(2, 0, 1, 3, 4)  # (P, B, Hkv/P, T/P, D): [q] = rank q's rows
        del d
        recv = sp.exchange(send)  # [p]: my rows, rank p's heads, (P, B, Hkv/P, T/P, D)
        del send
        if heads.kv_heads >= sp.size:  # (each K/V head on one rank: rank p's block is heads kv_of(p), in order)
            out.append(recv.transpose(0, 1).reshape(B, heads.kv_heads, local_rows, D))  # (a view when B = 1)
        else:
            full = recv.new_zeros(B, heads.kv_heads, local_rows, D)
            for p in range(sp.size):
                full[:, heads.kv_of(p)] += recv[p]
            out.append(full)
        del recv
    return out


@dataclass
class Exchange:
    """The sequence-parallel state of one streamed layer call, for its chunk attention: the group,
    the head split, every row's K/V for this rank's heads (and the sink of their gradients in
    backward), and how to build each block's masks by global position."""

    sp: SequenceGroup
    heads: HeadSplit
    key: torch.Tensor  # (B, Hkv/P, T, D)
    value: torch.Tensor
    local_rows: int
    masks_of: object  # (global start, global end) -> ChunkMasks
    sink: PrefixGradSink | None = None

    def attention(self, query: torch.Tensor, start: int, end: int, scale: float, softcap: float | None):
        """query (B, Hq, c, D) of the local rows [start, end) -> their attention output, (B, Hq, c, D)."""
        return _UlyssesAttention.apply(query, self, start, end, scale, softcap)


def _blocks(ex: Exchange, q_blocks: torch.Tensor, start: int, end: int, scale: float, softcap, grad: bool):
    """Attention of each received block (rank q's chunk rows, this rank's heads) against the K/V rows
    it may see; (outputs, the own-block K/V leaves per block, when ``grad``)."""
    outs, leaves = [], []
    for q in range(ex.sp.size):
        g0, g1 = q * ex.local_rows + start, q * ex.local_rows + end  # the block's global rows
        masks = ex.masks_of(g0, g1)
        kb = masks.key_begin
        prefix_key = prefix_value = None
        if g0 > kb:
            prefix_key, prefix_value = ex.key[:, :, kb:g0], ex.value[:, :, kb:g0]
            if grad:  # (leaves: the two-block attention sends their gradient into the sink)
                prefix_key, prefix_value = prefix_key.detach().requires_grad_(), prefix_value.detach().requires_grad_()
        own_key, own_value = ex.key[:, :, g0:g1], ex.value[:, :, g0:g1]
        if grad:
            own_key, own_value = own_key.detach().requires_grad_(), own_value.detach().requires_grad_()
            leaves.append((g0, g1, own_key, own_value, kb, prefix_key, prefix_value))
        outs.append(chunk_attention(q_blocks[q], prefix_key, prefix_value, own_key, own_value, masks, scale,
                                    ex.sink if grad else None, softcap=softcap))
    return outs, leaves


class _UlyssesAttention(torch.autograd.Function):
    """The local chunk's queries -> exchange -> attention of every rank's chunk for this rank's heads
    -> inverse exchange -> the local chunk's output. Every rank calls it for the same chunk index."""

    @staticmethod
    def forward(ctx, query, ex: Exchange, start: int, end: int, scale: float, softcap):
        B, Hq, c, D = query.shape
        P = ex.sp.size
        # (P, B, Hq/P, c, D): [p] = my rows for rank p's heads -> [q] = rank q's rows for my heads
        q_blocks = ex.sp.exchange(query.view(B, P, Hq // P, c, D).transpose(0, 1))
        if ex.sink is not None:  # (the backward's recompute: a graph to backpropagate at once)
            q_blocks = q_blocks.detach().requires_grad_()
            with torch.enable_grad():
                outs, leaves = _blocks(ex, q_blocks, start, end, scale, softcap, grad=True)
            ctx.q_blocks, ctx.outs, ctx.leaves, ctx.ex = q_blocks, outs, leaves, ex
        else:
            with torch.no_grad():
                outs, _ = _blocks(ex, q_blocks, start, end, scale, softcap, grad=False)
        back = ex.sp.exchange(torch.stack(outs))  # [p]: my rows, rank p's heads
        return back.transpose(0, 1).reshape(B, Hq, c, D)

    @staticmethod
    def backward(ctx, grad_out):
        ex: Exchange = ctx.ex
        B, Hq, c, D = grad_out.shape
        P = ex.sp.size
        d_blocks = ex.sp.exchange(grad_out.contiguous().view(B, P, Hq // P, c, D).transpose(0, 1))
        own = [t for g0, g1, k, v, *_ in ctx.leaves for t in (k, v)]
        prefix = [t for *_, pk, pv in ctx.leaves for t in (pk, pv) if t is not None]
        inputs = [ctx.q_blocks, *own, *prefix]
        grads = torch.autograd.grad(ctx.outs, inputs, list(d_blocks), allow_unused=True)
        dq_blocks, own_grads = grads[0], grads[1: 1 + len(own)]
        prefix_grads = iter(grads[1 + len(own):])
        for i, (g0, g1, _, _, kb, pk, _) in enumerate(ctx.leaves):
            dk, dv = own_grads[2 * i], own_grads[2 * i + 1]
            if dk is not None:
                ex.sink.add(g0, g1, dk, dv)
            if pk is not None:  # (returned, not sunk, where the attention took the single-call path)
                dpk, dpv = next(prefix_grads), next(prefix_grads)
                if dpk is not None:
                    ex.sink.add(kb, g0, dpk, dpv)
        del ctx.outs, ctx.leaves
        dq = ex.sp.exchange(dq_blocks)  # [p]: my rows' query gradient for rank p's heads
        return dq.transpose(0, 1).reshape(B, Hq, c, D), None, None, None, None, None


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the group, on every rank. Backward: the gradient passes to this rank's
    share (times ``grad_scale``), so that the ranks' parameter gradients, summed by
    ``reduce_gradients``, are those of the one objective (not P copies of it)."""

    @staticmethod
    def forward(ctx, t, sp: SequenceGroup, grad_scale: float):
        ctx.grad_scale = grad_scale
        return sp.all_reduce_sum(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.grad_scale if ctx.grad_scale != 1 else grad, None, None


def sum_over_group(t: torch.Tensor, sp: SequenceGroup, grad_scale: float = 1.0) -> torch.Tensor:
    """``t`` summed over the sequence-parallel group (see ``_SumOverGroup``). ``grad_scale`` P: for
    an engine that averages the gradients over the group's ranks instead of summing them."""
    return _SumOverGroup.apply(t, sp, grad_scale)


class _GatherOverGroup(torch.autograd.Function):
    """Forward: every rank's (B, T/P, ...) rows in order, (B, T, ...), on every rank. Backward: this
    rank's rows of the gradient (times ``grad_scale``). Every rank computes the same objective from
    the gathered tensor, so each holds the same gradient of it; taking its own rows makes the ranks'
    parameter gradients the shares of the one objective, as ``_SumOverGroup`` does for a sum."""

    @staticmethod
    def forward(ctx, local, sp: SequenceGroup, grad_scale: float):
        ctx.sp, ctx.rows, ctx.grad_scale = sp, local.shape[1], grad_scale
        return sp.all_gather_rows(local)

    @staticmethod
    def backward(ctx, grad):
        start = ctx.sp.offset(ctx.rows)
        mine = grad[:, start: start + ctx.rows]
        return (mine * ctx.grad_scale if ctx.grad_scale != 1 else mine.clone()), None, None


def gather_over_group(local: torch.Tensor, sp: SequenceGroup, grad_scale: float = 1.0) -> torch.Tensor:
    """The whole sequence's rows of ``local`` (per-token results, (B, T/P, ...)) on every rank, with
    a gradient that goes back to this rank's rows (see ``_GatherOverGroup``)."""
    return _GatherOverGroup.apply(local, sp, grad_scale)


def shift_labels_across(sp: SequenceGroup, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """This rank's rows of the whole sequence's shifted labels: row t is scored against label t + 1,
    also where t + 1 lies on the next rank; the sequence's last row against nothing (``ignore_index``).
    Memory: only each rank's first label is gathered, (B, P), not the (B, T) labels."""
    firsts = sp.all_gather_rows(labels[:, :1])  # (B, P): rank q's first label at [:, q]
    after = firsts[:, sp.rank + 1: sp.rank + 2] if sp.rank + 1 < sp.size else \
        labels.new_full((labels.shape[0], 1), ignore_index)  # (B, 1): the label after this rank's last row
    return torch.cat([labels[:, 1:], after], dim=1)


def reduce_gradients(parameters, group=None) -> None:
    """Sum every parameter's gradient over the sequence-parallel group (each rank's are those of its
    own rows), in place."""
    for p in parameters:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


__all__ = ["Exchange", "HeadSplit", "SequenceGroup", "gather_kv", "gather_over_group", "reduce_gradients",
           "scatter_kv_grads", "shift_labels_across", "sum_over_group"]
