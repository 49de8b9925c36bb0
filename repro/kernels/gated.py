"""The decayed causal product (retention, gated linear attention, RFA's gate), chunked:

    S_i = diag(g_i) S_{i-1} + k_i v_i^T,  o_i = S_i^T q_i,   g_i = exp(log_g_i) in (0, 1]
    o_i = sum_{j<=i} ((q_i * prod_{j<t<=i} g_t) . k_j) v_j

log_g is (B, H, N) (one decay per step: retention, RFA) or (B, H, N, D) (a decay per key
dimension: GLA). Every exponent is of a sum of log decays inside one chunk of C tokens, never
over the whole sequence, so nothing under- or overflows however long the sequence:
  b_i = sum of log_g over the chunk up to i (inclusive; b_i in [b_C, 0])
  intra  o_i += sum_{j<=i in chunk} (q_i . k_j exp(b_i - b_j)) v_j
  inter  o_i += (q_i * exp(b_i))^T S,  S <- diag(exp(b_C)) S + sum_j (k_j * exp(b_C - b_j)) v_j^T
with S the state before the chunk, carried by a loop over the N / C chunks (its factors
exp(b_i), exp(b_C - b_j) and exp(b_C) are all <= 1).
The intra-chunk factor exp(b_i - b_j) is a (C, C) mask for one decay per step. Per key dimension
it is split around the chunk's midpoint r = b_C / 2, so one matmul does the chunk:
    (q_i * exp(b_i - r)) . (k_j * exp(r - b_j)),   both factors within exp(+-span / 2),
span = -b_C the decay across the chunk. Where a chunk decays by more than SPLIT_SPAN nats in
some dimension, the split's factors would leave the dtype's range; those chunks (found on the
host) are computed exactly from the (C, C, D) factors instead, SAFE_GROUP chunks at a time and
recomputed in the backward (checkpointed), so memory stays O(N C). GLA's gates (log sigmoid / 16)
decay a few nats per chunk: they never take that path.

Differentiable in q, k, v and log_g (autograd through these torch ops: every saved tensor is
O(N (C + D)) or a (D, M) state per chunk). Half-precision inputs run in fp32 and return their
dtype; fp64 stays fp64.
"""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# The largest decay (nats) across a chunk that the midpoint split takes: its factors reach
# exp(span / 2), and products of two of them (masked entries included) must stay finite.
SPLIT_SPAN = {torch.float32: 80.0, torch.float64: 600.0}
SAFE_GROUP = 16  # chunks computed at once on the exact path: (16, C, C, D) factors


def compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_gated_chunk(d: int, m: int) -> int:
    """C: 64 for the head sizes the layers use (measured on a CPU: docs/kernels.md), 32 for
    small heads, where the (C, C) blocks would outweigh the (D, M) states."""
    return 32 if d * m <= 32 * 32 else 64


def split_chunks(x, c):
    """(B, H, N, X) -> (B H, N / C, C, X), zero-padded up to a multiple of C (zero keys add
    nothing, a zero log decay decays nothing, padded queries are cut off)."""
    pad = (-x.shape[2]) % c
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(x.shape[0] * x.shape[1], -1, c, x.shape[-1])


def _exact_scores(q, k, b):
    """(G, C, D) x3 -> (G, C, C): sum_d q_id k_jd exp(b_id - b_jd) for j <= i, 0 above."""
    c = q.shape[1]
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    diff = (b[:, :, None, :] - b[:, None, :, :]).masked_fill(upper[None, :, :, None], float("-inf"))
    return (q[:, :, None, :] * k[:, None, :, :] * diff.exp()).sum(-1)  # (G, C, C)


def _per_dim_scores(q, k, b):
    """Intra-chunk scores for a decay per key dimension: q, k, b (L, nc, C, D) -> (L, nc, C, C)."""
    dt = b.dtype
    limit = SPLIT_SPAN[dt] / 2
    r = b[..., -1:, :] / 2  # (L, nc, 1, D): the chunk's midpoint in log space
    # clamped: in chunks the split cannot take, its factors stay finite (their scores are
    # replaced below, and finite factors keep the replaced entries' zero gradient from turning NaN)
    qs = q * (b - r).clamp(-limit, limit).exp()
    ks = k * (r - b).clamp(-limit, limit).exp()
    scores = (qs @ ks.mT).tril()  # (L, nc, C, C)
    span = -b[..., -1, :].min(-1).values  # (L, nc): the largest decay across the chunk over D
    wide = (span > SPLIT_SPAN[dt]).flatten()
    if not bool(wide.any()):  # a host sync: the common case costs one reduction
        return scores
    idx = wide.nonzero().squeeze(1)
    flat = [t.flatten(0, 1).index_select(0, idx) for t in (q, k, b)]  # (U, C, D)
    exact = torch.cat([checkpoint(_exact_scores, *(t[s:s + SAFE_GROUP] for t in flat), use_reentrant=False)
                       for s in range(0, idx.numel(), SAFE_GROUP)])
    return scores.flatten(0, 1).index_copy(0, idx, exact).view_as(scores)


def gated_causal_dot_product_chunked(q, k, v, log_g, chunk_size=None):
    """q, k (B, H, N, D), v (B, H, N, M), log_g (B, H, N) or (B, H, N, D) -> (B, H, N, M) in q's dtype."""
    b_, h, n, d = q.shape
    m = v.shape[-1]
    c = chunk_size or default_gated_chunk(d, m)
    per_dim = log_g.dim() == 4
    cd = compute_dtype(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        qc, kc, vc = (split_chunks(t.to(cd), c) for t in (q, k, v))  # (L, nc, C, X)
        lg = split_chunks((log_g if per_dim else log_g[..., None]).to(cd), c)  # (L, nc, C, D | 1)
        b = lg.cumsum(2)  # (L, nc, C, D | 1): log decay from the chunk's start through i
        b_last = b[:, :, -1:, :]  # (L, nc, 1, D | 1)
        if per_dim:
            scores = _per_dim_scores(qc, kc, b)
        else:
            upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
            decay = (b - b.mT).masked_fill(upper, float("-inf")).exp()  # (L, nc, C, C): exp(b_i - b_j), j <= i
            scores = (qc @ kc.mT) * decay
        out = scores @ vc  # (L, nc, C, M)
        # what each chunk adds to the state at its end, and the decay across it
        kv = (kc * (b_last - b).exp()).mT @ vc  # (L, nc, D, M)
        across = b_last.mT.exp() if per_dim else b_last.exp()  # (L, nc, D, 1) | (L, nc, 1, 1)
        s = kv.new_zeros(kv.shape[0], d, m)
        before = []
        for kv_j, across_j in zip(kv.unbind(1), across.unbind(1)):  # unbind: see delta.py
            before.append(s)
            s = torch.addcmul(kv_j, across_j, s)
        states = torch.stack(before, 1)  # (L, nc, D, M)
        out = out + (qc * b.exp()) @ states
    out = out.flatten(1, 2)[:, :n].view(b_, h, n, m)
    return out.to(q.dtype)
