"""Chunked causal dot product in plain PyTorch: the backend for every device.

The sequence is cut into chunks of C tokens. Inside a chunk the causal product is a masked
(C, C) matmul; across chunks a running state S = sum k_j v_j^T (an exclusive cumulative sum
over chunk totals) carries the past. Everything is batched matmuls (BLAS-3), there is no
Python loop over time, and memory is O(N (C + D M / C)): with C ~ sqrt(D M) that is
O(N max(D, M)).

The backward pass is the paper's cumulative-sum form (Section 3.3.1), chunked the same way:
  grad q_i = sum_{j<=i} (g_i . v_j) k_j   intra: A @ k with A = tril(g v^T); inter: g_i^T S^T
  grad k_i = sum_{j>=i} (g_j . v_i) q_j   intra: A^T @ q (the same A); inter: v_i^T R^T
  grad v_i = sum_{j>=i} (q_j . k_i) g_j   intra: tril(q k^T)^T @ g; inter: k_i^T R
with one reverse state R_i = sum_{j>=i} q_j g_j^T shared by grad k and grad v: ten (C, C)- or
(D, M)-sized batched matmuls against the forward's four, each gradient written by one bmm and
one in-place baddbmm_ (no separate add pass). Only q, k and v are saved; no per-step state
S_i is ever stored. The upstream gradient is made contiguous once (after out.sum().backward()
it is an expanded stride-0 tensor, which batched matmuls cannot hand to BLAS). Under
create_graph (second derivatives) each gradient is taken as a causal product itself, through this
same Function, so it is differentiable in turn (causal_product_grads).

Masked entries multiply: a triangular (C, C) block times a chunk of the other operand gives
0 * inf = NaN in rows that never see an inf or NaN further on. When an input is not finite (the
state scans' totals say so, scan_chunks), those products and the scans take an exact path that keeps
a non-finite value to the rows causality lets it reach (_masked_bmm).

On CPU the sequences are taken in groups of ~GROUP_CHUNKS chunks (cache-sized), and with T > 1
threads the groups run on T Python threads with torch single-threaded (repro.kernels.plumbing.threads says
why). On a CPU in fp32 the fused C kernel (repro.kernels.causal_product.cpu_native) runs the same algorithm first.
Speed is measured by `python -m repro.reproduction.cpu_speed` (README: "CPU speed of the core").
"""
import math

import torch
import torch.nn.functional as F

from repro.kernels.causal_product import cpu_native
from repro.kernels.plumbing.dtypes import accumulation_dtype
from repro.kernels.plumbing.threads import may_use_threads, run_groups

# On CPU the chunk size comes from measurement (fp32, B = 1, H = 8, N = 4096, 1 thread, fwd + bwd,
# medians of 15 interleaved rounds; `python -m repro.reproduction.cpu_speed --chunk-sweep --threads 1
# --rounds 15 --sweep-dims 16,16 16,17 32,32 32,33 64,64 64,65 128,128`):
#   D, M = 16: C = 32 (16 and 64 are 1.1-1.4x slower)
#   D, M = 32 and 64: C = 64 (32 is 1.1-1.6x slower, 128 1.5-2.5x)
#   D, M = 128: C = 64 and 128 within 5% (32 is 1.9x slower)
# i.e. (C, C) blocks of 32-64 keep BLAS efficient, and bigger C only adds intra-chunk work.
# Larger D M is unmeasured and keeps the sqrt rule.
CPU_CHUNKS = ((24, 32), (128, 64))  # (largest sqrt(D M), C)


def default_chunk_size(d: int, m: int, cpu: bool = False) -> int:
    """The chunk size C for head dims D, M. Off CPU (and beyond the CPU table): the power of two
    nearest sqrt(D M), within [16, 256], balancing the (C, C) intra-chunk scores against the
    (N / C) per-chunk (D, M) states. On CPU: CPU_CHUNKS, measured."""
    root = math.sqrt(d * m)
    if cpu:
        for limit, c in CPU_CHUNKS:
            if root <= limit:
                return c
    return int(min(256, max(16, 2 ** round(math.log2(root)))))


def flat_chunks(x, c):
    """(..., N, X) -> (L, C, X) with L = (batch dims) * N / C chunks, zero-padding N up to a
    multiple of C. Zero keys and values add nothing to the sums, and padded queries are cut off
    later. Contiguous, so every batched matmul below takes BLAS's fast path."""
    n = x.shape[-2]
    pad = (-n) % c
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(-1, c, x.shape[-1]).contiguous()


