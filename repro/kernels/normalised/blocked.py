"""The linear layer's normalised attention outside autograd, from q, k, v and a feature map, in
bounded workspace: its autograd Function (repro.attention.linear) keeps only q, k, v, the output
y and inv = 1 / (den + eps) and recomputes the rest here in its backward. (Causal fp32 calls with
phi = elu + 1 on the CPU take repro.kernels.normalised.cpu_layer instead, which holds no workspace at all.)

    y = num * inv,  [num | den] = phi(Q) [S | Z]  (causal: the sums over j <= i, by the causal product on [v, 1])

On CPU the (batch, head) rows go in groups (the chunked path's thread pool runs them), each from
phi to the written result before the next; the backward takes a row longer than the block in
blocks of tokens, twice: once for the chunk products whose scans give the states before and after
each block (S for grad q, R for grad k and grad v), once for the gradients. So phi(Q), phi(K),
[v, 1], the upstream gradient's [g inv | -sum g inv y] and their gradients exist one block at a
time, and the layer's peak memory is about SDPA softmax's: its kept tensors, the upstream
gradient and the three input gradients (docs/attention.md). Elsewhere (GPUs) one group and one
block: the whole batch in each launch, through the dispatcher (repro.kernels).

phi(x, index, key, graph) -> (phi of x[index] in the accumulation dtype, contiguous, padded keys
zeroed; a handle, with phi's graph when `graph`), and phi_grad(handle, phi_x, grad_phi, out) writes
the gradient of x[index] into out: the layer's feature map, index = (batch, head, token slices).
"""
import torch

from repro.kernels import causal_dot_product, causal_dot_product_backward
from repro.kernels.causal_product import cpu_native
from repro.kernels.causal_product.chunked import (
    as_rows,
    chunks_backward,
    chunks_forward,
    default_chunk_size,
    flat_chunks,
    scan_chunks,
)
from repro.kernels.plumbing.threads import may_use_threads, run_groups

# Workspace of one group or block of the backward, per thread: about 4 F + 4 (M + 1) + 2 C fp32
# values per (row, token) (phi(Q), phi(K), [v, 1], [g inv | .], their gradients, the chunk states, a
# (C, C) block per chunk). Smaller is slower (more, smaller ops; rows over the budget take two
# passes). fp32, d_model 256, 8 heads, 4,096 tokens, 1 thread, medians of 3 interleaved rounds
# (load 3-5), fwd + bwd time against the code before it and exact peak per sample (MiB, N = 256 /
# 1,024 / 4,096, causal; SDPA softmax 2.28 / 9.34 / 37.38, before 3.60 / 14.38 / 57.53):
#   2 MiB: 1.08-1.21x the time, 2.34 / 9.35 / 38.16;  4 MiB: 0.91-1.23x, 2.42 / 9.66 / 39.67;
#   8 MiB: 0.49-1.02x (noisy), 2.57 / 10.30 / 41.19.
# 8 MiB keeps the speed; 2 MiB is within 1 MiB of SDPA's peak. A layer can set its own
# (LinearAttention's workspace_mb): whole CPU-sized copy model at N = 128 (2 layers, d_model 64,
# batch 32), one training step, 1 thread, medians of 5 interleaved rounds (load 3-4): 8 MiB 62.6 ms
# and 26.7 MB allocated at the peak, 2 MiB 71.6 ms and 24.3 MB (softmax's peak: 24.3 MB, 66.8 ms).
WORKSPACE_BYTES = 8 << 20
# Unless the layer sets its own, the budget also follows the problem: at most WORKSPACE_SHARE of
# the bytes of q (fp32: B H N D values), at least MIN_WORKSPACE. Small models (the copy and MNIST
# presets: q of 0.1-2 MiB) then keep their scratch beside what the layer keeps anyway (q, k, v and
# y, 4x q) small enough that a training step peaks no higher than with SDPA softmax; the layer
# benchmark's 4,096 tokens x 256 (q of 16 MiB) keep the full 8 MiB and its speed.
WORKSPACE_SHARE = 0.5
MIN_WORKSPACE = 64 << 10
SCAN_CHUNKS = 64


