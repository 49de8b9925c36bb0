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

Differentiable in q, k, v and log_g by RecomputedChunks (shared with repro.kernels.delta.chunked): it
keeps its four inputs alone for backward, as the causal product's layer does (no (C, C) scores,
no chunk states), and its backward recomputes the chunks a group at a time under autograd.
Half-precision inputs run in fp32 and return their dtype; fp64 stays fp64.
"""
import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from repro.kernels.plumbing.dtypes import accumulation_dtype

# The largest decay (nats) across a chunk that the midpoint split takes: its factors reach
# exp(span / 2), and products of two of them (masked entries included) must stay finite.
SPLIT_SPAN = {torch.float32: 80.0, torch.float64: 600.0}
SAFE_GROUP = 16  # chunks computed at once on the exact path: (16, C, C, D) factors
# The backward recomputes a group of chunks at a time: about this many bytes of autograd's
# intermediates per group (a layer's whole sequence at the suite's sizes, bounded beyond).
RECOMPUTE_BYTES = 8 << 20
_by_autograd = threading.local()  # .on: inside autograd_through_chunks() on this thread


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


def _inputs_in_chunks(c, q, k, v, x):
    """q, k, v and the per-step input x ((B, H, N) or (B, H, N, D)) as split_chunks' (L, nc, C, X)
    in the compute dtype; x of one value per step gets X = 1."""
    cd = accumulation_dtype(q.dtype)
    return [split_chunks(t.to(cd) if t.dim() == 4 else t.to(cd)[..., None], c) for t in (q, k, v, x)]


def _join(xc, like):
    """split_chunks undone: (L, nc, C, X) -> like's shape and dtype, the padding cut off."""
    return xc.flatten(1, 2)[:, :like.shape[2]].reshape(like.shape).to(like.dtype)


def _run(chunks, c, q, k, v, x):
    """chunks' output over the whole sequence, by differentiable ops."""
    with torch.autocast(q.device.type, enabled=False):  # the sums stay in fp32 (fp64)
        out, _ = chunks(*_inputs_in_chunks(c, q, k, v, x))
    return _join(out, v)


