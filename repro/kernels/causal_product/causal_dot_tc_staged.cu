// The bare bf16 product of causal_dot_tc.cu's cdp_chunks_tc (no normaliser) and the group states
// it starts from (cdp_group_states_tc), pipelined, for D <= 64 with D and M multiples of 8 on
// 16-byte aligned tensors (the launcher checks):
//  - Q, K and V of chunk c + 1 are copied into shared memory by cp.async, 16 bytes a thread and
//    zero-filled outside N, D and M, while chunk c computes (two stages);
//  - K and V stay as loaded, [token][x]: the operands that want them transposed (V as the B of
//    A V and of K^T V, K^T as the A of K^T V) come from ldmatrix.trans, so K is read once, not
//    twice, and nothing is stored transposed by 2-byte scatters;
//  - S stays in the warps' fp32 mma accumulators (warp w owns S's rows 16 (w % 4).. and columns
//    32 (w / 4)..: the tile it updates), stored only as the bf16 S^T operand of Q S.
// Two barriers a chunk where cdp_chunks_tc has five. Every product sums the same terms in the same
// order as cdp_chunks_tc, so the outputs are bit for bit its outputs (tests/kernels/test_cupy_kernels.py).
// causal_dot_tc.cu (its tile sizes, Mma, ld_pair, frag_a_rows, mma_k16) precedes this file (cuda_build.py).
// The chunk kernel's smem bytes: 2 (8 CHUNK TC_P) = 73,728, so 3 blocks fit an H100 SM (227 KB
// usable) where cdp_chunks_tc's 83,456 fit 2; so do its registers (TCS_MIN_BLOCKS).

#define TCS_STAGE (3 * TC_CHUNK * TC_P)  // Q, K, V of one chunk, 16-bit elements
// Hopper's 227 KB of shared memory an SM hold 3 chunk-kernel blocks: registers must allow them too
// (80 a thread; unasked, ptxas takes 81, which fits 2). Smaller GPUs fit fewer by shared memory.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define TCS_MIN_BLOCKS 3
#else
#define TCS_MIN_BLOCKS 1
#endif

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes from global src into shared dst without waiting; of them `n` (16 or 0) read, the
// rest zero-filled (src must still be a valid address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Four 8 x 8 matrices of 16-bit values, transposed: lanes 8 i .. 8 i + 7 give the addresses of
// matrix i's 8 rows (8 contiguous elements each, 16-byte aligned); lane 4 g + t receives in r[i]
// matrix i's elements [2t][g] and [2t + 1][g], the first in the low half.
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

// The A fragment of X^T[r0.., k0..k0+16) for X stored [k][r] (pitch TC_P): a0..a3 are the
// transposed 8 x 8 blocks at X rows (k0, k0, k0 + 8, k0 + 8), columns (r0, r0 + 8, r0, r0 + 8).
__device__ __forceinline__ void frag_a_cols(unsigned (&a)[4], const u16* X, int r0, int k0) {
    const int lane = threadIdx.x % 32, i = lane / 8, rr = lane % 8;
    ldsm_x4_trans(a, X + (k0 + rr + 8 * (i / 2)) * TC_P + r0 + 8 * (i % 2));
}

// acc[nt] (columns c0 + 8 nt..) += A Y[k0..k0+16, c0 + 8 nt..) for Y stored row-major [k][col]
// (pitch TC_P): one ldmatrix.trans gives the B fragments (b0, b1) of two n-tiles, from Y's 8 x 8
// blocks at rows (k0, k0 + 8, k0, k0 + 8), columns (n, n, n + 8, n + 8).
template <typename T>
__device__ __forceinline__ void mma_bt(float (&acc)[4][4], const unsigned (&a)[4], const unsigned (&b)[2][4]) {
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
        const unsigned b0[2] = {b[pair][0], b[pair][1]}, b1[2] = {b[pair][2], b[pair][3]};
        Mma<T>::run(acc[2 * pair], a, b0);
        Mma<T>::run(acc[2 * pair + 1], a, b1);
    }
}
__device__ __forceinline__ void frag_b_rows(unsigned (&b)[2][4], const u16* Y, int c0, int k0) {
    const int lane = threadIdx.x % 32, i = lane / 8, rr = lane % 8;
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) ldsm_x4_trans(b[pair], Y + (k0 + rr + 8 * (i % 2)) * TC_P + c0 + 16 * pair + 8 * (i / 2));
}

// O += mask(A) V and, when UPDATE, S += K^T V, from the same V fragments (two loops rather than a
// branch in one, so that the K^T fragments' loads can be scheduled early).
template <typename T, bool UPDATE>
__device__ __forceinline__ void av_and_kv(float (&o)[4][4], float (&s)[4][4], const u16* At, const u16* Ks,
                                          const u16* Vs, int r0, int c0) {
#pragma unroll
    for (int kk = 0; kk < TC_CHUNK; kk += 16) {
        unsigned b[2][4], x[4];
        frag_b_rows(b, Vs, c0, kk);  // V [token][m]
        frag_a_rows(x, At, TC_P, r0, kk);
        mma_bt<T>(o, x, b);
        if (UPDATE) {
            frag_a_cols(x, Ks, r0, kk);
            mma_bt<T>(s, x, b);
        }
    }
}

