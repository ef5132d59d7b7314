"""The load-balancing loss of mixture-of-experts layers, exact under streaming.

transformers' auxiliary loss (Switch Transformer eqs. 4-6, ``load_balancing_loss_func``) over the
router logits z of every MoE layer l and every (unpadded) token t, N = sum over layers of the tokens:

    p_lt = softmax(z_lt)                          (E,) router probabilities
    f_e  = (1/N) sum_lt [e in topk(p_lt)]         fraction of routings to expert e (a count: no gradient)
    P_e  = (1/N) sum_lt p_lt[e]                   mean probability of expert e
    aux  = E * sum_e f_e P_e

Both f and P are sums over all tokens, and aux is bilinear in them. So each streamed layer sums its
rows' counts and probabilities chunk by chunk in forward (E numbers each, no T-sized tensor), and
returns the probability sum as a second output of its Function; autograd then hands that output the
gradient d aux / d P_l = E f / N, the same for every token of the layer, and the layer's backward
adds it to each recomputed chunk's probability sum. The gradient is exact, the routing is never kept.

Under sequence parallelism each rank sums its own rows; the counts, the token count and the
probability sums are summed over the group (the last with the gradient of this rank's share), so
every rank has the whole sequence's loss, as for the cross-entropy.
"""

from __future__ import annotations

import torch


class RouterStats:
    """The routing statistics of one streamed forward, filled layer by layer."""

    def __init__(self, key_keep: torch.Tensor | None, batch: int, length: int, sequence=None):
        self.sequence = sequence  # a SequenceGroup: the rows are this rank's of a shared sequence
        self.key_keep = key_keep  # (B, T) bool or None: padded tokens do not count (as in transformers)
        # tokens each layer counts (a tensor: no host sync)
        self.tokens = key_keep.sum() if key_keep is not None else torch.tensor(batch * length)
        self.counts: torch.Tensor | None = None  # (E,) routings per expert, all layers
        self.prob_sums: list[torch.Tensor] = []  # (E,) per layer, outputs of the layer Functions

    def _weights(self, start: int, end: int, rows: int) -> torch.Tensor | None:
        """(B*c, 1) 0/1 weights of the chunk's tokens in the router's row order, None: all count."""
        if self.key_keep is None:
            return None
        return self.key_keep[:, start:end].reshape(rows, 1)

    def chunk_prob_sum(self, logits: torch.Tensor, start: int, end: int, router=None) -> torch.Tensor:
        """(E,) sum of the router probabilities of rows [start, end) (logits (B*c, E)), with graph
        when grad is enabled; accumulated in at least fp32, as transformers does. With the
        ``router`` (forward), the rows' top-k routings are counted too, from the same probabilities."""
        probs = torch.softmax(logits, dim=-1)  # (B*c, E)
        weights = self._weights(start, end, logits.shape[0])
        if router is not None:
            self._count(router, probs, weights)
        probs = probs.to(torch.promote_types(logits.dtype, torch.float32))
        return (probs if weights is None else probs * weights).sum(0)

    def _count(self, router, probs: torch.Tensor, weights: torch.Tensor | None) -> None:
        with torch.no_grad():
            chosen = torch.topk(probs, router.top_k, dim=-1).indices  # (B*c, k)
            ones = torch.ones(chosen.shape, dtype=torch.float32, device=chosen.device)
            if weights is not None:
                ones = ones * weights
            counts = torch.zeros(router.num_experts, dtype=torch.float32, device=chosen.device)
            counts.scatter_add_(0, chosen.reshape(-1), ones.reshape(-1))
            self.counts = counts if self.counts is None else self.counts + counts

    def loss(self, grad_scale: float = 1.0) -> torch.Tensor | None:
        """transformers' auxiliary loss, differentiable through every layer's probability sum
        (``grad_scale``: as ``sum_over_group`` takes it, under sequence parallelism)."""
        if not self.prob_sums:
            return None
        prob_sum = torch.stack(self.prob_sums).sum(0)  # (E,)
        tokens, counts = self.tokens, self.counts
        if self.sequence is not None:  # (E + 1 numbers cross ranks, and E back in backward)
            from ._ulysses import sum_over_group

            tokens = self.sequence.all_reduce_sum(tokens.to(counts.device))
            counts = self.sequence.all_reduce_sum(counts)
            prob_sum = sum_over_group(prob_sum, self.sequence, grad_scale)
        rows = tokens.to(prob_sum) * len(self.prob_sums)
        fraction = counts.to(prob_sum.dtype) / rows
        return (fraction * (prob_sum / rows)).sum() * counts.numel()  # (E experts)