def _merge(x, like, n):
    """(L, C, X) -> (..., N, X) with the batch dims of `like`, dropping the padding."""
    x = x.view(*like.shape[:-2], -1, x.shape[-1])
    return x[..., :n, :] if x.shape[-2] != n else x


def _into(out, c):
    """A group's slice of the full result (rows, N, X) seen as (L, C, X), so that the last
    matmul writes there directly; None when N is not a multiple of C (then it is copied)."""
    if out is None or out.shape[-2] % c:
        return None
    return out.view(-1, c, out.shape[-1])


def _place(res, like, n, out):
    """res (L, C, X) -> (..., N, X), in out when one is given (res already is out's view when
    _into gave one: N a multiple of C)."""
    if out is None:
        return _merge(res, like, n)
    if out.shape[-2] % res.shape[1]:  # N not a multiple of C: res is a padded buffer of its own
        out.copy_(_merge(res, like, n))
    return out


MATMUL_SCAN_CHUNKS = 8  # measured (fwd + bwd, interleaved): 1.04-1.18x at nc = 4, 0.9-1.1x at nc = 16


def _chunk_states(x, n_chunks, reverse=False, safe=False, matmul_chunks=MATMUL_SCAN_CHUNKS):
    """Exclusive prefix sums over each sequence's chunks: (L, D, M) with L = batch * nc -> the
    state before (after, when reverse) each chunk. On CPU a loop over chunks, one add per chunk
    written straight into its slot: torch's cumsum along a non-last axis runs at a fraction of
    memory bandwidth there (15-25x slower than this loop at nc = 64, measured), and a matmul
    with a triangular ones matrix costs nc^2 D M; on GPUs cumsum is a parallel scan and wins.
    safe (some input is not finite): never the triangular matmul, whose zeros times a later
    chunk's inf would make every state NaN."""
    x = x.view(-1, n_chunks, *x.shape[-2:])  # (batch, nc, D, M)
    if x.device.type != "cpu":
        if reverse:
            out = F.pad(x[:, 1:], (0, 0, 0, 0, 0, 1)).flip(1).cumsum(1).flip(1)
        else:
            out = F.pad(x[:, :-1], (0, 0, 0, 0, 1, 0)).cumsum(1)
        return out.flatten(0, 1)
    if n_chunks <= matmul_chunks and not safe:
        # Few chunks: one matmul with a strictly triangular ones matrix (nc^2 D M multiply-adds,
        # at most an eighth of one chunk matmul's work when nc <= C / 8) is one op instead of nc
        # small adds, each of which is a parallel region that waits for every thread.
        ones = torch.ones(n_chunks, n_chunks, dtype=x.dtype, device=x.device)
        tri = ones.triu_(1) if reverse else ones.tril_(-1)  # (nc, nc)
        return torch.matmul(tri, x.flatten(2)).view(-1, *x.shape[-2:])
    out = torch.empty_like(x)
    order = list(reversed(range(n_chunks))) if reverse else list(range(n_chunks))
    out[:, order[0]].zero_()
    compiling = torch.compiler.is_compiling()  # dynamo takes no out= into a strided view
    for prev, i in zip(order, order[1:]):
        if compiling:
            out[:, i] = out[:, prev] + x[:, prev]
        else:
            torch.add(out[:, prev], x[:, prev], out=out[:, i])
    return out.flatten(0, 1)


def scan_chunks(x, n_chunks, reverse=False, matmul_chunks=MATMUL_SCAN_CHUNKS):
    """(_chunk_states of x, whether x holds an inf or NaN). The answer comes from the sequences'
    totals alone (the state after the last chunk, before the first when reverse, plus that
    chunk's own sum: 1/nc of x): a sum over a non-finite value is not finite, and an inf or NaN
    in an input (k or v of sum k_j v_j^T, q or g of sum q_j g_j^T) makes a whole row or column
    of its chunk's sum so. When it does, the states are taken again by the safe scan."""
    states = _chunk_states(x, n_chunks, reverse=reverse, matmul_chunks=matmul_chunks)
    end = lambda t: t.view(-1, n_chunks, *t.shape[-2:])[:, 0 if reverse else -1]
    if not _any_non_finite(end(states) + end(x)):  # (batch, D, M)
        return states, False
    return _chunk_states(x, n_chunks, reverse=reverse, safe=True), True


