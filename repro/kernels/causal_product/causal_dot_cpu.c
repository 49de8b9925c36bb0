/* The causal dot product on the CPU, fused: one pass per sequence, chunk by chunk, every
 * intermediate in a few cache-sized buffers. The same chunked algorithm as repro/kernels/causal_product/chunked.py
 * (that file's docstring has the formulas), without its per-op cost: there each chunk product is
 * a batched BLAS call over all chunks, and the BLAS's small-matrix path (MKL's on AMD above all)
 * runs at a fraction of its large-GEMM rate. Here every product is the small register-blocked
 * kernel `gemm` below, on operands that stay in L1/L2.
 *
 * Layout: q, k (rows, N, D), v, out (rows, N, M), fp32, contiguous; a row is one (batch, head)
 * sequence. Built on first use by repro/kernels/causal_product/cpu_native.py (cc -O3 -march=native), called
 * through ctypes, which releases the GIL: the caller's host threads run groups of rows.
 *
 * Non-finite inputs: an inf or NaN in k or v (q and g in the backward) would reach masked
 * products as 0 * inf = NaN, in rows the formula leaves finite. The functions return 1 when the
 * sequence's total state (sum k v^T; in the backward also sum q g^T) is not finite, which an inf
 * or NaN in those inputs always makes it, and the caller then takes the chunked path's exact one.
 * No -ffast-math: isfinite must stay a real test. */
#include "../plumbing/cpu_blas.h"  /* shared with the other op's C kernel */

/* out_i = sum_{j <= i} (q_i . k_j) v_j + q_i^T S0. state (rows, D, M): NULL, or the state before
 * each row (S0), replaced by the state after it. Returns 1 when a row's total state is not finite. */
int causal_dot_forward(long rows, int n, int d, int m, int c, const float *q, const float *k, const float *v,
                       float *out, float *state) {
    float *ws = malloc(sizeof(float) * ((long)d * c + (long)c * c + 2L * d * m));
    if (!ws)
        return -1;
    float *kt = ws, *a = kt + d * c, *local = a + c * c, *kv = local + d * m;
    int bad = 0;
    for (long r = 0; r < rows; r++) {
        const float *qr = q + r * n * d, *kr = k + r * n * d, *vr = v + r * n * m;
        float *o = out + r * n * m, *S = state ? state + r * d * m : local;
        if (!state)
            memset(S, 0, sizeof(float) * d * m);
        for (long t0 = 0; t0 < n; t0 += c) {
            int cc = n - t0 < c ? (int)(n - t0) : c;
            const float *qc = qr + t0 * d, *kc = kr + t0 * d, *vc = vr + t0 * m;
            float *oc = o + t0 * m;
            transpose(kc, cc, d, kt);                           /* (D, cc) */
            gemm(cc, cc, d, qc, d, 1, kt, cc, a, cc, NLOW);     /* a = q k^T, j <= i */
            tril(a, cc);
            /* out = q S + tril(q k^T) v */
            gemm2(cc, m, P(qc, d, 1, S, m, d), P(a, cc, 1, vc, m, cc), oc, m, KLOW);
            gemm(d, m, cc, kc, 1, d, vc, m, kv, m, 0);          /* S += k^T v */
            add_into(S, kv, (long)d * m);
        }
        bad |= !all_finite(S, (long)d * m);
    }
    free(ws);
    return bad;
}

/* The gradients of causal_dot_forward's out (with S0 = s0, NULL: zeros) for the upstream g (rows,
 * N, M), each written where its pointer is not NULL:
 *   grad q = tril(g v^T) k + g S^T        S: the state before each chunk (a forward sweep)
 *   grad k = tril(g v^T)^T q + v R^T      R: sum over later chunks of q^T g, plus r0 (the reverse
 *   grad v = tril(q k^T)^T g + k R           state after the row, NULL: zeros; a reverse sweep)
 * Two sweeps, so that no per-chunk state is stored (the sweep for grad q takes tril(g v^T) again:
 * about 4 % more work than one sweep over stored states, and no (N / C) D M buffer to stream).
 * Returns 1 when a row's sum k v^T (only when grad q is asked) or sum q g^T is not finite. */
