"""Exact soft-capped attention (Gemma2) for one chunk of query rows, one key block at a time.

For query row i and visible key j (causal, sliding window, padding, same packed document):

    t_ij = tanh(scale * q_i.k_j / cap),   s_ij = cap * t_ij   (s_ij = -inf where j is not visible)
    P_ij = exp(s_ij - lse_i),  lse_i = log sum_j exp(s_ij),   O_i = sum_j P_ij v_j

SDPA has no hook for the tanh, and the (c x keys) score matrix is what leanbp never holds, so the
keys go by in blocks of at most ``BLOCK_ROWS`` (online softmax): with a running max m_i, sum l_i and
output accumulator a_i, a block rescales the old terms by exp(m_old - m_new) and adds its own
exp(s_ij - m_new) (to l_i) and exp(s_ij - m_new) v_j (to a_i); at the end O_i = a_i / l_i and
lse_i = m_i + log l_i. Rows that see no key output 0 (lse 0), as the two-block path does.

Backward recomputes each block's P_ij = exp(s_ij - lse_i) exactly from the saved lse:

    dV_j = sum_i P_ij dO_i,   dP_ij = dO_i.v_j,   dS_ij = P_ij (dP_ij - delta_i),
    delta_i = sum_j P_ij dP_ij = dO_i.O_i,   dR_ij = dS_ij (1 - t_ij^2) scale   (R = q.k, raw)
    dQ_i = sum_j dR_ij k_j,   dK_j = sum_i dR_ij q_i

Every key row belongs to one block and every query row of the chunk is present, so each block's
dK, dV rows are final when the block is done. GQA: query head h = j * G + g reads K/V head j
(transformers' repeat_kv), so (B, Hq, c, D) is viewed as (B, Hkv, G * c, D) and K/V are never
repeated.
"""

from __future__ import annotations

import torch

from ._masks import ChunkMasks, PrefixGradSink

BLOCK_ROWS = 1024  # Memory: the score temporaries are (B, Hq, c, BLOCK_ROWS)


def _key_blocks(masks: ChunkMasks, prefix_rows: int):
    """(part, b0, b1, k0): rows [b0, b1) of part 0 (the prefix) or 1 (own rows); k0 = key row of b0."""
    for part, first, n in ((0, masks.key_begin, prefix_rows), (1, masks.start, masks.end - masks.start)):
        for b0 in range(0, n, BLOCK_ROWS):
            yield part, b0, min(b0 + BLOCK_ROWS, n), first + b0


def _scores(q, k, mask, scale: float, softcap: float, groups: int):
    """q (B, Hkv, G*c, D), k (B, Hkv, n, D) -> (t, s), both (B, Hkv, G*c, n): the tanh and the capped,
    masked scores."""
    t = torch.tanh((q @ k.transpose(-1, -2)) * (scale / softcap))  # (B, Hkv, G*c, n)
    s = (t * softcap).unflatten(2, (groups, -1))  # (B, Hkv, G, c, n), mask broadcasts over G
    return t, s.masked_fill(~mask, float("-inf")).flatten(2, 3)


