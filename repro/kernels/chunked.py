"""Chunked causal dot product in plain PyTorch: the backend for every device.

The sequence is cut into chunks of C tokens. Inside a chunk the causal product is a masked
(C, C) matmul; across chunks a running state S = sum k_j v_j^T (an exclusive cumulative sum
over chunk totals) carries the past. Everything is batched matmuls (BLAS-3), there is no
Python loop over time, and memory is O(N (C + D M / C)): with C ~ sqrt(D M) that is
O(N max(D, M)).

The backward pass is the paper's cumulative-sum form (Section 3.3.1), chunked the same way:
  grad q_i = sum_{j<=i} (g_i . v_j) k_j   a forward scan: the forward pass with v and k swapped
  grad k_i = sum_{j>=i} (g_j . v_i) q_j   a reverse scan over the state R_i = sum_{j>=i} q_j g_j^T
  grad v_i = sum_{j>=i} (q_j . k_i) g_j   the same reverse state R
Only q, k and v are saved; no per-step state S_i is ever stored.
"""
import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def default_chunk_size(d: int, m: int) -> int:
    """The power of two nearest sqrt(D M), within [16, 256]: balances the (C, C) intra-chunk
    scores against the (N / C) per-chunk (D, M) states."""
    return int(min(256, max(16, 2 ** round(math.log2(math.sqrt(d * m))))))


def _split(x, c):
    """(..., N, X) -> (..., N / C, C, X), zero-padding N up to a multiple of C.
    Zero keys and values add nothing to the sums, and padded queries are cut off later."""
    n = x.shape[-2]
    pad = (-n) % c
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.unflatten(-2, (x.shape[-2] // c, c))


def _merge(x, n):
    """(..., N / C, C, X) -> (..., N, X)."""
    return x.flatten(-3, -2)[..., :n, :]


def _chunk_states(x, reverse=False):
    """Exclusive prefix sums over the chunk axis: (..., nc, D, M) -> state before (after, when
    reverse) each chunk. On CPU a loop over chunks: torch's cumsum along a non-last axis runs
    at a fraction of memory bandwidth there (~7x slower than this loop at nc = 1024, and it
    made the whole op grow faster than N); on GPUs cumsum is a parallel scan and wins."""
    if x.device.type != "cpu":
        if reverse:
            return F.pad(x[..., 1:, :, :], (0, 0, 0, 0, 0, 1)).flip(-3).cumsum(-3).flip(-3)
        return F.pad(x[..., :-1, :, :], (0, 0, 0, 0, 1, 0)).cumsum(-3)
    out = torch.empty_like(x)
    acc = torch.zeros_like(x[..., 0, :, :])
    for i in (reversed(range(x.shape[-3])) if reverse else range(x.shape[-3])):
        out[..., i, :, :] = acc
        acc += x[..., i, :, :]
    return out


def _forward(q, k, v, c):
    n = q.shape[-2]
    qc, kc, vc = _split(q, c), _split(k, c), _split(v, c)  # (..., nc, C, D|M)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    scores = (qc @ kc.transpose(-1, -2)).masked_fill_(~causal, 0.0)  # (..., nc, C, C)
    out = scores @ vc  # (..., nc, C, M)
    kv = kc.transpose(-1, -2) @ vc  # (..., nc, D, M): each chunk's sum of k_j v_j^T
    s = _chunk_states(kv)  # state before each chunk
    out += qc @ s
    return _merge(out, n)


def _backward(q, k, v, g, c, need):
    n = q.shape[-2]
    grad_q = _forward(g, v, k, c) if need[0] else None
    if not (need[1] or need[2]):
        return grad_q, None, None
    qc, kc, vc, gc = _split(q, c), _split(k, c), _split(v, c), _split(g, c)
    anti_causal = torch.ones(c, c, dtype=torch.bool, device=q.device).triu()
    qg = qc.transpose(-1, -2) @ gc  # (..., nc, D, M)
    # R before each chunk, looking backwards in time: sum of q_j g_j^T over all later chunks
    r = _chunk_states(qg, reverse=True)
    grad_k = grad_v = None
    if need[1]:
        p = (vc @ gc.transpose(-1, -2)).masked_fill_(~anti_causal, 0.0)  # [i, j] = v_i . g_j, j >= i
        grad_k = _merge(p @ qc + vc @ r.transpose(-1, -2), n)
    if need[2]:
        p = (kc @ qc.transpose(-1, -2)).masked_fill_(~anti_causal, 0.0)  # [i, j] = k_i . q_j, j >= i
        grad_v = _merge(p @ gc + kc @ r, n)
    return grad_q, grad_k, grad_v


def _compute_dtype(dtype):
    # Half-precision inputs accumulate in fp32; fp64 stays fp64 (the tests' reference precision).
    return torch.float64 if dtype == torch.float64 else torch.float32


class CausalDotProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, chunk_size):
        ctx.save_for_backward(q, k, v)
        ctx.chunk_size = chunk_size
        cd = _compute_dtype(q.dtype)
        # Autocast must not push the matmuls back down to bf16: the accumulation is the point.
        with torch.autocast(q.device.type, enabled=False):
            out = _forward(q.to(cd), k.to(cd), v.to(cd), chunk_size)
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        cd = _compute_dtype(q.dtype)
        with torch.autocast(q.device.type, enabled=False):
            grads = _backward(q.to(cd), k.to(cd), v.to(cd), g.to(cd), ctx.chunk_size,
                              ctx.needs_input_grad[:3])
        return tuple(None if gr is None else gr.to(x.dtype) for gr, x in zip(grads, (q, k, v))) + (None,)


def causal_dot_product_chunked(q, k, v, chunk_size=None):
    c = chunk_size or default_chunk_size(q.shape[-1], v.shape[-1])
    return CausalDotProduct.apply(q, k, v, c)
