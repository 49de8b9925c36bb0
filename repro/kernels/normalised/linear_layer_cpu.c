/* The linear layer's causal attention with phi = elu + 1, fused on the CPU: from the projections'
 * q, k, v to y = num / (den + eps) and inv = 1 / (den + eps), and back to the gradients of q, k and
 * v, with phi, [v, 1], the upstream gradient's [g inv | -sum g inv y] and the chain rule through phi
 * made chunk by chunk inside (repro/kernels/normalised/blocked.py has the formulas; causal_dot_cpu.c the
 * per-chunk products, the same here on C tokens of [v, 1]). The layer (repro.attention.linear)
 * then holds nothing beyond its inputs and outputs: no phi(Q), phi(K) or [v, 1] of a group of rows,
 * which its peak memory would otherwise carry above SDPA softmax's.
 *
 * Layout: every tensor is a strided (B, H, N, X) view (`view`: the projections' (B, N, H, X)
 * outputs seen head-major, the output and gradients written the same way); inv (B H, N)
 * contiguous; mask (B, N) bytes, nonzero = a padded key, or NULL. A call runs rows [r0, r1) of the
 * B H (batch, head) rows, so that the caller's host threads split them.
 *
 * phi(x) = exp(min(x, 0)) + max(x, 0) (PyTorch's CPU formula for elu + 1), d phi / dx =
 * exp(min(x, 0)); exp by a vector polynomial (below). Non-finite inputs: as causal_dot_cpu.c, a
 * row whose total state is not finite returns 1 and the caller takes the exact path. */
#include "../plumbing/cpu_blas.h"  /* shared with the other op's C kernel */

typedef struct {
    float *p;
    long sb, sh, sn, sj; /* element strides of batch, head, token, feature */
} view;

/* exp(x) for x <= 0, 8 lanes: x = n ln 2 + r with |r| <= ln 2 / 2, exp(r) by its degree-7 minimax
 * polynomial (Cephes' expf coefficients, about 1 ulp), times 2^n made in the exponent bits. Below
 * -87.3 (2^-126) the result is the smallest normal float where exp would go subnormal: 1e-38 of a
 * feature is 0 to every sum it enters. */
/* c ? a : b lane by lane (C has no vector ?:); a NaN's comparisons are false, so pick(x > 0, 0, x)
 * keeps a NaN x where fminf would drop it: an inf or NaN must reach the row's state to be seen. */
static inline v8 pick(v8i c, v8 a, v8 b) { return (v8)((c & (v8i)a) | (~c & (v8i)b)); }

static inline v8 exp_neg(v8 x) {
    const v8 lo = (v8){0} - 87.33654f, magic = (v8){0} + 12582912.0f; /* 1.5 * 2^23: round to integer */
    x = pick(x < lo, lo, x);
    v8 n = (x * 1.44269504088896341f + magic) - magic;
    v8 r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    return p * (v8)e;
}

/* This thread's scratch of at least n floats, kept between calls (as a BLAS keeps its own): a
 * block per call would come from mmap (over glibc's threshold) and be faulted in afresh each time,
 * which costs time and shows in a resident-memory peak. Freed only with the process. */
static float *scratch(long n) {
    static __thread float *buf;
    static __thread long cap;
    if (n > cap) {
        free(buf);
        buf = malloc(sizeof(float) * n);
        cap = buf ? n : 0;
    }
    return buf;
}

/* rows x cols values of src (token stride sn, feature stride sj) into dst (rows apart by ld) */
static void gather(const float *src, long sn, long sj, int rows, int cols, float *dst, int ld) {
    for (int i = 0; i < rows; i++) {
        const float *s = src + i * sn;
        float *o = dst + (long)i * ld;
        if (sj == 1)
            memcpy(o, s, sizeof(float) * cols);
        else
            for (int j = 0; j < cols; j++)
                o[j] = s[j * sj];
    }
}

/* x (cnt values, contiguous) -> phi(x) in place; dphi (or NULL) <- d phi / dx. */
static void phi_inplace(float *x, long cnt, float *dphi) {
    for (long i = 0; i < cnt; i += 8) {
        v8 t;
        int w = cnt - i < 8 ? (int)(cnt - i) : 8;
        if (w == 8)
            t = LD(x + i);
        else {
            t = (v8){0};
            memcpy(&t, x + i, sizeof(float) * w);
        }
        v8 z = (v8){0}, e = exp_neg(pick(t > z, z, t)), f = e + pick(t < z, z, t); /* exp(min(t, 0)) + max(t, 0) */
        if (w == 8) {
            ST(x + i, f);
            if (dphi)
                ST(dphi + i, e);
        } else {
            memcpy(x + i, &f, sizeof(float) * w);
            if (dphi)
                memcpy(dphi + i, &e, sizeof(float) * w);
        }
    }
}