// Q (unless Qs is null), K (columns 0..TILE of D) and V (columns m0..m0 + TILE of M) of the chunk
// at t0 into one stage [token][x], pitch TC_P, by cp.async: two 16-byte pieces of each tile a thread.
template <bool REV>
__device__ __forceinline__ void stage_chunk(u16* Qs, u16* Ks, u16* Vs, const u16* q, const u16* k, const u16* v,
                                            int t0, int N, int D, int M, int m0) {
    for (int idx = threadIdx.x; idx < TC_CHUNK * TC_TILE / 8; idx += TC_THREADS) {
        const int r = idx / (TC_TILE / 8), c = idx % (TC_TILE / 8) * 8, t = t0 + r, o = r * TC_P + c;
        const long long row = REV ? (long long)(N - 1 - t) : (long long)t;  // read only where t < N
        const bool qk = t < N && c < D, vv = t < N && m0 + c < M;
        if (Qs) cp_async16(Qs + o, qk ? q + row * D + c : q, qk ? 16 : 0);
        cp_async16(Ks + o, qk ? k + row * D + c : k, qk ? 16 : 0);
        cp_async16(Vs + o, vv ? v + row * M + m0 + c : v, vv ? 16 : 0);
    }
}

// The bare product's group states as cdp_group_states_tc<T, REV, false> computes them (slot g + 1
// of `states` gets group g's sum_j k_j v_j^T; grid (BH, n_groups - 1, n_mtiles)), pipelined the
// same way: K and V staged by cp.async, K^T and V by ldmatrix.trans, S in the accumulators.
// smem bytes: 2 (4 CHUNK TC_P) = 36,864.
template <typename T, bool REV>
__global__ void __launch_bounds__(TC_THREADS)
cdp_group_states_tc_staged(const T* __restrict__ k, const T* __restrict__ v, float* __restrict__ states, int N,
                           int D, int M, int cpg, int n_groups) {
    extern __shared__ __align__(16) unsigned char smem_staged[];
    u16* stages = reinterpret_cast<u16*>(smem_staged);  // [2][K, V][token][x]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    const int r0 = (warp % 4) * 16, c0 = (warp / 4) * 32;
    const long long bh = blockIdx.x;
    const int grp = blockIdx.y, m0 = blockIdx.z * TC_TILE;
    const int n_chunks = (N + TC_CHUNK - 1) / TC_CHUNK;
    const int c_begin = grp * cpg, c_end = min(n_chunks, (grp + 1) * cpg);
    const u16* kb = reinterpret_cast<const u16*>(k + bh * N * D);
    const u16* vb = reinterpret_cast<const u16*>(v + bh * N * M);
    if (c_begin < c_end)
        stage_chunk<REV>(nullptr, stages, stages + TC_CHUNK * TC_P, kb, kb, vb, c_begin * TC_CHUNK, N, D, M, m0);
    cp_async_commit();
    float s[4][4] = {};
    for (int chunk = c_begin; chunk < c_end; ++chunk) {
        const u16* Ks = stages + ((chunk - c_begin) & 1) * 2 * TC_CHUNK * TC_P;
        const u16* Vs = Ks + TC_CHUNK * TC_P;
        cp_async_wait_all();
        __syncthreads();  // this chunk's tiles are in, and every warp is done with the other stage
        if (chunk + 1 < c_end) {
            u16* next = stages + ((chunk + 1 - c_begin) & 1) * 2 * TC_CHUNK * TC_P;
            stage_chunk<REV>(nullptr, next, next + TC_CHUNK * TC_P, kb, kb, vb, (chunk + 1) * TC_CHUNK, N, D, M, m0);
            cp_async_commit();
        }
#pragma unroll
        for (int kk = 0; kk < TC_CHUNK; kk += 16) {
            unsigned b[2][4], x[4];
            frag_b_rows(b, Vs, c0, kk);
            frag_a_cols(x, Ks, r0, kk);
            mma_bt<T>(s, x, b);  // S += K^T V
        }
    }
    float* out = states + (bh * n_groups + grp + 1) * (long long)D * M;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int d = r0 + g + 8 * (e / 2), c = m0 + c0 + 8 * nt + 2 * t4 + e % 2;
            if (d < D && c < M) out[(long long)d * M + c] = s[nt][e];
        }
}