def heads_last(shape, dtype, device):
    """An empty (B, H, N, X) tensor laid out as (B, N, H, X): flattening its transpose to the
    (B, N, H X) the output projection reads is then a view, not a copy; the projections'
    backward reads a gradient in that layout without a copy too."""
    b, h, n, x = shape
    return torch.empty(b, n, h, x, dtype=dtype, device=device).transpose(1, 2)


def _with_ones(v, dtype):
    """[v | 1] (..., N, M + 1), contiguous, in dtype: the normaliser as the product's last column."""
    v1 = torch.empty(*v.shape[:-1], v.shape[-1] + 1, dtype=dtype, device=v.device)
    v1[..., :-1].copy_(v)
    v1[..., -1].fill_(1.0)
    return v1


def _g1(g, y, inv):
    """The gradient of [num | den] (..., N, M + 1) for the upstream g: [g inv | -sum_m g_m inv y_m]."""
    g1 = torch.empty(*y.shape[:-1], y.shape[-1] + 1, dtype=inv.dtype, device=inv.device)
    g_num = torch.mul(g, inv, out=g1[..., :-1])
    torch.sum(g_num * y, -1, keepdim=True, out=g1[..., -1:]).neg_()
    return g1


def _chunk(q, v):
    """The chunk size: the measured one, or N rounded up to 8 when that is smaller (a sequence
    shorter than a chunk would otherwise be zero-padded to it, and its (C, C) blocks grow with C)."""
    n = q.shape[-2]
    return min(default_chunk_size(q.shape[-1], v.shape[-1], cpu=q.device.type == "cpu"), -(-n // 8) * 8)


def default_workspace(q) -> int:
    """The budget in bytes per thread when the layer sets none: WORKSPACE_BYTES, or less for a small
    problem (WORKSPACE_SHARE of q's fp32 bytes, at least MIN_WORKSPACE)."""
    return int(min(WORKSPACE_BYTES, max(MIN_WORKSPACE, WORKSPACE_SHARE * 4 * q.numel())))


def _plan(q, v, c, workspace=None):
    """(groups of rows [(batch slice, head slice)], the backward's block of tokens) for a workspace
    of `workspace` bytes per thread (None: default_workspace)."""
    b, h, n, f = q.shape
    if q.device.type != "cpu":
        return [(slice(None), slice(None))], n
    per_token = 4 * (4 * f + 4 * (v.shape[-1] + 1) + 2 * c)  # bytes of workspace per (row, token)
    tokens = max(c, (workspace or default_workspace(q)) // per_token // c * c)
    threads = torch.get_num_threads() if may_use_threads() else 1
    per = max(1, min(tokens // n, -(-b * h // threads)))  # rows per group
    while per < h and h % per:
        per -= 1  # equal groups of heads
    if per >= h:
        groups = [(slice(i, i + per // h), slice(None)) for i in range(0, b, per // h)]
    else:
        groups = [(slice(i, i + 1), slice(j, j + per)) for i in range(b) for j in range(0, h, per)]
    blocks = -(-n // tokens) if per == 1 else 1
    return groups, -(-n // blocks // c) * c  # blocks of equal size, C-aligned


def normalised_forward(q, k, v, phi, eps: float, causal: bool, acc, workspace=None):
    """q, k (B, H, N, D), v (B, H, N, M) in any layout -> (y (B, H, N, M) in v's dtype, a view of a
    contiguous (B, N, H, M) tensor; inv (B, H, N, 1) in acc). No graph is recorded."""
    cpu = q.device.type == "cpu"
    c, native = _chunk(q, v), causal and cpu_native.native(q.device, acc)
    y = heads_last(v.shape, v.dtype, v.device)
    inv = torch.empty(*v.shape[:-1], 1, dtype=acc, device=v.device)
    if q.shape[-2] == 0:  # no tokens, nothing to attend to
        return y, inv

    def group(rows):
        idx = (*rows, slice(None))
        phi_q, phi_k = phi(q, idx, False, False)[0], phi(k, idx, True, False)[0]  # (b, h, N, F)
        v1 = _with_ones(v[idx], acc)  # (b, h, N, M + 1)
        if not causal:
            out = phi_q @ (phi_k.mT @ v1)  # [num | den]: phi(Q) [S | Z]
        elif cpu:  # the fused kernel, else the chunked path's pieces with the one-matmul scan (SCAN_CHUNKS)
            out = _fused_forward(phi_q, phi_k, v1) if native else None
            if out is None:
                out = chunks_forward(phi_q, phi_k, v1, c, matmul_chunks=SCAN_CHUNKS)[0]
        else:
            out = causal_dot_product(phi_q, phi_k, v1)
        del phi_q, phi_k, v1
        torch.reciprocal(out[..., -1:].add_(eps), out=inv[idx])
        torch.mul(out[..., :-1], inv[idx], out=y[idx])  # rounded to v's dtype only here

    run_groups(group, _plan(q, v, c, workspace)[0])
    return y, inv


def normalised_backward(q, k, v, y, inv, g, phi, phi_grad, causal: bool, need=(True, True, True), workspace=None):
    """The gradients of normalised_forward's y for the upstream g (B, H, N, M), from its saved y
    and inv: each in its input's dtype, laid out as the projections' (B, N, H, X) outputs (None
    where `need` says so)."""
    c = _chunk(q, v)
    grads = [heads_last(x.shape, x.dtype, x.device) if r else None for x, r in zip((q, k, v), need)]
    if q.shape[-2] == 0:
        return tuple(grads)
    groups, block = _plan(q, v, c, workspace)
    acc = inv.dtype
    native = causal and cpu_native.native(q.device, acc)

    def prep(idx, graph=True):
        (phi_q, hq), (phi_k, hk) = phi(q, idx, False, graph and need[0]), phi(k, idx, True, graph and need[1])
        return phi_q, phi_k, _with_ones(v[idx], acc), _g1(g[idx], y[idx], inv[idx]), hq, hk

    def finish(idx, gr, phi_q, phi_k, hq, hk):
        for dst, gp, p, hd in zip(grads, gr, (phi_q, phi_k, None), (hq, hk, None)):
            if dst is None or gp is None:
                continue
            if dst is grads[2]:
                dst[idx].copy_(gp[..., :-1])  # grad [v | 1] -> grad v
            else:
                phi_grad(hd, p, gp, dst[idx])

    def group(rows):
        if block >= q.shape[-2]:  # the whole rows at once: one pass
            idx = (*rows, slice(None))
            phi_q, phi_k, v1, g1, hq, hk = prep(idx)
            if not causal:
                gr = _global(phi_q, phi_k, v1, g1, need)
            elif native and _fused_grads(idx, phi_q, phi_k, v1, g1, hq, hk, need, finish):
                return
            elif q.device.type == "cpu":
                gr = _chunked(phi_q, phi_k, v1, g1, c, need)
            else:
                gr = causal_dot_product_backward(phi_q, phi_k, v1, g1, need)
            del v1, g1
            finish(idx, gr, phi_q, phi_k, hq, hk)
        else:
            if not (native and _fused_in_blocks(rows, q.shape[-2], block, prep, finish, need)):
                _in_blocks(rows, q.shape[-2], block, c, prep, finish, causal, need)

    run_groups(group, groups)
    return tuple(grads)


def _fused_forward(phi_q, phi_k, v1):
    """[num | den] by the fused CPU kernel on one group's (b, h, N, F|M + 1) tensors, or None when
    phi(K) or [v, 1] holds an inf or NaN (the chunked pieces' exact path then)."""
    out = v1.new_empty(v1.shape)
    rows = (as_rows(x).contiguous() for x in (phi_q, phi_k, v1))  # no copies: phi and _with_ones write contiguous
    return out if cpu_native.forward(*rows, as_rows(out)) else None


def _fused_grads(idx, phi_q, phi_k, v1, g1, hq, hk, need, finish, s0=None, r0=None):
    """Write these tokens' input gradients (finish) by the fused CPU kernel, from the states before
    (s0) and after (r0) them; False when a sum is not finite (the exact path then writes every
    gradient again). Two calls,
    each one sweep of the kernel (no work repeated): grad phi(K) and grad [v, 1] first, grad v
    written out and its block freed before grad phi(Q) is made, so that at most two gradient
    blocks exist beside the four inputs (finish may overwrite phi, which the second call reads,
    so grad phi(K) waits for it)."""
    def call(which):
        sub = tuple(r and w for r, w in zip(need, which))
        grads = [x.new_empty(x.shape) if r else None for x, r in zip((phi_q, phi_k, v1), sub)]
        if not any(sub):
            return grads
        ok = cpu_native.backward(*(as_rows(x).contiguous() for x in (phi_q, phi_k, v1, g1)),
                                 [None if x is None else as_rows(x) for x in grads], s0=s0, r0=r0)
        return grads if ok else None

    later = call((False, True, True))
    if later is None:
        return False
    if later[2] is not None:
        finish(idx, (None, None, later[2]), None, None, None, None)
        later[2] = None
    first = call((True, False, False))
    if first is None:  # only grad v is written: the exact path writes every gradient again
        return False
    finish(idx, (first[0], later[1], None), phi_q, phi_k, hq, hk)
    return True


def _fused_in_blocks(rows, n, block, prep, finish, need):
    """_in_blocks for the causal case by the fused kernel: first each block's sums phi(K)^T [v, 1]
    and phi(Q)^T g1 ((F, M + 1) each), made in place into the states before (prefix sums) and
    after (suffix sums) each block, then each block's gradients from those two states alone.
    False when a sum is not finite: the chunked pieces' exact path then (it writes every block
    again). Every small buffer is made once per row (a peak measured as resident memory counts
    the C library's heap, where small tensors live, as well as the large blocks)."""
    spans = [(*rows, slice(t0, min(n, t0 + block))) for t0 in range(0, n, block)]
    sums = None
    for i, idx in enumerate(spans):
        phi_q, phi_k, v1, g1, _, _ = prep(idx, graph=False)  # (1, 1, T, F|M + 1)
        if sums is None:
            sums = phi_q.new_empty(2, len(spans), phi_q.shape[-1], v1.shape[-1])  # (2, blocks, F, M + 1)
        torch.mm(phi_k[0, 0].mT, v1[0, 0], out=sums[0, i])
        torch.mm(phi_q[0, 0].mT, g1[0, 0], out=sums[1, i])
        del phi_q, phi_k, v1, g1  # before the next block's are made
    kv, qg = sums
    for i in range(1, len(spans)):  # kv[i]: the sum over blocks <= i; qg[i]: over blocks >= i
        kv[i].add_(kv[i - 1])
        qg[-1 - i].add_(qg[-i])
    if not bool(torch.isfinite(kv[-1].sum() + qg[0].sum())):
        return False
    for i, idx in enumerate(spans):
        phi_q, phi_k, v1, g1, hq, hk = prep(idx)
        s0, r0 = kv[i - 1:i] if i else None, qg[i + 1:i + 2] if i + 1 < len(spans) else None
        if not _fused_grads(idx, phi_q, phi_k, v1, g1, hq, hk, need, finish, s0, r0):
            return False  # an inf or NaN inside a block whose sums cancelled to finite values: rare, and exact below
        del phi_q, phi_k, v1, g1, hq, hk  # before the next block's are made
    return True


def _chunked(phi_q, phi_k, v1, g1, c, need):
    """The causal product's gradients by the chunked path's pieces, with the one-matmul scans."""
    nc = -(-phi_q.shape[-2] // c)
    s = kv_bad = rev = None
    if need[0]:
        kv = torch.bmm(flat_chunks(phi_k, c).mT, flat_chunks(v1, c))
        s, kv_bad = scan_chunks(kv, nc, matmul_chunks=SCAN_CHUNKS)
    if need[1] or need[2]:
        qg = torch.bmm(flat_chunks(phi_q, c).mT, flat_chunks(g1, c))
        rev = scan_chunks(qg, nc, reverse=True, matmul_chunks=SCAN_CHUNKS)
    return chunks_backward(phi_q, phi_k, v1, g1, c, need, states=s, kv_bad=bool(kv_bad), rev=rev)


def _global(phi_q, phi_k, v1, g1, need, sums=None):
    """The non-causal gradients (grad phi(Q), grad phi(K), grad [v | 1]; None where `need` says so)
    from [S | Z] = phi(K)^T [v | 1] and its gradient phi(Q)^T g1 (B, H, F, M + 1): given as sums
    over a row's blocks, or taken here (each only where a gradient needs it)."""
    s1, grad_s1 = sums or (phi_k.mT @ v1 if need[0] else None, phi_q.mT @ g1 if need[1] or need[2] else None)
    return (g1 @ s1.mT if need[0] else None, v1 @ grad_s1.mT if need[1] else None,
            phi_k @ grad_s1 if need[2] else None)


def _in_blocks(rows, n, block, c, prep, finish, causal, need):
    """One row's gradients in blocks of `block` tokens (a multiple of C): first the chunk products
    phi(K)^T [v | 1] and phi(Q)^T g1 of every block ((nc, F, M + 1) each, a (D, M)-sized sum per C
    tokens), scanned into the states before and after each chunk (summed over the row when not
    causal), then each block's gradients from its own chunks and those states."""
    spans = [(*rows, slice(t0, min(n, t0 + block))) for t0 in range(0, n, block)]
    kv = qg = None
    for i, idx in enumerate(spans):
        phi_q, phi_k, v1, g1, _, _ = prep(idx, graph=False)  # (1, 1, T, F|M + 1)
        if causal:
            if kv is None:
                kv, qg = (phi_q.new_empty(-(-n // c), phi_q.shape[-1], v1.shape[-1]) for _ in range(2))
            span = slice(i * block // c, i * block // c + -(-phi_q.shape[-2] // c))
            torch.bmm(flat_chunks(phi_k, c).mT, flat_chunks(v1, c), out=kv[span])
            torch.bmm(flat_chunks(phi_q, c).mT, flat_chunks(g1, c), out=qg[span])
        elif kv is None:
            kv, qg = phi_k[0, 0].mT @ v1[0, 0], phi_q[0, 0].mT @ g1[0, 0]  # (F, M + 1)
        else:
            kv.addmm_(phi_k[0, 0].mT, v1[0, 0])
            qg.addmm_(phi_q[0, 0].mT, g1[0, 0])
    del phi_q, phi_k, v1, g1
    if causal:
        # One row's scan: as one triangular matmul (nc^2 F (M + 1) multiply-adds, 1/C of the
        # chunk matmuls' work at nc = C) instead of nc small adds.
        s, kv_bad = scan_chunks(kv, kv.shape[0], matmul_chunks=SCAN_CHUNKS)
        rev = scan_chunks(qg, qg.shape[0], reverse=True, matmul_chunks=SCAN_CHUNKS)
        del kv, qg
    for i, idx in enumerate(spans):
        phi_q, phi_k, v1, g1, hq, hk = prep(idx)
        if causal:
            span = slice(i * block // c, i * block // c + -(-phi_q.shape[-2] // c))
            gr = chunks_backward(phi_q, phi_k, v1, g1, c, need, states=s[span], kv_bad=kv_bad,
                                 rev=(rev[0][span], rev[1]))
        else:
            gr = _global(phi_q, phi_k, v1, g1, need, (kv, qg))
        del v1, g1
        finish(idx, gr, phi_q, phi_k, hq, hk)