/* One row's chunk inputs: phi(q) and/or phi(k) (c x d; their derivatives in dq / dk where not
 * NULL), [v, 1] (c x (m + 1)), [g inv | -sum g inv y] (c x (m + 1)); NULL destinations skipped. */
typedef struct {
    view q, k, v, y, g;
    const unsigned char *mask;
    long mask_sb;
    const float *inv;
    int heads, n, d, m;
    long ahead; /* tokens from a chunk to the next one the sweep reads (C, or -C in reverse) */
} layer;

/* Ask for the rows the sweep reads next (`ahead` tokens on): in the projections' layout a row of
 * one head is 1/H of each token's span, so the reads stride across pages, where the hardware
 * prefetchers stop; without this, the loads waited on memory for longer than the products took. */
static void prefetch(const float *p, long sn, long sj, int rows, int cols, long ahead) {
    if (sj != 1)
        return;
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j += 16)
            __builtin_prefetch(p + (i + ahead) * sn + j);
}

static const float *at(const view *x, long b, long h, long t) { return x->p + b * x->sb + h * x->sh + t * x->sn; }

static void load_phi(const layer *L, const view *x, long b, long h, long t0, int cc, float *dst, float *dphi,
                     int key) {
    prefetch(at(x, b, h, t0), x->sn, x->sj, cc, L->d, L->ahead);
    gather(at(x, b, h, t0), x->sn, x->sj, cc, L->d, dst, L->d);
    phi_inplace(dst, (long)cc * L->d, dphi);
    if (key && L->mask)
        for (int i = 0; i < cc; i++)
            if (L->mask[b * L->mask_sb + t0 + i]) {
                memset(dst + (long)i * L->d, 0, sizeof(float) * L->d);
                if (dphi)
                    memset(dphi + (long)i * L->d, 0, sizeof(float) * L->d);
            }
}

static void load_v1(const layer *L, long b, long h, long t0, int cc, float *dst) {
    int m1 = L->m + 1;
    prefetch(at(&L->v, b, h, t0), L->v.sn, L->v.sj, cc, L->m, L->ahead);
    gather(at(&L->v, b, h, t0), L->v.sn, L->v.sj, cc, L->m, dst, m1);
    for (int i = 0; i < cc; i++)
        dst[(long)i * m1 + L->m] = 1.0f;
}

static void load_g1(const layer *L, long b, long h, long t0, int cc, float *dst) {
    int m = L->m, m1 = m + 1;
    const float *inv = L->inv + (b * L->heads + h) * L->n + t0;
    prefetch(at(&L->g, b, h, t0), L->g.sn, L->g.sj, cc, m, L->ahead);
    prefetch(at(&L->y, b, h, t0), L->y.sn, L->y.sj, cc, m, L->ahead);
    for (int i = 0; i < cc; i++) {
        const float *g = at(&L->g, b, h, t0 + i), *y = at(&L->y, b, h, t0 + i);
        float *o = dst + (long)i * m1, s = 0.0f, iv = inv[i];
        int j = 0;
        if (L->g.sj == 1 && L->y.sj == 1) { /* the usual layout: 8 lanes, their sums added at the end */
            v8 acc = {0};
            for (; j + 8 <= m; j += 8) {
                v8 t = LD(g + j) * iv;
                ST(o + j, t);
                acc += t * LD(y + j);
            }
            for (int w = 0; w < 8; w++)
                s += acc[w];
        }
        for (; j < m; j++) {
            o[j] = g[j * L->g.sj] * iv;
            s += o[j] * y[j * L->y.sj];
        }
        o[m] = -s;
    }
}

/* Row i of a strided view's rows t0 .. = src[i, :cols] * c[i] (c NULL: 1) * f[i, :] (f NULL: 1) */
static void scatter(const float *src, int ld, const float *c, const float *f, int rows, int cols, const view *x,
                    long b, long h, long t0) {
    for (int i = 0; i < rows; i++) {
        float *o = x->p + b * x->sb + h * x->sh + (t0 + i) * x->sn, ci = c ? c[i] : 1.0f;
        const float *s = src + (long)i * ld, *fi = f ? f + (long)i * cols : 0;
        int j = 0;
        if (x->sj == 1)
            for (; j + 8 <= cols; j += 8)
                ST(o + j, fi ? LD(s + j) * ci * LD(fi + j) : LD(s + j) * ci);
        for (; j < cols; j++)
            o[j * x->sj] = fi ? s[j] * ci * fi[j] : s[j] * ci;
    }
}

