/* The causal dot product on the CPU, fused: one pass per sequence, chunk by chunk, every
 * intermediate in a few cache-sized buffers. The same chunked algorithm as repro/kernels/chunked.py
 * (that file's docstring has the formulas), without its per-op cost: there each chunk product is
 * a batched BLAS call over all chunks, and the BLAS's small-matrix path (MKL's on AMD above all)
 * runs at a fraction of its large-GEMM rate. Here every product is the small register-blocked
 * kernel `gemm` below, on operands that stay in L1/L2.
 *
 * Layout: q, k (rows, N, D), v, out (rows, N, M), fp32, contiguous; a row is one (batch, head)
 * sequence. Built on first use by repro/kernels/cpu_native.py (cc -O3 -march=native), called
 * through ctypes, which releases the GIL: the caller's host threads run groups of rows.
 *
 * Non-finite inputs: an inf or NaN in k or v (q and g in the backward) would reach masked
 * products as 0 * inf = NaN, in rows the formula leaves finite. The functions return 1 when the
 * sequence's total state (sum k v^T; in the backward also sum q g^T) is not finite, which an inf
 * or NaN in those inputs always makes it, and the caller then takes the chunked path's exact one.
 * No -ffast-math: isfinite must stay a real test. */
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* unaligned loads and stores */
#define LD(p) (*(const v8u *)(p))
#define ST(p, x) (*(v8u *)(p) = (x))

enum { ACC = 1, KLOW = 2, KUP = 4, NLOW = 8 };

/* One operand pair of a product: op(A)[i, kk] = A[i ar + kk ac] (A or its transpose, any strides)
 * and B (k x n) with rows ldb apart. */
typedef struct {
    const float *A, *B;
    long ar, ac, ldb;
    int k;
} pair;

/* C[r, 0:8W] (+)= sum_kk op(A)[r, kk] B[kk, 0:8W] for r < R over kk in [0, d.k) of the dense
 * pair d and [tb, te) of the triangular pair t: R x 8W accumulators held in registers (R <= 6,
 * W <= 2: 12 of the 16 AVX2 registers), so a sum of two products is one pass over C. */
static inline __attribute__((always_inline)) void tile(int R, int W, pair d, int tb, int te, pair t, long j,
                                                       float *C, long ldc, int acc) {
    v8 c[6][2];
    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++)
            c[r][w] = acc ? LD(C + r * ldc + 8 * w) : (v8){0};
#define STEP(P, kk)                                                                                    \
    {                                                                                                  \
        const float *b = P.B + (kk) * P.ldb + j, *a = P.A + (kk) * P.ac;                             \
        v8 b0 = LD(b), b1 = W > 1 ? LD(b + 8) : b0;                                                    \
        for (int r = 0; r < R; r++) {                                                                  \
            float s = a[r * P.ar];                                                                     \
            v8 av = {s, s, s, s, s, s, s, s};                                                          \
            c[r][0] += av * b0;                                                                        \
            if (W > 1)                                                                                 \
                c[r][1] += av * b1;                                                                    \
        }                                                                                              \
    }
    for (int kk = 0; kk < d.k; kk++)
        STEP(d, kk)
    for (int kk = tb; kk < te; kk++)
        STEP(t, kk)
#undef STEP
    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++)
            ST(C + r * ldc + 8 * w, c[r][w]);
}

#define TILE_CASES(W)                                                                                  \
    switch (R) {                                                                                       \
    case 6: tile(6, W, dd, tb, te, tt, j, c, ldc, acc); break;                                         \
    case 5: tile(5, W, dd, tb, te, tt, j, c, ldc, acc); break;                                         \
    case 4: tile(4, W, dd, tb, te, tt, j, c, ldc, acc); break;                                         \
    case 3: tile(3, W, dd, tb, te, tt, j, c, ldc, acc); break;                                         \
    case 2: tile(2, W, dd, tb, te, tt, j, c, ldc, acc); break;                                         \
    default: tile(1, W, dd, tb, te, tt, j, c, ldc, acc); break;                                        \
    }

/* C (m x n, row stride ldc) (+)= op(d.A) d.B + op(t.A) t.B, where d is a dense pair (d.k = 0:
 * none) and t is a triangular one when flags say so: KLOW takes t's kk <= i only, KUP kk >= i
 * (its masked entries are zeros: a block of rows takes the kk its last or first row needs). ACC
 * adds to C (else overwrites); NLOW writes only the columns j <= i of each block of rows
 * (rounded up to 8: the caller zeroes j > i). */
static void gemm2(int m, int n, pair d, pair t, float *C, long ldc, int flags) {
    int acc = flags & ACC;
    for (int i0 = 0; i0 < m; i0 += 6) {
        int R = m - i0 < 6 ? m - i0 : 6;
        int tb = flags & KUP ? i0 : 0;
        int te = flags & KLOW ? (i0 + R < t.k ? i0 + R : t.k) : t.k;
        int ne = n;
        if (flags & NLOW) {
            ne = (i0 + R + 7) / 8 * 8;
            ne = ne < n ? ne : n;
        }
        pair dd = d, tt = t;
        dd.A += i0 * d.ar;
        tt.A += i0 * t.ar;
        float *c = C + i0 * ldc;
        long j = 0;
        for (; j + 16 <= ne; j += 16, c += 16)
            TILE_CASES(2)
        for (; j + 8 <= ne; j += 8, c += 8)
            TILE_CASES(1)
        for (; j < ne; j++, c++) /* fewer than 8 columns left */
            for (int r = 0; r < R; r++) {
                float s = acc ? c[r * ldc] : 0.0f;
                for (int kk = 0; kk < d.k; kk++)
                    s += dd.A[r * d.ar + kk * d.ac] * d.B[kk * d.ldb + j];
                for (int kk = tb; kk < te; kk++)
                    s += tt.A[r * t.ar + kk * t.ac] * t.B[kk * t.ldb + j];
                c[r * ldc] = s;
            }
    }
}