// grid (BH, n_groups, n_mtiles) as cdp_chunks_tc; `states` from cdp_group_states(_tc) and
// cdp_scan_states (Mtot = M), or null for one group.
template <typename T, bool REV>
__global__ void __launch_bounds__(TC_THREADS, TCS_MIN_BLOCKS)
cdp_chunks_tc_staged(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const float* __restrict__ states, T* __restrict__ out, int N, int D, int M, int cpg,
                     int n_groups) {
    extern __shared__ __align__(16) unsigned char smem_staged[];
    u16* stages = reinterpret_cast<u16*>(smem_staged);  // [2][Q, K, V][token][x]
    u16* At = stages + 2 * TCS_STAGE;                   // [token][token] masked scores
    u16* St = At + TC_CHUNK * TC_P;                     // [m][d] the state, bf16

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
    const int r0 = (warp % 4) * 16, c0 = (warp / 4) * 32;
    const long long bh = blockIdx.x;
    const int grp = blockIdx.y, m0 = blockIdx.z * TC_TILE;
    const int n_chunks = (N + TC_CHUNK - 1) / TC_CHUNK;
    const int c_begin = grp * cpg, c_end = min(n_chunks, (grp + 1) * cpg);
    const u16* qb = reinterpret_cast<const u16*>(q + bh * N * D);
    const u16* kb = reinterpret_cast<const u16*>(k + bh * N * D);
    const u16* vb = reinterpret_cast<const u16*>(v + bh * N * M);
    out += bh * N * M;
    if (c_begin < c_end)
        stage_chunk<REV>(stages, stages + TC_CHUNK * TC_P, stages + 2 * TC_CHUNK * TC_P, qb, kb, vb, c_begin * TC_CHUNK,
                         N, D, M, m0);
    cp_async_commit();

    // S (rows d, columns m) where this lane's accumulators hold it, and its bf16 S^T
    const float* st = states ? states + (bh * n_groups + grp) * (long long)D * M : nullptr;
    float s[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int d = r0 + g + 8 * (e / 2), c = c0 + 8 * nt + 2 * t4 + e % 2;
            s[nt][e] = (st && d < D && m0 + c < M) ? st[(long long)d * M + m0 + c] : 0.f;
            St[c * TC_P + d] = from_f<T>(s[nt][e]).bits;
        }

    for (int chunk = c_begin; chunk < c_end; ++chunk) {
        const int t0 = chunk * TC_CHUNK;
        const u16* Qs = stages + ((chunk - c_begin) & 1) * TCS_STAGE;
        const u16* Ks = Qs + TC_CHUNK * TC_P;
        const u16* Vs = Ks + TC_CHUNK * TC_P;
        cp_async_wait_all();
        // This chunk's tiles and S^T are in, and every warp is done with the other stage and At.
        __syncthreads();
        if (chunk + 1 < c_end) {
            u16* next = stages + ((chunk + 1 - c_begin) & 1) * TCS_STAGE;
            stage_chunk<REV>(next, next + TC_CHUNK * TC_P, next + 2 * TC_CHUNK * TC_P, qb, kb, vb, t0 + TC_CHUNK, N, D,
                             M, m0);
            cp_async_commit();
        }
        float a[4][4] = {}, o[4][4] = {};
#pragma unroll
        for (int kk = 0; kk < TC_TILE; kk += 16) {
            mma_k16<T>(a, Qs, TC_P, Ks, TC_P, r0, c0, kk);  // Q K^T: B^T = K [token][d]
            mma_k16<T>(o, Qs, TC_P, St, TC_P, r0, c0, kk);  // Q S:   B^T = S^T [m][d]
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = r0 + g + 8 * (e / 2), col = c0 + 8 * nt + 2 * t4 + e % 2;
                At[row * TC_P + col] = from_f<T>(col <= row ? a[nt][e] : 0.f).bits;
            }
        __syncthreads();  // At; and every read of S^T is done, so it may be rewritten below
        const bool more = chunk + 1 < c_end;
        if (more)
            av_and_kv<T, true>(o, s, At, Ks, Vs, r0, c0);
        else  // a group's last chunk: its state is not needed
            av_and_kv<T, false>(o, s, At, Ks, Vs, r0, c0);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // rows g and g + 8: two adjacent columns in one 4-byte store
                const int row = r0 + g + 8 * h, col = m0 + c0 + 8 * nt + 2 * t4, t = t0 + row;
                if (t < N && col < M) {  // M % 8 == 0: col + 1 < M too
                    const unsigned pair = (unsigned)from_f<T>(o[nt][2 * h]).bits |
                                          ((unsigned)from_f<T>(o[nt][2 * h + 1]).bits << 16);
                    *reinterpret_cast<unsigned*>(out + (REV ? (long long)(N - 1 - t) : (long long)t) * M + col) = pair;
                }
            }
        if (more)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    St[(c0 + 8 * nt + 2 * t4 + e % 2) * TC_P + r0 + g + 8 * (e / 2)] = from_f<T>(s[nt][e]).bits;
    }
}