int causal_dot_backward(long rows, int n, int d, int m, int c, const float *q, const float *k, const float *v,
                        const float *g, float *gq, float *gk, float *gv, const float *s0, const float *r0) {
    long dm = (long)d * m;
    float *ws = malloc(sizeof(float) * ((long)(m + d) * c + 2L * c * c + 3 * dm));
    if (!ws)
        return -1;
    float *vt = ws, *kt = vt + m * c, *a = kt + d * c, *p = a + c * c, *R = p + c * c, *rt = R + dm, *tmp = rt + dm;
    int bad = 0;
    for (long r = 0; r < rows; r++) {
        const float *qr = q + r * n * d, *kr = k + r * n * d, *vr = v + r * n * m, *gr = g + r * n * m;
        if (gq) { /* forward sweep: rt holds S^T (M, D) before the chunk */
            if (s0)
                transpose(s0 + r * dm, d, m, rt);
            else
                memset(rt, 0, sizeof(float) * dm);
            for (long t0 = 0; t0 < n; t0 += c) {
                int cc = n - t0 < c ? (int)(n - t0) : c;
                const float *kc = kr + t0 * d, *vc = vr + t0 * m, *gc = gr + t0 * m;
                transpose(vc, cc, m, vt);                       /* (M, cc) */
                gemm(cc, cc, m, gc, m, 1, vt, cc, a, cc, NLOW); /* a = g v^T, j <= i */
                tril(a, cc);
                /* g S^T + a k */
                gemm2(cc, d, P(gc, m, 1, rt, d, m), P(a, cc, 1, kc, d, cc), gq + r * n * d + t0 * d, d, KLOW);
                gemm(m, d, cc, vc, 1, m, kc, d, tmp, d, 0);     /* S^T += the chunk's v^T k */
                add_into(rt, tmp, dm);
            }
            bad |= !all_finite(rt, dm);
        }
        if (!gk && !gv)
            continue;
        if (r0)
            memcpy(R, r0 + r * dm, sizeof(float) * dm);
        else
            memset(R, 0, sizeof(float) * dm);
        for (long t0 = (n - 1) / c * (long)c; t0 >= 0; t0 -= c) { /* reverse sweep: R after the chunk */
            int cc = n - t0 < c ? (int)(n - t0) : c;
            const float *qc = qr + t0 * d, *kc = kr + t0 * d, *vc = vr + t0 * m, *gc = gr + t0 * m;
            if (gk) {
                transpose(vc, cc, m, vt);                       /* (M, cc) */
                gemm(cc, cc, m, gc, m, 1, vt, cc, a, cc, NLOW); /* a = g v^T, j <= i */
                tril(a, cc);
                transpose(R, d, m, rt);                         /* (M, D) */
                /* v R^T + a^T q */
                gemm2(cc, d, P(vc, m, 1, rt, d, m), P(a, 1, cc, qc, d, cc), gk + r * n * d + t0 * d, d, KUP);
            }
            if (gv) {
                transpose(kc, cc, d, kt);                       /* (D, cc) */
                gemm(cc, cc, d, qc, d, 1, kt, cc, p, cc, NLOW); /* p = q k^T, j <= i */
                tril(p, cc);
                /* k R + p^T g */
                gemm2(cc, m, P(kc, d, 1, R, m, d), P(p, 1, cc, gc, m, cc), gv + r * n * m + t0 * m, m, KUP);
            }
            gemm(d, m, cc, qc, 1, d, gc, m, tmp, m, 0);         /* R += the chunk's q^T g */
            add_into(R, tmp, dm);
        }
        bad |= !all_finite(R, dm);
    }
    free(ws);
    return bad;
}
