"""A CPU model of causal_dot.cu's tiling, loop for loop, in numpy float64.

No GPU is needed to check the kernels' index arithmetic: which tokens a group and a chunk
cover, the slot layout of the group states and their scan, the reverse-time row map, the
zero padding of partial chunks and tiles, the column tiles of M and the key-dim passes over D,
and the normaliser's state. Each function here does what one kernel's grid does, one block
at a time, with the same constants; tests compare it with the naive reference. Tile contents
are computed with numpy matmuls where the kernel's threads split a tile's sums among them.
"""
import numpy as np

CHUNK, TILE = 64, 64  # causal_dot.cu's CHUNK and TILE


def _load_tile(src, t0, n, c0, rev):
    """load_tile: (CHUNK, TILE) of src (N, ld) rows t0.. (reversed when rev), columns c0..,
    zero outside."""
    ld = src.shape[1]
    dst = np.zeros((CHUNK, TILE))
    for r in range(CHUNK):
        t = t0 + r
        if t < n:
            row = n - 1 - t if rev else t
            w = max(0, min(TILE, ld - c0))
            dst[r, :w] = src[row, c0:c0 + w]
    return dst


def _update_state(s, z, ks, vs, d0, d, norm):
    su = ks.T @ vs  # (TILE key dims, TILE columns)
    rows = min(TILE, d - d0)
    s[d0:d0 + rows] += su[:rows]
    if norm:
        z[d0:d0 + rows] += ks.sum(0)[:rows]