/* The rows [r0, r1) as runs of heads [h0, h1) of one batch element b: a run goes chunk by chunk,
 * every head of it within the chunk (one state per head), so that each chunk reads the
 * projections' tokens as contiguous slabs of its heads rather than 1/H of a token per row. */
#define FOR_RUNS(r0, r1, heads)                                                                        \
    for (long r_ = r0, b, h0, h1; r_ < r1 && (b = r_ / heads, h0 = r_ % heads,                        \
                                              h1 = heads < h0 + (r1 - r_) ? heads : h0 + (r1 - r_), 1); \
         r_ += h1 - h0)

/* y (B, H, N, M) = num * inv, inv = 1 / (den + eps), [num | den]_i = phi(q_i)^T sum_{j <= i} phi(k_j) [v_j, 1]^T */
int linear_elu_forward(long r0, long r1, int heads, int n, int d, int m, int c, float eps, const view *q,
                       const view *k, const view *v, const unsigned char *mask, long mask_sb, const view *y,
                       float *inv) {
    int m1 = m + 1;
    long dm = (long)d * m1;
    float *ws = scratch(2L * c * d + 2L * c * m1 + (long)d * c + (long)c * c + (heads + 1L) * dm);
    if (!ws)
        return -1;
    float *qc = ws, *kc = qc + c * d, *vc = kc + c * d, *oc = vc + c * m1, *kt = oc + c * m1, *a = kt + d * c,
          *kv = a + c * c, *states = kv + dm;
    layer L = {*q, *k, *v, *y, *y, mask, mask_sb, inv, heads, n, d, m, c};
    int bad = 0;
    FOR_RUNS(r0, r1, heads) {
        memset(states, 0, sizeof(float) * dm * (h1 - h0));
        for (long t0 = 0; t0 < n; t0 += c) {
            int cc = n - t0 < c ? (int)(n - t0) : c;
            for (long h = h0; h < h1; h++) {
                float *S = states + (h - h0) * dm;
                load_phi(&L, q, b, h, t0, cc, qc, 0, 0);
                load_phi(&L, k, b, h, t0, cc, kc, 0, 1);
                load_v1(&L, b, h, t0, cc, vc);
                transpose(kc, cc, d, kt);                       /* (D, cc) */
                gemm(cc, cc, d, qc, d, 1, kt, cc, a, cc, NLOW); /* a = phi(q) phi(k)^T, j <= i */
                tril(a, cc);
                gemm2(cc, m1, P(qc, d, 1, S, m1, d), P(a, cc, 1, vc, m1, cc), oc, m1, KLOW); /* phi(q) S + a [v, 1] */
                gemm(d, m1, cc, kc, 1, d, vc, m1, kv, m1, 0);   /* S += phi(k)^T [v, 1] */
                add_into(S, kv, dm);
                float *iv = inv + (b * heads + h) * n + t0;
                for (int i = 0; i < cc; i++)
                    iv[i] = 1.0f / (oc[(long)i * m1 + m] + eps);
                scatter(oc, m1, iv, 0, cc, m, y, b, h, t0);
            }
        }
        bad |= !all_finite(states, dm * (h1 - h0));
    }
    return bad;
}

/* The gradients of linear_elu_forward's y for the upstream g, from its y and inv, each written
 * where its view is not NULL (grad q: a forward sweep; grad k and grad v: a reverse one; with g1 =
 * [g inv | -sum g inv y] and the states S (before a chunk) and R (after it), as causal_dot_cpu.c):
 *   grad q = (tril(g1 v1^T) phi(k) + g1 S^T) * phi'(q)
 *   grad k = (tril(g1 v1^T)^T phi(q) + v1 R^T) * phi'(k),   grad v = (tril(phi(q) phi(k)^T)^T g1 + phi(k) R)[:, :M]
 * Returns 1 when a row's sum phi(k) v1^T (only with grad q) or phi(q)^T g1 is not finite. */
