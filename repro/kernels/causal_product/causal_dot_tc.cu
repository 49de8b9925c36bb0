// Tensor-core variant of cdp_chunks (causal_dot.cu) for bf16 inputs: the same grid,
// groups, chunks, reverse map and normaliser, with the four (64 x 64) products of a chunk
//   A = Q K^T,  O = Q S,  O += mask(A) V,  S += K^T V
// done by mma.sync.m16n8k16 (16-bit operands, fp32 accumulators). The state S is kept in fp32
// in shared memory and rounded to the input type only as an mma operand, as is the masked A.
// cdp_group_states and cdp_scan_states of causal_dot.cu prepare `states` for it unchanged.
// Not for fp16: a state summed over tens of thousands of tokens can pass fp16's 65504, and
// fp32 keeps the FMA kernel, whose 1e-5 accuracy tf32 operands could not give.
//
// Fragment layout of mma.m16n8k16 (.row.col, 16-bit A/B, f32 C/D), lane = 4 g + t:
//   A (16 x 16, row-major):  a0 = A[g][2t..2t+1]    a1 = A[g+8][2t..2t+1]
//                            a2 = A[g][2t+8..2t+9]  a3 = A[g+8][2t+8..2t+9]
//   B (16 x 8):              b0 = B[2t..2t+1][g]    b1 = B[2t+8..2t+9][g]
//   C (16 x 8, f32):         c0, c1 = C[g][2t], C[g][2t+1]    c2, c3 = C[g+8][2t], C[g+8][2t+1]
// (pairs packed low element first). So a B operand is read from B^T stored row-major, and
// every product below reads its operands from tiles stored with the reduced index contiguous:
//   Q [token][d], K [token][d] (as K^T's B^T), V^T [m][token], A [token][token], S^T [m][d],
//   K^T [d][token] (for S += K^T V, reloaded transposed).
// dtypes.cuh is prepended by cuda_build.py. emulate.py's mma model mirrors the addressing.

#define TC_CHUNK 64
#define TC_TILE 64
#define TC_P 72       // pitch of 16-bit tiles (elements): 36 words, so the 8 rows x 4 words a
                      // fragment load touches fall in 32 different banks
#define TC_SP 72      // pitch of the fp32 tiles S and A (floats)
#define TC_THREADS 256 // 8 warps: warp w owns rows 16 (w % 4).. and columns 32 (w / 4).. of a
                       // 64 x 64 product, as four 16 x 8 accumulator tiles

typedef unsigned short u16;

__device__ __forceinline__ unsigned ld_pair(const u16* p) {  // p: even element, 4-byte aligned
    return *reinterpret_cast<const unsigned*>(p);
}

template <typename T> struct Mma;  // bf16 only, see above
template <> struct Mma<bf16_t> {
    static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
// The A fragment of X[r0.., k0..k0+16) for X stored row-major (pitch px).
__device__ __forceinline__ void frag_a_rows(unsigned (&a)[4], const u16* X, int px, int r0, int k0) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    a[0] = ld_pair(X + (r0 + g) * px + k0 + 2 * t);
    a[1] = ld_pair(X + (r0 + g + 8) * px + k0 + 2 * t);
    a[2] = ld_pair(X + (r0 + g) * px + k0 + 2 * t + 8);
    a[3] = ld_pair(X + (r0 + g + 8) * px + k0 + 2 * t + 8);
}

// acc[nt] (rows r0.., columns c0 + 8 nt..) += X[r0.., k0..k0+16) Y[k0..k0+16, c0 + 8 nt..)
// with X stored row-major (pitch px) and Y stored transposed, Yt[col][k] (pitch py).
template <typename T>
__device__ __forceinline__ void mma_k16(float (&acc)[4][4], const u16* X, int px, const u16* Yt, int py,
                                        int r0, int c0, int k0) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    unsigned a[4];
    frag_a_rows(a, X, px, r0, k0);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        const u16* y = Yt + (c0 + 8 * nt + g) * py + k0 + 2 * t;
        unsigned b[2] = {ld_pair(y), ld_pair(y + 8)};
        Mma<T>::run(acc[nt], a, b);
    }
}