class _SoftcapAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, prefix_key, prefix_value, key, value, masks, scale, softcap, sink):
        B, Hq, c, D = query.shape
        Hkv = key.shape[1]
        G = Hq // Hkv
        acc = torch.promote_types(query.dtype, torch.float32)  # float64 stays float64
        parts = ((prefix_key, prefix_value), (key, value))
        prefix_rows = 0 if prefix_key is None else prefix_key.shape[2]
        with torch.autocast(query.device.type, enabled=False):  # the accumulation dtype is ours
            q = query.to(acc).reshape(B, Hkv, G * c, D)  # (B, Hq, c, D) -> (B, Hkv, G*c, D)
            m = q.new_full((B, Hkv, G * c), float("-inf"))  # running max
            l = q.new_zeros((B, Hkv, G * c))  # running sum of exp(s - m)
            o = torch.zeros_like(q)  # running sum of exp(s - m) v
            # Memory: only these three and one block's (B, Hkv, G*c, n) scores exist at a time
            for part, b0, b1, k0 in _key_blocks(masks, prefix_rows):
                k_b, v_b = (x[:, :, b0:b1].to(acc) for x in parts[part])  # (B, Hkv, n, D)
                mask = masks.block(k0, k0 + b1 - b0)[:, :, None]  # (B|1, 1, 1, c, n): over Hkv and G
                _, s = _scores(q, k_b, mask, scale, softcap, G)
                m_new = torch.maximum(m, s.amax(-1))  # stays -inf until the row sees a key
                shift = m_new.masked_fill(m_new == float("-inf"), 0.0)  # finite: exp(-inf - shift) = 0
                e = torch.exp(s - shift[..., None])  # (B, Hkv, G*c, n)
                decay = torch.exp(m - shift)
                l = l * decay + e.sum(-1)
                o = o * decay[..., None] + e @ v_b  # (B, Hkv, G*c, n) @ (B, Hkv, n, D)
                m = m_new
                del s, e, shift
            seen = l > 0
            out = (o / torch.where(seen, l, 1.0)[..., None]).reshape(B, Hq, c, D).to(query.dtype)
            lse = torch.where(seen, m + l.log(), 0.0)  # (B, Hkv, G*c); 0 for rows that see nothing
        ctx.scale, ctx.softcap, ctx.masks, ctx.sink = scale, softcap, masks, sink
        # Memory: the inputs, the output and lse are kept; no scores or probabilities.
        ctx.save_for_backward(query, prefix_key, prefix_value, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, prefix_key, prefix_value, key, value, out, lse = ctx.saved_tensors
        masks, sink = ctx.masks, ctx.sink
        B, Hq, c, D = query.shape
        Hkv = key.shape[1]
        G = Hq // Hkv
        acc = torch.promote_types(query.dtype, torch.float32)
        parts = ((prefix_key, prefix_value), (key, value))
        prefix_rows = 0 if prefix_key is None else prefix_key.shape[2]
        # key-side gradients, written block by block (no key row is in two blocks); the prefix's go
        # into the sink instead when there is one
        grads = [None if part[0] is None or (i == 0 and sink is not None) else
                 (torch.empty_like(part[0]), torch.empty_like(part[1])) for i, part in enumerate(parts)]
        with torch.autocast(query.device.type, enabled=False):
            q = query.to(acc).reshape(B, Hkv, G * c, D)  # (B, Hkv, G*c, D)
            do = grad_out.to(acc).reshape(B, Hkv, G * c, D)
            delta = (do * out.to(acc).reshape(B, Hkv, G * c, D)).sum(-1, keepdim=True)  # (B, Hkv, G*c, 1)
            dq = torch.zeros_like(q)
            for part, b0, b1, k0 in _key_blocks(masks, prefix_rows):
                k_b, v_b = (x[:, :, b0:b1].to(acc) for x in parts[part])  # (B, Hkv, n, D)
                t, s = _scores(q, k_b, masks.block(k0, k0 + b1 - b0)[:, :, None], ctx.scale, ctx.softcap, G)
                p = torch.exp(s - lse[..., None])  # (B, Hkv, G*c, n), 0 where masked
                del s
                dv_b = p.transpose(-1, -2) @ do  # (B, Hkv, n, G*c) @ (B, Hkv, G*c, D): sums the G heads
                dr = p * (do @ v_b.transpose(-1, -2) - delta)  # dS, (B, Hkv, G*c, n)
                del p
                dr = dr * (1.0 - t * t) * ctx.scale  # through the cap and the scale: dL/d(q.k)
                del t
                dq += dr @ k_b  # (B, Hkv, G*c, n) @ (B, Hkv, n, D)
                dk_b = dr.transpose(-1, -2) @ q  # (B, Hkv, n, D)
                del dr
                if grads[part] is None:  # prefix with a sink: its rows start at key_begin
                    sink.add(masks.key_begin + b0, masks.key_begin + b1, dk_b, dv_b)
                else:
                    grads[part][0][:, :, b0:b1] = dk_b
                    grads[part][1][:, :, b0:b1] = dv_b
                del dk_b, dv_b
        dq = dq.reshape(B, Hq, c, D).to(query.dtype)
        dpk, dpv = grads[0] if grads[0] is not None else (None, None)
        return dq, dpk, dpv, *grads[1], None, None, None, None


def softcap_chunk_attention(query, prefix_key, prefix_value, key, value, masks: ChunkMasks, scale: float,
                            softcap: float, sink: PrefixGradSink | None = None) -> torch.Tensor:
    """``chunk_attention`` with Gemma2's soft-capped logits: query (B, Hq, c, D); prefix_key/value
    (B, Hkv, p, D) or None; key/value (B, Hkv, c, D) -> (B, Hq, c, D).

    With a ``sink`` (and a prefix that needs gradients) the prefix's K/V gradients are added into it
    (rows key_begin..start) rather than returned through autograd."""
    if torch.is_autocast_enabled(query.device.type) and query.dtype != torch.float64:
        dtype = torch.get_autocast_dtype(query.device.type)  # as SDPA under autocast
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        if prefix_key is not None:
            prefix_key, prefix_value = prefix_key.to(dtype), prefix_value.to(dtype)
    use_sink = sink is not None and prefix_key is not None and prefix_key.requires_grad
    if use_sink:
        prefix_key, prefix_value = prefix_key.detach(), prefix_value.detach()
    return _SoftcapAttention.apply(query, prefix_key, prefix_value, key, value, masks, scale, float(softcap),
                                   sink if use_sink else None)
