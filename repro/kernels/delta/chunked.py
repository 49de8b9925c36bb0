"""The delta rule (Schlag, Irie and Schmidhuber 2021), chunked by the WY / UT transform of
Yang et al. 2024 ("Parallelizing Linear Transformers with the Delta Rule over Sequence Length"):

    S_t = S_{t-1} + k_t beta_t (v_t - S_{t-1}^T k_t)^T,   o_t = S_t^T q_t

Per chunk of C tokens (rows t of K, V, Q; S the state before the chunk), the new values the
chunk writes, u_t = beta_t (v_t - S_{t-1}^T k_t), solve one unit lower-triangular system:
    (I + tril(diag(beta) K K^T, -1)) U' = diag(beta) (V - K S)
so with the UT transform T = (I + tril(diag(beta) K K^T, -1))^{-1} diag(beta), taken once per
chunk in parallel (W = T K, U = T V: one triangular solve with [K | V] on the right),
    U' = U - W S,   O = Q S + tril(Q K^T) U',   S <- S + K^T U'.
Only the two (C, D) x (D, M) products of U' and S wait on the previous chunk: a loop over the
N / C chunks; the rest is batched over every chunk at once.

Differentiable in q, k, v and beta by repro.kernels.gated.chunked.RecomputedChunks: it keeps its four
inputs alone for backward, and its backward recomputes the chunks a group at a time under
autograd. Half-precision inputs run in fp32. The keys are the caller's: the layer L2-normalises
them and keeps beta in (0, 1), where every I - beta k k^T is a contraction; other inputs may grow
the state without bound, as the recurrence itself does.
"""
import torch

from repro.kernels.gated.chunked import chunked_recurrence

DELTA_CHUNK = 64  # measured on a CPU (docs/kernels.md)


class _UnitLowerInverse(torch.autograd.Function):
    """(I + N)^-1 for strictly lower-triangular N (L, nc, C, C). Backward, from d(A^-1) = -A^-1 dA A^-1:
    grad N = -tril(T^T G T^T, -1), two matmuls; autograd through the triangular solve would run two
    more solves (on a CPU each is a LAPACK call per chunk: 4x the time of a batched matmul)."""

    @staticmethod
    def forward(ctx, n):
        eye = torch.eye(n.shape[-1], dtype=n.dtype, device=n.device).expand_as(n)
        t = torch.linalg.solve_triangular(n, eye, upper=False, unitriangular=True)
        ctx.save_for_backward(t)
        return t

    @staticmethod
    def backward(ctx, g):
        t, = ctx.saved_tensors
        return -(t.mT @ g @ t.mT).tril(-1)


def _writes(kc, vc, bc):
    """W = T K and U = T V (L, nc, C, D | M) for every chunk at once (the UT transform)."""
    kb = kc * bc
    # rows t: beta_t k_t . k_j for j < t; the unit diagonal is implied (unitriangular)
    a = (kb @ kc.mT).tril(-1)  # (L, nc, C, C)
    wu = _UnitLowerInverse.apply(a) @ torch.cat([kb, vc * bc], -1)  # (L, nc, C, D + M): T K | T V
    return wu[..., :kc.shape[-1]], wu[..., kc.shape[-1]:]


def _scan(kc, w, u, s0):
    """(the state before each chunk (L, nc, D, M), what each chunk writes, U' = U - W S
    (L, nc, C, M), the state after the last) from s0 (None: 0)."""
    s = u.new_zeros(u.shape[0], kc.shape[-1], u.shape[-1]) if s0 is None else s0
    before, written = [], []
    # unbind, not x[:, j]: the backward of one select per chunk would zero-fill a whole
    # (L, nc, C, X) gradient per chunk (O(nc^2) memory traffic)
    for u_j, w_j, k_j in zip(u.unbind(1), w.unbind(1), kc.unbind(1)):
        before.append(s)
        u_j = torch.baddbmm(u_j, w_j, s, alpha=-1)  # (L, C, M): U - W S
        written.append(u_j)
        s = torch.baddbmm(s, k_j.mT, u_j)
    return torch.stack(before, 1), torch.stack(written, 1), s


def _chunks(qc, kc, vc, bc, s0=None):
    """qc, kc (L, nc, C, D), vc (L, nc, C, M), bc (L, nc, C, 1; 0 in the padding: no write) ->
    (out (L, nc, C, M), the state after)."""
    states, u, s = _scan(kc, *_writes(kc, vc, bc), s0)
    return qc @ states + (qc @ kc.mT).tril() @ u, s


def _states(kc, vc, bc):
    return _scan(kc, *_writes(kc, vc, bc), None)[0]


def delta_rule_dot_product_chunked(q, k, v, beta, chunk_size=None):
    """q, k (B, H, N, D), v (B, H, N, M), beta (B, H, N) -> (B, H, N, M) in q's dtype."""
    return chunked_recurrence(_chunks, _states, chunk_size or DELTA_CHUNK, q, k, v, beta)