// dst = a (CHUNK x TILE) tile of src rows t0.. (reversed when REV), columns c0.., as raw 16-bit
// values, zero outside (N, ld); stored [r][c] or, when TRANS, [c][r]. Pitch TC_P.
// vec (untransposed only; the launcher sets it only where ld % 8 == 0 and src is 16-byte
// aligned, so a row's 8-column group lies wholly inside or outside ld): 16-byte loads and
// stores, 8 elements a thread, rather than 2-byte ones (TC_P * 2 = 144 bytes keeps rows aligned).
template <typename T, bool REV, bool TRANS>
__device__ __forceinline__ void load_tile16(u16* dst, const T* src, int t0, int N, int ld, int c0,
                                            bool vec = false) {
    if (!TRANS && vec) {
        for (int idx = threadIdx.x; idx < TC_CHUNK * TC_TILE / 8; idx += TC_THREADS) {
            const int r = idx / (TC_TILE / 8), c = idx % (TC_TILE / 8) * 8;
            const int t = t0 + r, col = c0 + c;
            uint4 x = make_uint4(0u, 0u, 0u, 0u);
            if (t < N && col < ld) {
                const long long row = REV ? (long long)(N - 1 - t) : (long long)t;
                x = *reinterpret_cast<const uint4*>(src + row * ld + col);
            }
            *reinterpret_cast<uint4*>(dst + r * TC_P + c) = x;
        }
        return;
    }
    for (int idx = threadIdx.x; idx < TC_CHUNK * TC_TILE; idx += TC_THREADS) {
        const int r = idx / TC_TILE, c = idx % TC_TILE;
        const int t = t0 + r, col = c0 + c;
        u16 x = 0;  // +0.0 in bf16 and fp16
        if (t < N && col < ld) {
            const long long row = REV ? (long long)(N - 1 - t) : (long long)t;
            x = src[row * ld + col].bits;
        }
        dst[TRANS ? c * TC_P + r : r * TC_P + c] = x;
    }
}