static const pair NONE = {0, 0, 0, 0, 0, 0};

/* C (m x n) (+)= op(A) B over kk < k (the flags as gemm2's, on this one pair) */
static void gemm(int m, int n, int k, const float *A, long ar, long ac, const float *B, long ldb, float *C,
                 long ldc, int flags) {
    pair p = {A, B, ar, ac, ldb, k};
    if (flags & (KLOW | KUP))
        gemm2(m, n, NONE, p, C, ldc, flags);
    else
        gemm2(m, n, p, NONE, C, ldc, flags);
}

static inline pair P(const float *A, long ar, long ac, const float *B, long ldb, int k) {
    pair p = {A, B, ar, ac, ldb, k};
    return p;
}

typedef int v8i __attribute__((vector_size(32)));
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})

/* dst (8 x 8, rows ldd apart) = src (8 x 8, rows lds apart)^T, in registers: the unpack, shuffle
 * and lane-swap steps of the usual AVX transpose, written as GCC vector shuffles. */
static inline void transpose8(const float *src, long lds, float *dst, long ldd) {
    v8 r0 = LD(src), r1 = LD(src + lds), r2 = LD(src + 2 * lds), r3 = LD(src + 3 * lds), r4 = LD(src + 4 * lds),
       r5 = LD(src + 5 * lds), r6 = LD(src + 6 * lds), r7 = LD(src + 7 * lds);
    v8 t0 = SHUF(r0, r1, 0, 8, 1, 9, 4, 12, 5, 13), t1 = SHUF(r0, r1, 2, 10, 3, 11, 6, 14, 7, 15);
    v8 t2 = SHUF(r2, r3, 0, 8, 1, 9, 4, 12, 5, 13), t3 = SHUF(r2, r3, 2, 10, 3, 11, 6, 14, 7, 15);
    v8 t4 = SHUF(r4, r5, 0, 8, 1, 9, 4, 12, 5, 13), t5 = SHUF(r4, r5, 2, 10, 3, 11, 6, 14, 7, 15);
    v8 t6 = SHUF(r6, r7, 0, 8, 1, 9, 4, 12, 5, 13), t7 = SHUF(r6, r7, 2, 10, 3, 11, 6, 14, 7, 15);
    v8 s0 = SHUF(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13), s1 = SHUF(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
    v8 s2 = SHUF(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13), s3 = SHUF(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
    v8 s4 = SHUF(t4, t6, 0, 1, 8, 9, 4, 5, 12, 13), s5 = SHUF(t4, t6, 2, 3, 10, 11, 6, 7, 14, 15);
    v8 s6 = SHUF(t5, t7, 0, 1, 8, 9, 4, 5, 12, 13), s7 = SHUF(t5, t7, 2, 3, 10, 11, 6, 7, 14, 15);
    ST(dst, SHUF(s0, s4, 0, 1, 2, 3, 8, 9, 10, 11));
    ST(dst + ldd, SHUF(s1, s5, 0, 1, 2, 3, 8, 9, 10, 11));
    ST(dst + 2 * ldd, SHUF(s2, s6, 0, 1, 2, 3, 8, 9, 10, 11));
    ST(dst + 3 * ldd, SHUF(s3, s7, 0, 1, 2, 3, 8, 9, 10, 11));
    ST(dst + 4 * ldd, SHUF(s0, s4, 4, 5, 6, 7, 12, 13, 14, 15));
    ST(dst + 5 * ldd, SHUF(s1, s5, 4, 5, 6, 7, 12, 13, 14, 15));
    ST(dst + 6 * ldd, SHUF(s2, s6, 4, 5, 6, 7, 12, 13, 14, 15));
    ST(dst + 7 * ldd, SHUF(s3, s7, 4, 5, 6, 7, 12, 13, 14, 15));
}

/* dst (cols x rows) = src (rows x cols)^T: 8 x 8 blocks in registers, the edges one by one (a
 * scalar transpose took a quarter of the backward's time) */
static void transpose(const float *src, int rows, int cols, float *dst) {
    int i8 = rows / 8 * 8, j8 = cols / 8 * 8;
    for (int i = 0; i < i8; i += 8)
        for (int j = 0; j < j8; j += 8)
            transpose8(src + (long)i * cols + j, cols, dst + (long)j * rows + i, rows);
    for (int i = 0; i < rows; i++)
        for (int j = i < i8 ? j8 : 0; j < cols; j++)
            dst[(long)j * rows + i] = src[(long)i * cols + j];
}

/* s += the chunk's own sum t (n values): each chunk is summed on its own first and then added,
 * so the running state takes N / C roundings at its own scale, not N (a token at a time). */
static void add_into(float *s, const float *t, long n) {
    for (long i = 0; i < n; i++)
        s[i] += t[i];
}

static void tril(float *a, int n) { /* zero a[i, j] for j > i */
    for (int i = 0; i < n - 1; i++)
        memset(a + i * n + i + 1, 0, (n - i - 1) * sizeof(float));
}

static int all_finite(const float *x, long n) {
    float s = 0.0f;
    for (long i = 0; i < n; i++)
        s += x[i] - x[i]; /* 0 for finite x, NaN for inf or NaN */
    return s == 0.0f;
}

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
