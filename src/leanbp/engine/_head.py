"""Final norm + LM head over the rows that carry a label, chunked so that full (T, V) logits never
exist: at most ``chunk_size`` rows of logits live at a time, and unlabelled rows (prompt,
padding) are skipped, not computed and masked.

Two autograd Functions share the per-chunk pieces below:

* ``ChunkedCrossEntropyFunction``: transformers' causal-LM loss (row t scored against labels[t+1],
  -100 ignored, the sum divided by ``num_items_in_batch`` or the count of labelled rows). The loss
  is a fixed linear function of the per-token log-probs, so each chunk's gradient is taken right
  after its loss and the logits are freed; backward only scales the stored gradients by
  dL/dloss. Three head matmuls per row.
* ``ChunkedTokenStatsFunction``: per-token log-probs (and, on request, entropy and statistics
  without gradient) with a real backward, so any loss built from them (DPO, GRPO, a user's) gets
  exact gradients. Forward keeps only each row's log-sum-exp (and entropy); backward recomputes
  each chunk's logits. Four head matmuls per row, the minimum for a loss not known in forward.

Logits are upcast to at least fp32 before the softmax (as transformers does); float64 stays
float64. A ``LogitTransform`` applies logit scaling, final soft-capping and a sampling temperature
(TRL's fused head semantics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..memory import in_phase
from ._grads import AutocastState, GradSum
from ._module_call import call_through
from ._split import INPUT, WEIGHT, current_pass, wanted
from ._value_reads import labelled_rows

IGNORE_INDEX = -100
STATS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """labels (B, T) -> targets (B, T): row t is scored against labels[t + 1]; the last row is ignored."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