// grid (BH, n_groups, n_mtiles) as cdp_chunks. Dp = D rounded up to a multiple of 64. vec: Q and
// K tiles by 16-byte loads (load_tile16).
// smem bytes: 4 (Dp TC_SP + [NORM] CHUNK TC_SP + Dp + CHUNK) + 2 (4 CHUNK TC_P + TILE (Dp + 8)):
// the fp32 scores only with the normaliser, so that the bare product fits 3 blocks per SM.
template <typename T, bool REV, bool NORM>
__global__ void __launch_bounds__(TC_THREADS)
cdp_chunks_tc(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
              const float* __restrict__ states, T* __restrict__ out, float* __restrict__ den_out,
              int N, int D, int M, int Mtot, int cpg, int n_groups, float eps, int vec) {
    extern __shared__ float smem[];
    const int Dp = (D + TC_TILE - 1) / TC_TILE * TC_TILE;
    const int STP = Dp + 8;                    // pitch of S^T
    float* Ss = smem;                          // [Dp][TC_SP] fp32 state, rows >= D stay zero
    float* As32 = Ss + Dp * TC_SP;             // [CHUNK][TC_SP] masked scores, fp32 (NORM only)
    float* Zs = As32 + (NORM ? TC_CHUNK * TC_SP : 0);  // [Dp]
    float* dens = Zs + Dp;                     // [CHUNK]
    u16* Qs = reinterpret_cast<u16*>(dens + TC_CHUNK);  // [token][d]
    u16* Ks = Qs + TC_CHUNK * TC_P;            // [token][d]; [d][token] in the state update
    u16* Vt = Ks + TC_CHUNK * TC_P;            // [m][token]
    u16* At = Vt + TC_CHUNK * TC_P;            // [token][token] masked scores, input type
    u16* St = At + TC_CHUNK * TC_P;            // [m][d] state, input type

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
    const int r0 = (warp % 4) * 16, c0 = (warp / 4) * 32;
    const long long bh = blockIdx.x;
    const int grp = blockIdx.y, m0 = blockIdx.z * TC_TILE;
    const int n_chunks = (N + TC_CHUNK - 1) / TC_CHUNK;
    q += bh * N * D;
    k += bh * N * D;
    v += bh * N * M;
    out += bh * N * M;

    const float* st = states ? states + (bh * n_groups + grp) * (long long)D * Mtot : nullptr;
    for (int i = tid; i < Dp * TC_TILE; i += TC_THREADS) {
        const int d = i / TC_TILE, c = i % TC_TILE;
        const float x = (st && d < D && m0 + c < M) ? st[(long long)d * Mtot + m0 + c] : 0.f;
        Ss[d * TC_SP + c] = x;
        St[c * STP + d] = from_f<T>(x).bits;
    }
    for (int d = tid; d < Dp; d += TC_THREADS) Zs[d] = (NORM && st && d < D) ? st[(long long)d * Mtot + M] : 0.f;
    __syncthreads();

    const int c_end = min(n_chunks, (grp + 1) * cpg);
    for (int chunk = grp * cpg; chunk < c_end; ++chunk) {
        const int t0 = chunk * TC_CHUNK;
        float a[4][4] = {}, o[4][4] = {};
        float qz = 0.f;
        for (int d0 = 0; d0 < Dp; d0 += TC_TILE) {
            load_tile16<T, REV, false>(Qs, q, t0, N, D, d0, vec);
            load_tile16<T, REV, false>(Ks, k, t0, N, D, d0, vec);
            __syncthreads();
#pragma unroll
            for (int kk = 0; kk < TC_TILE; kk += 16) {
                mma_k16<T>(a, Qs, TC_P, Ks, TC_P, r0, c0, kk);           // Q K^T: B^T = K [token][d]
                mma_k16<T>(o, Qs, TC_P, St + d0, STP, r0, c0, kk);       // Q S:   B^T = S^T [m][d]
            }
            if (NORM && tid < TC_CHUNK)
                for (int kk = 0; kk < TC_TILE; ++kk) qz += to_f(T{Qs[tid * TC_P + kk]}) * Zs[d0 + kk];
            __syncthreads();
        }
        // causal mask in registers: accumulator element (row, col) per the C layout
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = r0 + g + 8 * (e / 2), col = c0 + 8 * nt + 2 * t4 + e % 2;
                const float x = col <= row ? a[nt][e] : 0.f;
                At[row * TC_P + col] = from_f<T>(x).bits;
                if (NORM) As32[row * TC_SP + col] = x;
            }
        load_tile16<T, REV, true>(Vt, v, t0, N, M, m0);
        __syncthreads();
        if (NORM && tid < TC_CHUNK) {
            float s = qz;
            for (int j = 0; j <= tid; ++j) s += As32[tid * TC_SP + j];
            dens[tid] = s;
        }
#pragma unroll
        for (int kk = 0; kk < TC_CHUNK; kk += 16) mma_k16<T>(o, At, TC_P, Vt, TC_P, r0, c0, kk);  // B^T = V^T
        if (NORM) __syncthreads();  // dens
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = r0 + g + 8 * (e / 2), col = m0 + c0 + 8 * nt + 2 * t4 + e % 2;
                const int t = t0 + row;
                if (t < N && col < M) {
                    float x = o[nt][e];
                    if (NORM) x /= dens[row] + eps;
                    out[(REV ? (long long)(N - 1 - t) : (long long)t) * M + col] = from_f<T>(x);
                }
            }
        if (NORM && den_out && blockIdx.z == 0 && tid < TC_CHUNK && t0 + tid < N) {
            const int t = t0 + tid;
            den_out[bh * N + (REV ? N - 1 - t : t)] = dens[tid];
        }
        if (chunk + 1 < c_end) {  // S += K^T V on the 64 key dims of each pass, then refresh S^T
            for (int d0 = 0; d0 < Dp; d0 += TC_TILE) {
                load_tile16<T, REV, true>(Ks, k, t0, N, D, d0);  // K^T [d][token]
                __syncthreads();
                float s[4][4];
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        s[nt][e] = Ss[(d0 + r0 + g + 8 * (e / 2)) * TC_SP + c0 + 8 * nt + 2 * t4 + e % 2];
#pragma unroll
                for (int kk = 0; kk < TC_CHUNK; kk += 16) mma_k16<T>(s, Ks, TC_P, Vt, TC_P, r0, c0, kk);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int d = d0 + r0 + g + 8 * (e / 2), c = c0 + 8 * nt + 2 * t4 + e % 2;
                        Ss[d * TC_SP + c] = s[nt][e];
                        St[c * STP + d] = from_f<T>(s[nt][e]).bits;
                    }
                if (NORM && tid < TC_TILE) {
                    float z = 0.f;
                    for (int j = 0; j < TC_CHUNK; ++j) z += to_f(T{Ks[tid * TC_P + j]});
                    Zs[d0 + tid] += z;
                }
                __syncthreads();
            }
        } else {
            __syncthreads();
        }
    }
}