class RecomputedChunks(torch.autograd.Function):
    """A chunked recurrence that keeps its inputs alone (q, k, v and x: log_g or beta) for backward.
    chunks(qc, kc, vc, xc, s0=None) -> (out (L, nc, C, M), the state after the last chunk) runs
    chunks from the state s0 (None: zero); states(kc, vc, xc) -> the state before each chunk
    (L, nc, D, M), without the readout. The backward runs, from the last group of chunks to the
    first (RECOMPUTE_BYTES), the group's forward under autograd from its starting state (by one
    scan of states(), where there is more than one group) and takes its gradients, the starting
    state's gradient carried to the group before."""

    @staticmethod
    def forward(ctx, chunks, states, c, q, k, v, x):
        ctx.save_for_backward(q, k, v, x)
        ctx.fns = chunks, states, c
        return _run(chunks, c, q, k, v, x)

    @staticmethod
    def backward(ctx, g):
        (chunks, states, c), inputs, need = ctx.fns, ctx.saved_tensors, ctx.needs_input_grad[3:]
        if torch.is_grad_enabled():
            # create_graph: autograd through the whole forward on the saved inputs (which keep
            # their graph now), so that the gradients are differentiable in turn; through a view
            # of each, so that one tensor passed as two inputs (q as k) gets each slot's share
            with torch.enable_grad():
                ins = [t.view_as(t) for t in inputs]
                wrt = [t for t, r in zip(ins, need) if r]
                grads = iter(torch.autograd.grad(_run(chunks, c, *ins), wrt, g, create_graph=True))
            return (None, None, None, *(next(grads) if r else None for r in need))
        with torch.autocast(g.device.type, enabled=False):
            xc = _inputs_in_chunks(c, *inputs)  # (L, nc, C, X)
            gc = split_chunks(g.to(xc[0].dtype), c)
            rows, nc, _, d = xc[0].shape
            # chunks per group: autograd keeps a few (C, C) and (C, D | M) tensors per chunk
            per = max(1, RECOMPUTE_BYTES // (4 * rows * c * (c + d + xc[2].shape[-1]) * xc[0].element_size()))
            s = states(*xc[1:]) if nc > per else None  # (L, nc, D, M); one group starts from zero
            carry = any(need[1:])  # whether earlier chunks need the state's gradient (q's do not)
            parts, ds = [[] for _ in xc], None
            for start in reversed(range(0, nc, per)):
                part = slice(start, start + per)
                leaves = [t[:, part].detach().requires_grad_(r) for t, r in zip(xc, need)]
                s0 = s[:, start].detach().requires_grad_(carry) if start else None
                with torch.enable_grad():
                    out, s_end = chunks(*leaves, s0)
                outs, gouts = ([out], [gc[:, part]]) if ds is None else ([out, s_end], [gc[:, part], ds])
                wrt = [t for t in leaves if t.requires_grad] + ([s0] if start and carry else [])
                got = list(torch.autograd.grad(outs, wrt, gouts, allow_unused=True))
                ds = got.pop() if start and carry else None
                for p, t in zip(parts, leaves):
                    if t.requires_grad:
                        gr = got.pop(0)
                        p.append(torch.zeros_like(t) if gr is None else gr)
        return (None, None, None, *(_join(torch.cat(p[::-1], 1), x) if r else None
                                    for p, x, r in zip(parts, inputs, need)))


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


def _writes(kc, vc, b):
    """What each chunk adds to the state at its end (L, nc, D, M), and the decay across it,
    (L, nc, D, 1) per key dimension or (L, nc, 1, 1) per step."""
    b_last = b[:, :, -1:, :]  # (L, nc, 1, D | 1)
    return (kc * (b_last - b).exp()).mT @ vc, b_last.mT.exp()


def _scan(kv, across, s0):
    """(the state before each chunk (L, nc, D, M), the state after the last) from s0 (None: 0)."""
    s = kv.new_zeros(kv.shape[0], *kv.shape[2:]) if s0 is None else s0
    before = []
    for kv_j, across_j in zip(kv.unbind(1), across.unbind(1)):  # unbind: see delta.py
        before.append(s)
        s = torch.addcmul(kv_j, across_j, s)
    return torch.stack(before, 1), s


def _chunks(qc, kc, vc, lg, s0=None):
    """qc, kc (L, nc, C, D), vc (L, nc, C, M), lg (L, nc, C, D | 1) -> (out (L, nc, C, M), the state after)."""
    b = lg.cumsum(2)  # (L, nc, C, D | 1): log decay from the chunk's start through i
    if lg.shape[-1] > 1:
        scores = _per_dim_scores(qc, kc, b)
    else:  # (one key dimension decays per step too: the mask is exact for it)
        c = qc.shape[2]
        upper = torch.ones(c, c, dtype=torch.bool, device=qc.device).triu(1)
        decay = (b - b.mT).masked_fill(upper, float("-inf")).exp()  # (L, nc, C, C): exp(b_i - b_j), j <= i
        scores = (qc @ kc.mT) * decay
    states, s = _scan(*_writes(kc, vc, b), s0)
    return scores @ vc + (qc * b.exp()) @ states, s


def _states(kc, vc, lg):
    return _scan(*_writes(kc, vc, lg.cumsum(2)), None)[0]


@contextlib.contextmanager
def autograd_through_chunks():
    """Inside (this thread), the chunked recurrences are differentiated by autograd through their
    forward, which keeps the chunks' intermediates, rather than by RecomputedChunks: for a caller
    that is itself recomputing them in its own backward (a layer's), where RecomputedChunks would
    run the same forward twice more."""
    before, _by_autograd.on = getattr(_by_autograd, "on", False), True
    try:
        yield
    finally:
        _by_autograd.on = before


def chunked_recurrence(chunks, states, c, q, k, v, x):
    """RecomputedChunks' output (its doc); by differentiable ops in traced graphs (the compiler
    chooses what to keep there) and inside autograd_through_chunks()."""
    if torch.compiler.is_compiling() or getattr(_by_autograd, "on", False):
        return _run(chunks, c, q, k, v, x)
    return RecomputedChunks.apply(chunks, states, c, q, k, v, x)


def gated_causal_dot_product_chunked(q, k, v, log_g, chunk_size=None):
    """q, k (B, H, N, D), v (B, H, N, M), log_g (B, H, N) or (B, H, N, D) -> (B, H, N, M) in q's dtype."""
    return chunked_recurrence(_chunks, _states, chunk_size or default_gated_chunk(q.shape[-1], v.shape[-1]),
                              q, k, v, log_g)