@dataclass(frozen=True)
class LogitTransform:
    """z = softcap * tanh(scale * logits / softcap) / temperature (no tanh without a softcap)."""

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None and self.temperature == 1.0

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """In place on an accumulation-dtype buffer."""
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        if self.temperature != 1.0:
            logits.div_(self.temperature)
        return logits

    def applied(self, logits: torch.Tensor) -> torch.Tensor:
        """Full logits transformed as transformers does, in their dtype (computed in at least
        float32; in place when they already are)."""
        if self.identity:
            return logits
        return self.apply_(logits.to(torch.promote_types(logits.dtype, torch.float32))).to(logits.dtype)

    def chain_(self, dz: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        """dL/dz -> dL/dlogits in place; ``z`` (the transformed logits) is needed only with a softcap."""
        if self.softcap is not None:
            t = z * (self.temperature / self.softcap)  # tanh(scale * logits / softcap)
            dz.mul_(t.mul_(t).neg_().add_(1))
        factor = self.scale / self.temperature
        if factor != 1.0:
            dz.mul_(factor)
        return dz


@dataclass
class HeadCall:
    """Everything a chunked head call needs besides its input and parameters."""

    norm: nn.Module
    lm_head: nn.Module
    targets: torch.Tensor  # (B, T): row t is scored against targets[:, t]; IGNORE_INDEX skips it
    chunk_size: int
    autocast: AutocastState
    transform: LogitTransform = field(default_factory=LogitTransform)
    # TRL's cast_lm_head_to_fp32: the projection runs in fp32, outside autocast
    fp32_head: bool = False
    # The input is a tensor nothing else will read (the last streamed layer's output): its rows
    # may be overwritten with their gradient once read. Set only by callers that own that tensor.
    input_is_scratch: bool = False
    # the loss's parameter gradients are computed in the weight pass of a split backward, not in
    # forward (``ChunkedCrossEntropyFunction``)
    defer_param_grads: bool = False

    def __post_init__(self):
        if self.defer_param_grads and self.input_is_scratch:
            raise ValueError("a head that defers its parameter gradients recomputes from its input: it cannot be scratch")

    @property
    def fused(self) -> bool:
        """A plain nn.Linear head gets the fused path (one (n, V) buffer per chunk, its gradients
        written in place); anything else (a PEFT-wrapped head, say) goes through autograd."""
        return type(self.lm_head) is nn.Linear

    def labelled_rows(self) -> torch.Tensor:
        """Flat indices (into B*T) of the rows that carry a label."""
        return labelled_rows(self.targets, IGNORE_INDEX)

    def head_params(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.lm_head.weight, self.lm_head.bias) if self.fused else (None, None)


class _Chunk:
    """One chunk of labelled rows: the normed rows, the logits buffer and the way back.

    ``inputs`` are the tensors whose gradients are wanted (the rows themselves first, when they
    need one, then the trainable parameters of the norm and the head)."""

    def __init__(self, call: HeadCall, rows: torch.Tensor, inputs: list[torch.Tensor], graph: bool):
        self.call, self.rows, self.inputs = call, rows, inputs
        head = call.lm_head
        with torch.set_grad_enabled(graph), call.autocast():
            self.normed = call.norm(rows)  # (n, H), graph kept for its backward
            if call.fused:
                with torch.no_grad():
                    self.logits = self._project(head.weight, head.bias)  # (n, V)
            else:
                # graph through the wrapped head; .forward: the chunks run inside one call of the head
                # (call_through), whose hooks must not fire again per chunk
                self.logits = head.forward(self.normed)  # (n, V)
        # Memory: no copy unless the logits are bf16/fp16 (the transform and softmax work in place)
        acc = self.logits.to(torch.promote_types(self.logits.dtype, torch.float32))
        if call.fused:
            del self.logits  # only z is needed from here on
        elif acc is self.logits:
            acc = acc.clone()  # the wrapped head's graph output must stay intact for its backward
        self.z = call.transform.apply_(acc)

    def _project(self, weight, bias):
        call = self.call
        if call.fp32_head:
            with torch.autocast(self.normed.device.type, enabled=False):
                return F.linear(self.normed.float(), weight.float(), None if bias is None else bias.float())
        return F.linear(self.normed, weight, bias)

    def backprop(self, dz: torch.Tensor, z_kept: torch.Tensor | None, head_grads: dict) -> list:
        """dz (n, V), dL/dz in the accumulation dtype (may be the z buffer itself) -> the gradients
        of ``inputs`` (the head's own, on the fused path, go into ``head_grads`` in place)."""
        call, inputs = self.call, self.inputs
        dlogits = call.transform.chain_(dz, z_kept)
        if not call.fused:
            return list(torch.autograd.grad(self.logits, inputs, dlogits.to(self.logits.dtype), allow_unused=True))
        weight, bias = call.lm_head.weight, call.lm_head.bias
        # the backward matmuls run in the weight's dtype (fp32 under TRL's fp32 head): under autocast
        # (fp32 weight, bf16 logits) that avoids a bf16 copy of the (V, H) weight per chunk
        grad_dtype = torch.float32 if call.fp32_head else weight.dtype
        dlogits = dlogits.to(grad_dtype)
        x = self.normed.detach().to(grad_dtype)
        if "weight" in head_grads:
            w_grad = head_grads["weight"]
            if w_grad.dtype == grad_dtype:
                w_grad.addmm_(dlogits.T, x)  # (V, H), in place: no temporary
            else:
                w_grad.add_(dlogits.T @ x)  # low-precision weight: a (V, H) temporary summed in fp32
        if "bias" in head_grads:
            head_grads["bias"].add_(dlogits.sum(0))
        dnormed = (dlogits @ weight.to(grad_dtype)).to(self.normed.dtype)  # (n, H)
        del dlogits
        norm_inputs = [t for t in inputs if t is not weight and t is not bias]
        norm_grads = iter(torch.autograd.grad(self.normed, norm_inputs, dnormed, allow_unused=True)
                          if norm_inputs else ())
        return [None if t is weight or t is bias else next(norm_grads) for t in inputs]


class _Rows:
    """The labelled rows of a (B, T, H) input and the bookkeeping both Functions share."""

    def __init__(self, ctx, hidden: torch.Tensor, call: HeadCall, params, first_param: int):
        B, T, H = hidden.shape
        self.shape = hidden.shape
        self.flat = hidden.reshape(B * T, H)
        self.targets = call.targets.reshape(B * T)
        self.index = call.labelled_rows()
        self.need_input, self.need_params = wanted(ctx, first_param)  # (in forward: the full pass)
        self.trainable = [p for p, need in zip(params, self.need_params) if need]
        self.call = call

    def chunks(self):
        for s in range(0, self.index.numel(), self.call.chunk_size):
            yield self.index[s: s + self.call.chunk_size]

    def read(self, idx: torch.Tensor, want_grad: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        rows = self.flat.index_select(0, idx).detach().requires_grad_(want_grad and self.need_input)
        return rows, ([rows] if self.need_input else []) + self.trainable

    def grad_buffer(self) -> torch.Tensor:
        """The (B*T, H) input gradient: unlabelled rows get zero."""
        if self.call.input_is_scratch:
            # Memory: dL/dhidden goes into the input's own buffer. Each labelled row is read (copied
            # out) before its gradient is written back; unlabelled rows are never read.
            return self.flat.masked_fill_((self.targets == IGNORE_INDEX)[:, None], 0)
        return torch.zeros_like(self.flat)

    def head_grad_sums(self, grads: GradSum) -> dict[str, torch.Tensor]:
        """The running sums of a fused head's own gradients (in ``grads``), added to in place chunk by chunk."""
        weight, bias = self.call.head_params()
        return {name: grads.sum_of(i) for name, t in (("weight", weight), ("bias", bias)) if t is not None
                for i, p in enumerate(self.trainable) if p is t}


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a[i, v] * b[i, v] per row, without an (n, V) product (a batched matmul reads both in place)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _backward_once(ctx, name: str) -> None:
    """Each part of the head's backward (input gradient, parameter gradients) is handed over once:
    both in a full pass, one each in a split backward's input and weight passes (``_split.py``)."""
    parts = {INPUT: {"input"}, WEIGHT: {"params"}}.get(current_pass(), {"input", "params"})
    handed = getattr(ctx, "handed", set())
    if parts & handed:
        raise RuntimeError(
            f"backward through leanbp's {name} ran twice (retain_graph=True): the streamed step hands its "
            "summed gradients over and reuses its buffers in the first backward. Run the forward again instead."
        )
    ctx.handed = handed | parts


def _param_grads(need_params: list[bool], grads: list) -> tuple:
    it = iter(grads)
    return tuple(next(it) if need else None for need in need_params)


def _cross_entropy_chunks(r: _Rows, call: HeadCall, want_grad: bool, grads: GradSum,
                          dflat: torch.Tensor | None) -> torch.Tensor:
    """The summed CE of ``r``'s labelled rows, chunk by chunk; with ``want_grad`` the gradients of
    the rows (into ``dflat``) and of ``r.trainable`` (into ``grads``) of that sum, from the same
    logits."""
    total = torch.zeros((), dtype=torch.promote_types(r.flat.dtype, torch.float32), device=r.flat.device)
    head_grads = r.head_grad_sums(grads) if want_grad and call.fused else {}
    for idx in r.chunks():
        rows, inputs = r.read(idx, want_grad)
        targets = r.targets.index_select(0, idx)
        chunk = _Chunk(call, rows, inputs, graph=want_grad)
        z = chunk.z
        z_kept = z.clone() if want_grad and call.transform.softcap is not None else None
        # Memory: log-softmax in the z buffer itself, one pass and no (n, V) temporary (a
        # logsumexp and a subtraction took two passes more)
        log_p = torch.log_softmax(z, dim=-1, out=z)  # (n, V)
        total -= log_p.gather(1, targets[:, None]).sum()
        if want_grad:
            # d(sum CE)/dz = softmax - onehot, computed in the same buffer
            dz = log_p.exp_()
            dz[torch.arange(dz.shape[0], device=dz.device), targets] -= 1
            g = chunk.backprop(dz, z_kept, head_grads)
            if r.need_input:
                dflat.index_copy_(0, idx, g.pop(0))  # each row is in exactly one chunk
            grads.add(g)
            del dz  # (the z buffer: gone before the next chunk's logits exist)
        del chunk, z, log_p
    return total


class ChunkedCrossEntropyFunction(torch.autograd.Function):
    """hidden (B, T, H), call, *params -> the summed cross-entropy of the labelled rows divided by
    ``denominator`` (a scalar).

    The loss is a scalar, so forward computes every gradient of it from the same logits and
    backward only scales them. With ``call.defer_param_grads`` (a pipeline that defers its weight
    passes, 2BP) forward computes only the input's gradient and the weight pass recomputes the
    logits for the parameters': otherwise every micro-batch waiting for its weight pass would hold
    a (V, H) gradient sum."""

    @staticmethod
    @in_phase("head")
    def forward(ctx, hidden: torch.Tensor, call: HeadCall, denominator, grad_enabled: bool, *params):
        r = _Rows(ctx, hidden, call, params, first_param=4)
        want_grad = grad_enabled and (r.need_input or bool(r.trainable))
        deferred = want_grad and call.defer_param_grads and bool(r.trainable)
        if deferred:  # Memory: the input is kept to recompute the logits in the weight pass
            r.trainable = []
            ctx.save_for_backward(hidden, *params)
        n_rows = r.index.numel()
        if n_rows and not (torch.is_tensor(denominator) or denominator):
            raise ValueError(f"num_items_in_batch is 0 but the batch has {n_rows} labelled tokens")
        grads = GradSum(r.trainable if want_grad else [])  # (takes zeroed gradients: only when it returns them)
        dflat = r.grad_buffer() if want_grad and r.need_input else None
        total = _cross_entropy_chunks(r, call, want_grad, grads, dflat)
        loss = total / denominator  # no labelled row and no count: 0 / 0 = nan, as in transformers
        ctx.call, ctx.deferred = call, deferred
        ctx.denominator = denominator
        ctx.n_rows = n_rows
        ctx.param_grads = grads if want_grad else None
        ctx.hidden_shape = hidden.shape
        # kept as a plain attribute, not saved: with a scratch input it is that (modified) input
        ctx.dflat = dflat
        return loss

    @staticmethod
    @in_phase("head")
    def backward(ctx, grad_loss: torch.Tensor):
        _backward_once(ctx, "chunked loss")
        if ctx.param_grads is None:
            raise RuntimeError("leanbp's chunked loss was computed with gradients disabled and cannot be backpropagated")
        need_input, need_params = wanted(ctx, 4)
        # no labelled row: every gradient is zero (plain autograd's 0 * inf would make them nan)
        scale = grad_loss / ctx.denominator if ctx.n_rows else grad_loss.new_zeros(())
        dinput = None
        if need_input:
            dflat, ctx.dflat = ctx.dflat, None
            dinput = dflat.mul_(scale.to(dflat.dtype)).view(ctx.hidden_shape)
        if not any(need_params):  # (an input pass: the weight pass hands them over)
            return (dinput, None, None, None, *[None] * len(need_params))
        if ctx.deferred:  # the logits again, for the parameters only (their input's gradient is done)
            hidden, *params = ctx.saved_tensors
            r = _Rows(ctx, hidden, ctx.call, params, first_param=4)
            r.need_input = False
            param_grads = GradSum(r.trainable)
            _cross_entropy_chunks(r, ctx.call, True, param_grads, None)
        else:
            # Memory: drop ctx's references so the summed gradients are handed over, not copied
            param_grads, ctx.param_grads = ctx.param_grads, None
        grads = param_grads.result(scale, zeros_for_missing=True)
        return (dinput, None, None, None, *_param_grads(need_params, grads))


class ChunkedTokenStatsFunction(torch.autograd.Function):
    """hidden (B, T, H), call, stats, *params -> one (B, T) tensor per name in ``STATS`` (None for
    those not in ``stats``): log_probs of the targets and entropy (both differentiable), and
    log(sum p^2), the mean transformed logit and whether the target is the first argmax (no
    gradient). Every stat is 0 (False) where the target is IGNORE_INDEX."""

    @staticmethod
    @in_phase("head")
    def forward(ctx, hidden: torch.Tensor, call: HeadCall, stats: tuple[str, ...], *params):
        ctx.set_materialize_grads(False)
        r = _Rows(ctx, hidden, call, params, first_param=3)
        acc = torch.promote_types(hidden.dtype, torch.float32)
        N = r.flat.shape[0]
        out = {name: torch.zeros(N, dtype=torch.bool if name == "is_top1" else acc, device=hidden.device)
               for name in STATS if name == "log_probs" or name in stats}
        lse_all = torch.empty(r.index.numel(), dtype=acc, device=hidden.device)  # per labelled row
        done = 0
        for idx in r.chunks():
            rows = r.flat.index_select(0, idx)
            targets = r.targets.index_select(0, idx)
            z = _Chunk(call, rows, [], graph=False).z  # (n, V)
            lse = torch.logsumexp(z, dim=-1)
            lse_all[done: done + idx.numel()] = lse
            done += idx.numel()
            out["log_probs"][idx] = z.gather(1, targets[:, None]).squeeze(1) - lse
            if "mean_logits" in out:
                out["mean_logits"][idx] = z.mean(-1)
            if "is_top1" in out:
                out["is_top1"][idx] = z.argmax(-1) == targets  # argmax: the first maximum
            if "entropy" in out or "log_sum_sq_probs" in out:
                p = torch.sub(z, lse[:, None]).exp_()  # (n, V) softmax: the only temporary
                if "entropy" in out:
                    out["entropy"][idx] = lse - _rowdot(p, z)  # H = lse - sum_v p_v z_v
                if "log_sum_sq_probs" in out:
                    out["log_sum_sq_probs"][idx] = _rowdot(p, p).log()
                del p
            del z
        ctx.call = call
        ctx.hidden_shape = hidden.shape
        entropy = out.get("entropy")
        ctx.save_for_backward(hidden, lse_all, entropy if entropy is not None else lse_all, *params)
        ctx.mark_non_differentiable(*[out[n] for n in ("log_sum_sq_probs", "mean_logits", "is_top1") if n in out])
        B, T = hidden.shape[:2]
        return tuple(out[name].view(B, T) if name in out else None for name in STATS)

    @staticmethod
    @in_phase("head")
    def backward(ctx, grad_log_probs, grad_entropy, *_):
        _backward_once(ctx, "per-token log-prob head")
        hidden, lse_all, entropy, *params = ctx.saved_tensors
        call: HeadCall = ctx.call
        r = _Rows(ctx, hidden, call, params, first_param=3)
        g_lp = grad_log_probs.reshape(-1) if grad_log_probs is not None else None
        g_ent = grad_entropy.reshape(-1) if grad_entropy is not None else None
        grads = GradSum(r.trainable)
        head_grads = r.head_grad_sums(grads) if call.fused else {}
        dflat = r.grad_buffer() if r.need_input else None
        done = 0
        for idx in r.chunks():
            n = idx.numel()
            lse = lse_all[done: done + n, None]
            done += n
            rows, inputs = r.read(idx, True)
            targets = r.targets.index_select(0, idx)
            chunk = _Chunk(call, rows, inputs, graph=True)
            z = chunk.z
            z_kept = z.clone() if call.transform.softcap is not None else None
            dz = z.sub_(lse)  # log p, in place
            if g_ent is not None:
                # dH/dz = -p (log p + H)
                h = entropy[idx, None]
                p = torch.exp(dz)
                dz.add_(h).mul_(-g_ent[idx, None].to(dz.dtype))
                if g_lp is not None:
                    dz.sub_(g_lp[idx, None].to(dz.dtype))
                dz.mul_(p)
                del p
            else:
                dz.exp_().mul_(-g_lp[idx, None].to(dz.dtype))  # d(log p_target)/dz = onehot - p
            if g_lp is not None:
                dz[torch.arange(n, device=dz.device), targets] += g_lp[idx].to(dz.dtype)
            g = chunk.backprop(dz, z_kept, head_grads)
            if r.need_input:
                dflat.index_copy_(0, idx, g.pop(0))
            grads.add(g)
            del chunk, z, dz
        dinput = dflat.view(ctx.hidden_shape) if dflat is not None else None
        return (dinput, None, None, *_param_grads(r.need_params, grads.result(zeros_for_missing=True)))


def token_stats(hidden: torch.Tensor, call: HeadCall, stats: tuple[str, ...], params) -> dict:
    """{name: (B, T) tensor} for "log_probs" and each requested name of ``STATS``. ``params()``
    gives the trainable parameters of the norm and the head, looked up inside the head's call."""
    unknown = set(stats) - set(STATS)
    if unknown:
        raise ValueError(f"unknown per-token statistics {sorted(unknown)}; choose from {STATS}")
    # inside one call of the LM head module: engine hooks gather it once, not once per chunk
    out = call_through(call.lm_head, lambda h: ChunkedTokenStatsFunction.apply(h, call, tuple(stats), *params()), hidden)
    return {name: t for name, t in zip(STATS, out) if t is not None}


def cross_entropy(hidden: torch.Tensor, call: HeadCall, denominator, params) -> torch.Tensor:
    """The summed CE of the labelled rows over ``denominator`` (transformers' causal-LM loss);
    ``params()`` as in ``token_stats``."""
    grad = torch.is_grad_enabled()
    return call_through(call.lm_head, lambda h: ChunkedCrossEntropyFunction.apply(h, call, denominator, grad, *params()),
                        hidden)


__all__ = ["HeadCall", "IGNORE_INDEX", "LogitTransform", "STATS", "cross_entropy", "shift_labels", "token_stats"]