// Tensor-core variant of cdp_group_states: slot g + 1 of `states` gets group g's
// sum_j k_j v_j^T (and sum_j k_j when NORM), grid (BH, n_groups - 1, n_mtiles).
// smem bytes: 4 (Dp TC_SP + Dp) + 2 (2 CHUNK TC_P).
template <typename T, bool REV, bool NORM>
__global__ void __launch_bounds__(TC_THREADS)
cdp_group_states_tc(const T* __restrict__ k, const T* __restrict__ v, float* __restrict__ states,
                    int N, int D, int M, int Mtot, int cpg, int n_groups) {
    extern __shared__ float smem[];
    const int Dp = (D + TC_TILE - 1) / TC_TILE * TC_TILE;
    float* Ss = smem;                         // [Dp][TC_SP]
    float* Zs = Ss + Dp * TC_SP;              // [Dp]
    u16* Kt = reinterpret_cast<u16*>(Zs + Dp);  // [d][token]
    u16* Vt = Kt + TC_CHUNK * TC_P;           // [m][token]
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
    const int r0 = (warp % 4) * 16, c0 = (warp / 4) * 32;
    const long long bh = blockIdx.x;
    const int grp = blockIdx.y, m0 = blockIdx.z * TC_TILE;
    const int n_chunks = (N + TC_CHUNK - 1) / TC_CHUNK;
    k += bh * N * D;
    v += bh * N * M;
    for (int i = tid; i < Dp * TC_SP; i += TC_THREADS) Ss[i] = 0.f;
    for (int d = tid; d < Dp; d += TC_THREADS) Zs[d] = 0.f;
    __syncthreads();
    const int c_end = min(n_chunks, (grp + 1) * cpg);
    for (int chunk = grp * cpg; chunk < c_end; ++chunk) {
        const int t0 = chunk * TC_CHUNK;
        load_tile16<T, REV, true>(Vt, v, t0, N, M, m0);
        for (int d0 = 0; d0 < Dp; d0 += TC_TILE) {
            load_tile16<T, REV, true>(Kt, k, t0, N, D, d0);
            __syncthreads();
            float s[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[nt][e] = Ss[(d0 + r0 + g + 8 * (e / 2)) * TC_SP + c0 + 8 * nt + 2 * t4 + e % 2];
#pragma unroll
            for (int kk = 0; kk < TC_CHUNK; kk += 16) mma_k16<T>(s, Kt, TC_P, Vt, TC_P, r0, c0, kk);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    Ss[(d0 + r0 + g + 8 * (e / 2)) * TC_SP + c0 + 8 * nt + 2 * t4 + e % 2] = s[nt][e];
            if (NORM && tid < TC_TILE) {
                float z = 0.f;
                for (int j = 0; j < TC_CHUNK; ++j) z += to_f(T{Kt[tid * TC_P + j]});
                Zs[d0 + tid] += z;
            }
            __syncthreads();
        }
    }
    float* out = states + (bh * n_groups + grp + 1) * (long long)D * Mtot;
    for (int i = tid; i < D * TC_TILE; i += TC_THREADS) {
        const int d = i / TC_TILE, c = i % TC_TILE;
        if (m0 + c < M) out[(long long)d * Mtot + m0 + c] = Ss[d * TC_SP + c];
    }
    if (NORM && blockIdx.z == 0)
        for (int d = tid; d < D; d += TC_THREADS) out[(long long)d * Mtot + M] = Zs[d];
}
