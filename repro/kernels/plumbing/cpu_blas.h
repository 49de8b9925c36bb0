/* The small dense products the fused CPU kernels (causal_dot_cpu.c, linear_layer_cpu.c) are built
 * from: a register-blocked product of one or two operand pairs (GCC vector extensions; the
 * triangular pair skips masked work), 8 x 8 register transposes, and the chunk-state helpers.
 * Every function is static: each kernel file gets its own inlined copy. */
#ifndef REPRO_CPU_BLAS_H
#define REPRO_CPU_BLAS_H
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

#endif