def group_states(k, v, states, cpg, n_groups, rev, norm):
    bh_n, n, d = k.shape
    m = v.shape[-1]
    n_chunks = -(-n // CHUNK)
    for bh in range(bh_n):
        for g in range(n_groups - 1):
            for mt in range(-(-m // TILE)):
                m0 = mt * TILE
                s, z = np.zeros((d, TILE)), np.zeros(d)
                for chunk in range(g * cpg, min(n_chunks, (g + 1) * cpg)):
                    vs = _load_tile(v[bh], chunk * CHUNK, n, m0, rev)
                    for d0 in range(0, d, TILE):
                        ks = _load_tile(k[bh], chunk * CHUNK, n, d0, rev)
                        _update_state(s, z, ks, vs, d0, d, norm)
                w = min(TILE, m - m0)
                states[bh, g + 1, :, m0:m0 + w] = s[:, :w]
                if norm and mt == 0:
                    states[bh, g + 1, :, m] = z


def scan_states(states):
    states[:, 0] = 0.0
    for g in range(2, states.shape[1]):
        states[:, g] += states[:, g - 1]


def chunks(q, k, v, states, out, den_out, cpg, n_groups, rev, norm, eps):
    bh_n, n, d = q.shape
    m = v.shape[-1]
    n_chunks = -(-n // CHUNK)
    for bh in range(bh_n):
        for g in range(n_groups):
            for mt in range(-(-m // TILE)):
                m0 = mt * TILE
                st = states[bh, g] if states is not None else None
                s = np.zeros((d, TILE))
                w = min(TILE, m - m0)
                if st is not None:
                    s[:, :w] = st[:, m0:m0 + w]
                z = st[:, m].copy() if (norm and st is not None) else np.zeros(d)
                c_end = min(n_chunks, (g + 1) * cpg)
                for chunk in range(g * cpg, c_end):
                    t0 = chunk * CHUNK
                    a, o, qz = np.zeros((CHUNK, CHUNK)), np.zeros((CHUNK, TILE)), np.zeros(CHUNK)
                    for d0 in range(0, d, TILE):
                        qs = _load_tile(q[bh], t0, n, d0, rev)
                        ks = _load_tile(k[bh], t0, n, d0, rev)
                        dw = min(TILE, d - d0)
                        a += qs[:, :dw] @ ks[:, :dw].T
                        o += qs[:, :dw] @ s[d0:d0 + dw]
                        if norm:
                            qz += qs[:, :dw] @ z[d0:d0 + dw]
                    a = np.tril(a)
                    vs = _load_tile(v[bh], t0, n, m0, rev)
                    dens = qz + a.sum(1)
                    o += a @ vs
                    for r in range(CHUNK):
                        t = t0 + r
                        if t >= n:
                            continue
                        row = n - 1 - t if rev else t
                        x = o[r, :w] / (dens[r] + eps) if norm else o[r, :w]
                        out[bh, row, m0:m0 + w] = x
                        if norm and mt == 0 and den_out is not None:
                            den_out[bh, row] = dens[r]
                    if chunk + 1 < c_end:
                        for d0 in range(0, d, TILE):
                            ks = _load_tile(k[bh], t0, n, d0, rev)
                            _update_state(s, z, ks, vs, d0, d, norm)


def causal_dot_product(q, k, v, cpg, rev=False, norm=False, eps=1e-6):
    """The three launches of causal_product.cuda.launch on (BH, N, D), (BH, N, D), (BH, N, M) arrays,
    with `cpg` chunks per group. Returns out (BH, N, M) and, when norm, den (BH, N); output
    entries no block writes stay NaN."""
    bh_n, n, d = q.shape
    m = v.shape[-1]
    n_chunks = -(-n // CHUNK)
    n_groups = -(-n_chunks // cpg)
    mtot = m + 1 if norm else m
    out = np.full((bh_n, n, m), np.nan)
    den = np.full((bh_n, n), np.nan) if norm else None
    states = None
    if n_groups > 1:
        states = np.full((bh_n, n_groups, d, mtot), np.nan)
        group_states(k, v, states, cpg, n_groups, rev, norm)
        scan_states(states)
    chunks(q, k, v, states, out, den, cpg, n_groups, rev, norm, eps)
    return out, den


# --------------------------------------------------------------------------- causal_dot_tc.cu

TC_P = 72  # causal_dot_tc.cu's pitch of 16-bit tiles


def mma_k16(acc, x, px, yt, py, r0, c0, k0):
    """One warp's mma_k16 of causal_dot_tc.cu: acc (32 lanes, 4 n-tiles, 4) += X[r0.., k0..+16)
    times Y[k0..+16, c0 + 8 nt..), each lane loading its fragment pairs from the flat arrays x
    (X row-major, pitch px) and yt (Y transposed, pitch py) at the kernel's addresses, and the
    m16n8k16 fragment layout (PTX ISA) deciding which matrix element each register holds."""
    a = frag_a_rows(x, px, r0, k0)
    for nt in range(4):
        b = np.zeros((32, 2, 2))
        for lane in range(32):
            g, t = divmod(lane, 4)
            y = (c0 + 8 * nt + g) * py + k0 + 2 * t  # kernel's b pointer
            b[lane] = yt[y:y + 2], yt[y + 8:y + 10]
        _mma(acc[:, nt], a, b)


def block_product(x, px, yt, py, kdim):
    """The (64, 64) product the kernel's 8 warps compute with mma_k16 over kdim (a multiple of
    16), gathered from the lanes' accumulators at the kernel's (row, col) of each element."""
    out = np.full((64, 64), np.nan)
    for warp in range(8):
        r0, c0 = (warp % 4) * 16, (warp // 4) * 32
        acc = np.zeros((32, 4, 4))
        for k0 in range(0, kdim, 16):
            mma_k16(acc, x, px, yt, py, r0, c0, k0)
        for lane in range(32):
            g, t = divmod(lane, 4)
            for nt in range(4):
                for e in range(4):
                    out[r0 + g + 8 * (e // 2), c0 + 8 * nt + 2 * t + e % 2] = acc[lane, nt, e]
    return out


def store(tile, pitch, rows=None):
    """A (R, C) array as the kernel's flat shared-memory tile with the given row pitch."""
    rows = rows or tile.shape[0]
    flat = np.zeros(rows * pitch)
    for r in range(tile.shape[0]):
        flat[r * pitch:r * pitch + tile.shape[1]] = tile[r]
    return flat


# --------------------------------------------------------------------------- causal_dot_tc_staged.cu

def _mma(acc, a, b):
    """acc (32 lanes, 4) += the m16n8k16 product of the lanes' fragments a (32, 4 regs, 2) and
    b (32, 2 regs, 2), each register's pair placed where the PTX fragment layout says."""
    am, bm = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for reg, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            am[row, col:col + 2] = a[lane, reg]
        bm[2 * t:2 * t + 2, g], bm[2 * t + 8:2 * t + 10, g] = b[lane, 0], b[lane, 1]
    d = am @ bm
    for lane in range(32):
        g, t = divmod(lane, 4)
        acc[lane] += (d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1])


def ldmatrix_x4_trans(flat, addr):
    """ldmatrix .x4 .trans: lanes 8 i .. 8 i + 7 give (in addr) the offsets of matrix i's 8 rows of 8
    elements; lane 4 g + t gets in register i matrix i's [2t][g] and [2t + 1][g]. (32, 4, 2)."""
    assert all(a % 8 == 0 for a in addr), "ldmatrix rows must be 16-byte aligned"
    mats = np.array([[flat[addr[8 * i + r]:addr[8 * i + r] + 8] for r in range(8)] for i in range(4)])
    regs = np.zeros((32, 4, 2))
    for lane in range(32):
        g, t = divmod(lane, 4)
        regs[lane] = mats[:, 2 * t:2 * t + 2, g]
    return regs


def frag_a_rows(x, px, r0, k0):
    """The kernels' frag_a_rows: X[r0.., k0..] from X row-major (ld_pair), as mma_k16 takes it."""
    a = np.zeros((32, 4, 2))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for reg in range(4):
            base = (r0 + g + 8 * (reg % 2)) * px + k0 + 2 * t + 8 * (reg // 2)
            a[lane, reg] = x[base:base + 2]
    return a


def frag_a_cols(x, r0, k0):
    """The kernel's frag_a_cols: X^T[r0.., k0..] from X stored [k][r], by ldmatrix.trans."""
    return ldmatrix_x4_trans(x, [(k0 + lane % 8 + 8 * (lane // 16)) * TC_P + r0 + 8 * (lane // 8 % 2)
                                 for lane in range(32)])


def frag_b_rows(y, c0, k0):
    """The kernel's frag_b_rows: for each pair of n-tiles, (b0, b1) of both from Y [k][col]."""
    return [ldmatrix_x4_trans(y, [(k0 + lane % 8 + 8 * (lane // 8 % 2)) * TC_P + c0 + 16 * pair + 8 * (lane // 16)
                                  for lane in range(32)]) for pair in range(2)]


def mma_bt(acc, a, b):
    """The kernel's mma_bt: acc (32, 4 n-tiles, 4) += A Y with b from frag_b_rows."""
    for pair in range(2):
        _mma(acc[:, 2 * pair], a, b[pair][:, 0:2])
        _mma(acc[:, 2 * pair + 1], a, b[pair][:, 2:4])


def _lane_cells(r0, c0):
    """(lane, n-tile, element, row, column) of a warp's 16 x 32 accumulator tile."""
    for lane in range(32):
        g, t = divmod(lane, 4)
        for nt in range(4):
            for e in range(4):
                yield lane, nt, e, r0 + g + 8 * (e // 2), c0 + 8 * nt + 2 * t + e % 2


def _stage(xs, t0, n, m0s, rev):
    """stage_chunk: each (N, X) source of xs as a [token][x] tile of 16-byte (8-element) pieces,
    columns m0.. of it, zero-filled outside N and X (X a multiple of 8)."""
    tiles = [np.zeros(CHUNK * TC_P) for _ in xs]
    for idx in range(CHUNK * TILE // 8):
        r, c = idx // (TILE // 8), idx % (TILE // 8) * 8
        t, o = t0 + r, r * TC_P + c
        row = n - 1 - t if rev else t
        for tile, x, m0 in zip(tiles, xs, m0s):
            if t < n and m0 + c < x.shape[1]:
                tile[o:o + 8] = x[row, m0 + c:m0 + c + 8]
    return tiles


def staged_group_states(k, v, chunks, rev=False, m0=0):
    """One block of cdp_group_states_tc_staged: the group's sum_j k_j v_j^T (D, columns m0.. of M),
    from each warp's accumulators at the kernel's (d, column)."""
    n, d = k.shape
    s = np.zeros((8, 32, 4, 4))
    for chunk in chunks:
        ks, vs = _stage((k, v), chunk * CHUNK, n, (0, m0), rev)
        for w in range(8):
            r0, c0 = (w % 4) * 16, (w // 4) * 32
            for kk in range(0, CHUNK, 16):
                mma_bt(s[w], frag_a_cols(ks, r0, kk), frag_b_rows(vs, c0, kk))
    out = np.full((d, v.shape[1]), np.nan)
    for w in range(8):
        for lane, nt, e, row, col in _lane_cells((w % 4) * 16, (w // 4) * 32):
            if row < d and m0 + col < v.shape[1]:
                out[row, m0 + col] = s[w, lane, nt, e]
    return out


def staged_chunks(q, k, v, state, chunks, rev=False, m0=0):
    """One block of cdp_chunks_tc_staged, barrier to barrier: q, k (N, D <= 64), v (N, M) of one
    row, D and M multiples of 8; state (D, M) before the group's first chunk (or None); the
    group's chunk indices. Returns out (N, M) with NaN wherever the block wrote nothing."""
    n, d = q.shape
    m = v.shape[1]
    out = np.full((n, m), np.nan)

    warps = [((w % 4) * 16, (w // 4) * 32) for w in range(8)]
    s = np.zeros((8, 32, 4, 4))  # each warp's S tile, in its lanes' accumulators
    st = np.zeros(TILE * TC_P)  # S^T [m][d]
    for w, (r0, c0) in enumerate(warps):
        for lane, nt, e, row, col in _lane_cells(r0, c0):
            s[w, lane, nt, e] = state[row, m0 + col] if state is not None and row < d and m0 + col < m else 0.0
            st[col * TC_P + row] = s[w, lane, nt, e]
    for chunk in chunks:
        t0, more = chunk * CHUNK, chunk != chunks[-1]
        qs, ks, vs = _stage((q, k, v), t0, n, (0, 0, m0), rev)
        at, o = np.zeros(CHUNK * TC_P), np.zeros((8, 32, 4, 4))
        for w, (r0, c0) in enumerate(warps):  # up to the second barrier
            a = np.zeros((32, 4, 4))
            for kk in range(0, TILE, 16):
                mma_k16(a, qs, TC_P, ks, TC_P, r0, c0, kk)
                mma_k16(o[w], qs, TC_P, st, TC_P, r0, c0, kk)
            for lane, nt, e, row, col in _lane_cells(r0, c0):
                at[row * TC_P + col] = a[lane, nt, e] if col <= row else 0.0
        for w, (r0, c0) in enumerate(warps):
            for kk in range(0, CHUNK, 16):
                b = frag_b_rows(vs, c0, kk)
                mma_bt(o[w], frag_a_rows(at, TC_P, r0, kk), b)
                if more:
                    mma_bt(s[w], frag_a_cols(ks, r0, kk), b)
            for lane, nt, e, row, col in _lane_cells(r0, c0):
                t = t0 + row
                if t < n and m0 + col < m:
                    out[n - 1 - t if rev else t, m0 + col] = o[w, lane, nt, e]
                if more:
                    st[col * TC_P + row] = s[w, lane, nt, e]
    return out