int linear_elu_backward(long r0, long r1, int heads, int n, int d, int m, int c, const view *q, const view *k,
                        const view *v, const unsigned char *mask, long mask_sb, const view *y, const float *inv,
                        const view *g, const view *gq, const view *gk, const view *gv) {
    int m1 = m + 1, w = d > m1 ? d : m1;
    long dm = (long)d * m1;
    float *ws = scratch(3L * c * d + 2L * c * m1 + (long)w * c + 2L * c * c + (long)c * w + (heads + 2L) * dm);
    if (!ws)
        return -1;
    float *qc = ws, *kc = qc + c * d, *dx = kc + c * d, *vc = dx + c * d, *gc = vc + c * m1, *xt = gc + c * m1,
          *a = xt + w * c, *p = a + c * c, *out = p + c * c, *rt = out + c * w, *tmp = rt + dm, *states = tmp + dm;
    layer L = {*q, *k, *v, *y, *g, mask, mask_sb, inv, heads, n, d, m, c};
    int bad = 0;
    FOR_RUNS(r0, r1, heads) {
        long runs = (h1 - h0) * dm;
        if (gq) { /* forward sweep: each head's state holds S^T (M + 1, D) before the chunk */
            L.ahead = c;
            memset(states, 0, sizeof(float) * runs);
            for (long t0 = 0; t0 < n; t0 += c) {
                int cc = n - t0 < c ? (int)(n - t0) : c;
                for (long h = h0; h < h1; h++) {
                    float *St = states + (h - h0) * dm;
                    load_phi(&L, k, b, h, t0, cc, kc, 0, 1);
                    load_v1(&L, b, h, t0, cc, vc);
                    load_g1(&L, b, h, t0, cc, gc);
                    transpose(vc, cc, m1, xt);                        /* (M + 1, cc) */
                    gemm(cc, cc, m1, gc, m1, 1, xt, cc, a, cc, NLOW); /* a = g1 v1^T, j <= i */
                    tril(a, cc);
                    gemm2(cc, d, P(gc, m1, 1, St, d, m1), P(a, cc, 1, kc, d, cc), out, d, KLOW); /* g1 S^T + a phi(k) */
                    load_phi(&L, q, b, h, t0, cc, qc, dx, 0);
                    scatter(out, d, 0, dx, cc, d, gq, b, h, t0);
                    gemm(m1, d, cc, vc, 1, m1, kc, d, tmp, d, 0);     /* S^T += v1^T phi(k) */
                    add_into(St, tmp, dm);
                }
            }
            bad |= !all_finite(states, runs);
        }
        if (!gk && !gv)
            continue;
        L.ahead = -c;
        memset(states, 0, sizeof(float) * runs);
        for (long t0 = (n - 1) / c * (long)c; t0 >= 0; t0 -= c) { /* reverse sweep: each head's R after the chunk */
            int cc = n - t0 < c ? (int)(n - t0) : c;
            for (long h = h0; h < h1; h++) {
                float *R = states + (h - h0) * dm;
                load_phi(&L, q, b, h, t0, cc, qc, 0, 0);
                load_phi(&L, k, b, h, t0, cc, kc, dx, 1);
                load_v1(&L, b, h, t0, cc, vc);
                load_g1(&L, b, h, t0, cc, gc);
                if (gk) {
                    transpose(vc, cc, m1, xt);                        /* (M + 1, cc) */
                    gemm(cc, cc, m1, gc, m1, 1, xt, cc, a, cc, NLOW); /* a = g1 v1^T, j <= i */
                    tril(a, cc);
                    transpose(R, d, m1, rt);                          /* (M + 1, D) */
                    gemm2(cc, d, P(vc, m1, 1, rt, d, m1), P(a, 1, cc, qc, d, cc), out, d, KUP); /* v1 R^T + a^T phi(q) */
                    scatter(out, d, 0, dx, cc, d, gk, b, h, t0);
                }
                if (gv) {
                    transpose(kc, cc, d, xt);                         /* (D, cc) */
                    gemm(cc, cc, d, qc, d, 1, xt, cc, p, cc, NLOW);   /* p = phi(q) phi(k)^T, j <= i */
                    tril(p, cc);
                    gemm2(cc, m1, P(kc, d, 1, R, m1, d), P(p, 1, cc, gc, m1, cc), out, m1, KUP); /* phi(k) R + p^T g1 */
                    scatter(out, m1, 0, 0, cc, m, gv, b, h, t0);
                }
                gemm(d, m1, cc, qc, 1, d, gc, m1, tmp, m1, 0);        /* R += phi(q)^T g1 */
                add_into(R, tmp, dm);
            }
        }
        bad |= !all_finite(states, runs);
    }
    return bad;
}