def _masked_bmm(m, x, safe, upper=False, out=None):
    """m @ x for masked (L, C, C) blocks m: lower triangular (row i takes j <= i) or, when upper,
    upper (j >= i: the transpose of one). Plain bmm multiplies the masked zeros too, and 0 * inf =
    NaN in rows that never see x's inf or NaN. safe (some input is not finite): the matmul takes
    x with its non-finite entries zeroed, and they come back as their running sum over the rows
    that do see them, so rows before them (after, when upper) are exact and the rest not finite,
    as in the formula. tril_ writes exact zeros, so a non-finite entry of m stays in its own
    (unmasked) place."""
    if not safe:
        return torch.bmm(m, x, out=out)
    finite = x.nan_to_num(0.0, 0.0, 0.0)
    bad = x - finite  # (L, C, X): the infs and NaNs of x, 0 elsewhere
    reach = bad.flip(1).cumsum(1).flip(1) if upper else bad.cumsum(1)
    return torch.bmm(m, finite, out=out).add_(reach)


def chunks_forward(q, k, v, c, out=None, states=None, matmul_chunks=MATMUL_SCAN_CHUNKS):
    """(the causal product, whether k or v holds an inf or NaN); with states (L, D, M), the
    state before each chunk is kept there for the backward (grad q needs it: the size of q when
    C = M, and a matmul and a scan fewer in the backward). q reaches only its own rows."""
    n = q.shape[-2]
    nc = -(-n // c)
    qc, kc, vc = flat_chunks(q, c), flat_chunks(k, c), flat_chunks(v, c)  # (L, C, D|M)
    scores = torch.bmm(qc, kc.mT).tril_()  # (L, C, C): q_i . k_j for j <= i inside the chunk
    # (L, D, M): sum of k_j v_j^T over earlier chunks
    s, bad = scan_chunks(torch.bmm(kc.mT, vc), nc, matmul_chunks=matmul_chunks)
    if states is not None:
        states.copy_(s)
    res = _masked_bmm(scores, vc, bad, out=_into(out, c)).baddbmm_(qc, s)  # intra-chunk, then += q_i^T S in place
    return _place(res, v, n, out), bad


def chunks_backward(q, k, v, g, c, need, outs=(None, None, None), states=None, kv_bad=False, rev=None):
    """All three gradients from shared pieces (A = tril(g v^T) serves grad q and, transposed,
    grad k; one reverse state R = sum q_j g_j^T serves grad k (as R^T) and grad v); each
    gradient is one bmm plus one in-place baddbmm_, with no separate add pass. states: the
    forward's chunk states, recomputed when not given; kv_bad: the forward's word on k and v
    (A's masked products take k, q and g: _masked_bmm); rev: (R after each chunk, whether q or g
    holds an inf or NaN), given by a caller that takes a sequence in blocks (repro.kernels.normalised.blocked)."""
    n = q.shape[-2]
    nc = -(-n // c)
    # flat_chunks makes g contiguous: after out.sum().backward() it is an expanded stride-0 tensor,
    # on which batched matmuls leave BLAS for a slow generic loop.
    qc, kc, vc, gc = flat_chunks(q, c), flat_chunks(k, c), flat_chunks(v, c), flat_chunks(g, c)  # (L, C, D|M)
    grad_q = grad_k = grad_v = None
    if need[0] or need[1]:
        a = torch.bmm(gc, vc.mT).tril_()  # (L, C, C): a[i, j] = g_i . v_j, j <= i
    if need[0]:  # grad q_i = sum_{j<=i} (g_i . v_j) k_j = intra a @ k + g_i^T S^T
        if states is None:
            states, kv_bad = scan_chunks(torch.bmm(kc.mT, vc), nc)  # (L, D, M) before each chunk
        grad_q = _place(_masked_bmm(a, kc, kv_bad, out=_into(outs[0], c)).baddbmm_(gc, states.mT), q, n, outs[0])
    if need[1] or need[2]:
        r, qg_bad = rev or scan_chunks(torch.bmm(qc.mT, gc), nc, reverse=True)  # (L, D, M) after each chunk
    if need[1]:  # grad k_i = sum_{j>=i} (g_j . v_i) q_j = intra a^T @ q + v_i^T R^T
        grad_k = _place(_masked_bmm(a.mT, qc, qg_bad, True, out=_into(outs[1], c)).baddbmm_(vc, r.mT), k, n, outs[1])
    a = None  # (L, C, C) freed before p: the backward's workspace is a block's (repro.kernels.normalised.blocked)
    if need[2]:  # grad v_i = sum_{j>=i} (q_j . k_i) g_j = intra tril(q k^T)^T @ g + k_i^T R
        p = torch.bmm(qc, kc.mT).tril_()  # the forward's scores, recomputed (not saved: O(N C))
        grad_v = _place(_masked_bmm(p.mT, gc, qg_bad, True, out=_into(outs[2], c)).baddbmm_(kc, r), v, n, outs[2])
    return grad_q, grad_k, grad_v


# CPU: sequences are processed in groups of about this many chunks, so that one group's (C, C)
# scores, (D, M) states and operands stay near the core (2 MiB of L2 per core here) instead of
# streaming every intermediate of the whole batch through memory between matmuls. Measured at
# 1 thread (fwd + bwd, medians of 9-11 interleaved rounds, load 3-4): 1.08x (B 1, H 8, N 1024,
# D = M = 64), 1.12x (N 4096), 1.26x (B 16, N 1024, D 32, M 33), 1.54x (B 64, N 256, D 32, M 33)
# faster than one group; 64 and 256 are within noise of 128.
GROUP_CHUNKS = 128


def _row_groups(n_rows, n, c, device):
    """Slices of the rows (sequences) that are computed together."""
    if device.type != "cpu" or not may_use_threads():
        return [slice(0, n_rows)]  # GPUs want the whole batch in each launch
    per = max(1, min(GROUP_CHUNKS // max(1, -(-n // c)), -(-n_rows // torch.get_num_threads())))
    return [slice(i, i + per) for i in range(0, n_rows, per)]


def _any_non_finite(x) -> bool:
    """Whether x holds an inf or NaN, by one sum (a finite sum that overflows only costs the
    exact path). Eager CPU tensors only: the answer is data, which tracing cannot branch on
    (graphs keep the fast path), and on a GPU reading it back is a host sync per call, which
    would drain the launch queue of every training step (the fast path runs there)."""
    if x.device.type != "cpu" or not may_use_threads():
        return False
    return not bool(torch.isfinite(x.sum()))


def as_rows(x):
    """(..., N, X) -> (rows, N, X); N = 0 too (reshape(-1, ...) cannot size -1 for no elements)."""
    return x.reshape(math.prod(x.shape[:-2]), *x.shape[-2:])


def _grouped_forward(q, k, v, c, keep_states=False, native_c=None):
    """(output, the chunk states (rows, nc, D, M) when keep_states, else None, whether k or v
    holds an inf or NaN). native_c: the fused kernel's chunk, when it is to be tried first (it
    keeps no states: its backward recomputes them)."""
    if q.shape[-2] == 0:  # no tokens: nothing to sum (the chunk views below need one)
        return v.new_zeros(v.shape), False, None
    q3, k3, v3 = (as_rows(x) for x in (q, k, v))  # (rows, N, D|M)
    if native_c and (out := cpu_native.run_forward(q3, k3, v3, native_c)) is not None:
        return out.view(v.shape), False, None
    nc = -(-q.shape[-2] // c)
    states = q3.new_empty(q3.shape[0], nc, q.shape[-1], v.shape[-1]) if keep_states else None
    groups = _row_groups(q3.shape[0], q.shape[-2], c, q.device)
    if len(groups) == 1:
        return *chunks_forward(q, k, v, c, states=None if states is None else states.flatten(0, 1)), states
    out, bad = v3.new_empty(v3.shape), []
    run_groups(lambda s: bad.append(chunks_forward(q3[s], k3[s], v3[s], c, out=out[s],
                                              states=None if states is None else states[s].flatten(0, 1))[1]), groups)
    return out.view(v.shape), any(bad), states


def _grouped_backward(q, k, v, g, c, need, states=None, kv_bad=False, native_c=None):
    if q.shape[-2] == 0:
        return tuple(x.new_zeros(x.shape) if r else None for x, r in zip((q, k, v), need))
    q3, k3, v3, g3 = (as_rows(x) for x in (q, k, v, g))  # (rows, N, D|M)
    if native_c and not kv_bad and (grads := cpu_native.run_backward(q3, k3, v3, g3, native_c, need)) is not None:
        return tuple(None if gr is None else gr.view(x.shape) for gr, x in zip(grads, (q, k, v)))
    groups = _row_groups(q3.shape[0], q.shape[-2], c, q.device)
    if len(groups) == 1:
        return chunks_backward(q, k, v, g, c, need, states=None if states is None else states.flatten(0, 1),
                               kv_bad=kv_bad)
    grads = [x.new_empty(x.shape) if r else None for x, r in zip((q3, k3, v3), need)]
    run_groups(lambda s: chunks_backward(q3[s], k3[s], v3[s], g3[s], c, need,
                                         [None if x is None else x[s] for x in grads],
                                         states=None if states is None else states[s].flatten(0, 1), kv_bad=kv_bad),
               groups)
    return tuple(None if gr is None else gr.view(x.shape) for gr, x in zip(grads, (q, k, v)))


def causal_product_grads(product, q, k, v, g, need=(True, True, True)):
    """The causal product's gradients as causal products themselves, by `product(q, k, v)`:
        grad q_i = sum_{j<=i} (g_i . v_j) k_j = product(g, v, k)_i
        grad k_i = sum_{j>=i} (v_i . g_j) q_j,  grad v_i = sum_{j>=i} (k_i . q_j) g_j
    the last two the product run backwards in time (on flipped sequences). Differentiable when
    `product` is: the second derivatives' path of this backend and of the CuPy one."""
    flip = lambda x: x.flip(-2)
    qf, gf = (flip(q), flip(g)) if need[1] or need[2] else (None, None)
    return (product(g, v, k) if need[0] else None, flip(product(flip(v), gf, qf)) if need[1] else None,
            flip(product(flip(k), qf, gf)) if need[2] else None)


def _chunks(q, v, chunk_size):
    """(the chunked path's C, the fused CPU kernel's C or None when it does not take these inputs):
    chunk_size when given, else each path's measured one."""
    cd = accumulation_dtype(q.dtype)
    native = chunk_size or cpu_native.CHUNK if cpu_native.native(q.device, cd) else None
    return chunk_size or default_chunk_size(q.shape[-1], v.shape[-1], cpu=q.device.type == "cpu"), native


class CausalDotProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, chunk_size, grad_enabled, out_dtype):
        ctx.chunk_size = chunk_size
        c, native_c = _chunks(q, v, chunk_size)
        cd = accumulation_dtype(q.dtype)
        # Autocast must not push the matmuls back down to bf16: the accumulation is the point.
        with torch.autocast(q.device.type, enabled=False):
            # grad q's chunk states are kept from here when it will be needed (only then: the
            # forward itself runs with grad off, so the caller's grad mode comes as an argument);
            # the fused CPU kernel keeps none (its backward recomputes them in cache).
            out, ctx.kv_bad, states = _grouped_forward(q.to(cd), k.to(cd), v.to(cd), c, native_c=native_c,
                                                       keep_states=grad_enabled and ctx.needs_input_grad[0]
                                                       and not native_c)
        ctx.save_for_backward(q, k, v, states)
        return out.to(out_dtype or q.dtype)

    @staticmethod
    def backward(ctx, g):
        q, k, v, states = ctx.saved_tensors
        cd, need = accumulation_dtype(q.dtype), ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():
            # create_graph: the gradients by this Function again, on the saved inputs (which keep
            # their graph now), so that they are differentiable in turn; the fused backward below
            # is once-only (in-place, out= and grad-free host threads).
            product = lambda a, b, x: CausalDotProduct.apply(a, b, x, ctx.chunk_size, True, None)
            grads = causal_product_grads(product, *(x.to(cd) for x in (q, k, v, g)), need)
        else:
            c, native_c = _chunks(q, v, ctx.chunk_size)
            with torch.autocast(q.device.type, enabled=False):
                grads = _grouped_backward(q.to(cd), k.to(cd), v.to(cd), g.to(cd), c, need, states,
                                          kv_bad=ctx.kv_bad, native_c=native_c)
        return tuple(None if gr is None else gr.to(x.dtype) for gr, x in zip(grads, (q, k, v))) + (None, None, None)


def causal_dot_product_chunked_backward(q, k, v, g, need=(True, True, True), chunk_size=None):
    """The gradients of causal_dot_product_chunked(q, k, v) for the upstream gradient g, outside
    autograd (each None where `need` says so; in the inputs' dtypes): the backward of a layer
    that recomputes q, k, v instead of keeping them. The chunk states are recomputed (one matmul
    and a scan), where the Function keeps them from its forward."""
    c, native_c = _chunks(q, v, chunk_size)
    cd = accumulation_dtype(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        grads = _grouped_backward(q.to(cd), k.to(cd), v.to(cd), g.to(cd), c, tuple(need), native_c=native_c)
    return tuple(None if gr is None else gr.to(x.dtype) for gr, x in zip(grads, (q, k, v)))


def causal_dot_product_chunked(q, k, v, chunk_size=None, out_dtype=None):
    """out_dtype: the result's dtype, q's by default. The sums run in fp32 (fp64 for fp64) either
    way, so torch.float32 gives half-precision inputs' sums unrounded (they overflow fp16 at
    long N: the normalised attention divides them first). chunk_size: C for either path (None:
    each one's measured C)."""
    return CausalDotProduct.apply(q, k, v, chunk_size, torch.is_grad_enabled(), out_dtype)
