// Chunked causal dot product on the GPU: out_i = sum_{j<=i} (q_i . k_j) v_j.
//
// The sequence is cut into chunks of C tokens and the chunks into groups of `cpg` chunks.
// Three launches, parallel over (batch*head, group, value tile of 64 columns):
//   cdp_group_states  each group's total sum_j k_j v_j^T (and sum_j k_j for the normaliser),
//                     written to slot g + 1 of a (BH, n_groups, D, Mtot) fp32 buffer;
//   cdp_scan_states   a running sum over the slots, so slot g holds the state before group g;
//   cdp_chunks        per group, starting from its state: for each chunk,
//                     out = Q S + mask(Q K^T) V, then S += K^T V.
// REV runs the same recursion backwards in time (logical token t is physical token N-1-t),
// which is the reverse scan of the backward pass (grad k, grad v). NORM also carries
// Z = sum_j k_j and writes out_i / (q_i . Z_i + eps): the whole causal linear attention.
// All arithmetic is fp32 FMA; inputs are fp32, bf16 or fp16 and outputs have the input type.
//
// plumbing/dtypes.cuh (bf16_t, f16_t, to_f, from_f) is prepended by plumbing/cuda_build.py.

// Tile geometry, mirrored in cupy_backend.py (shared memory sizes) and emulate.py.
#define CHUNK 64     // tokens per chunk
#define TILE 64      // value columns per block, key dims per pass over D
#define PITCH 65     // smem row pitch of (CHUNK, TILE) tiles: +1 keeps column walks off one bank
#define NTHREADS 256 // a 16 x 16 thread grid; thread (ty, tx) owns rows ty+16i, columns tx+16j

// dst[r][c] = src[row(t0 + r)][c0 + c] as fp32, zero outside (N, ncols): padded tokens add
// nothing to any sum, padded key dims nothing to any dot product.
template <typename T, bool REV>
__device__ __forceinline__ void load_tile(float* dst, const T* src, int t0, int N, int ld, int c0) {
    for (int idx = threadIdx.x; idx < CHUNK * TILE; idx += NTHREADS) {
        const int r = idx / TILE, c = idx % TILE;  // c fastest: coalesced along a row
        const int t = t0 + r, col = c0 + c;
        float x = 0.f;
        if (t < N && col < ld) {
            const long long row = REV ? (long long)(N - 1 - t) : (long long)t;
            x = to_f(src[row * ld + col]);
        }
        dst[r * PITCH + c] = x;
    }
}

// Ss[d][c] += sum_t Ks[t][d] Vs[t][c] for the 64 key dims d0.. of this K tile (S has D rows,
// TILE columns); Zs[d] += sum_t Ks[t][d] when NORM. Caller syncs before and after.
template <bool NORM>
__device__ __forceinline__ void update_state(float* Ss, float* Zs, const float* Ks, const float* Vs,
                                             int d0, int D) {
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    float su[4][4] = {};
    for (int t = 0; t < CHUNK; ++t) {
        float kd[4], vc[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) kd[i] = Ks[t * PITCH + ty + 16 * i];
#pragma unroll
        for (int j = 0; j < 4; ++j) vc[j] = Vs[t * PITCH + tx + 16 * j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) su[i][j] += kd[i] * vc[j];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int d = d0 + ty + 16 * i;
        if (d < D)
#pragma unroll
            for (int j = 0; j < 4; ++j) Ss[d * TILE + tx + 16 * j] += su[i][j];
    }
    if (NORM && threadIdx.x < TILE && d0 + threadIdx.x < D) {
        float z = 0.f;
        for (int t = 0; t < CHUNK; ++t) z += Ks[t * PITCH + threadIdx.x];
        Zs[d0 + threadIdx.x] += z;
    }
}

// grid (BH, n_groups - 1, n_mtiles). Slot g + 1 of `states` gets group g's total.
// smem floats: D * TILE (S) + D (Z) + 2 * CHUNK * PITCH (K, V).
template <typename T, bool REV, bool NORM>
__global__ void __launch_bounds__(NTHREADS)
cdp_group_states(const T* __restrict__ k, const T* __restrict__ v, float* __restrict__ states,
                 int N, int D, int M, int Mtot, int cpg, int n_groups) {
    extern __shared__ float smem[];
    float* Ss = smem;
    float* Zs = Ss + D * TILE;
    float* Ks = Zs + D;
    float* Vs = Ks + CHUNK * PITCH;
    const long long bh = blockIdx.x;
    const int g = blockIdx.y, m0 = blockIdx.z * TILE;
    const int n_chunks = (N + CHUNK - 1) / CHUNK;
    k += bh * N * D;
    v += bh * N * M;
    for (int i = threadIdx.x; i < D * TILE; i += NTHREADS) Ss[i] = 0.f;
    for (int i = threadIdx.x; i < D; i += NTHREADS) Zs[i] = 0.f;
    __syncthreads();
    const int c_end = min(n_chunks, (g + 1) * cpg);
    for (int chunk = g * cpg; chunk < c_end; ++chunk) {
        const int t0 = chunk * CHUNK;
        load_tile<T, REV>(Vs, v, t0, N, M, m0);
        for (int d0 = 0; d0 < D; d0 += TILE) {
            load_tile<T, REV>(Ks, k, t0, N, D, d0);
            __syncthreads();
            update_state<NORM>(Ss, Zs, Ks, Vs, d0, D);
            __syncthreads();
        }
    }
    float* out = states + (bh * n_groups + g + 1) * (long long)D * Mtot;
    for (int i = threadIdx.x; i < D * TILE; i += NTHREADS) {
        const int d = i / TILE, c = i % TILE;
        if (m0 + c < M) out[(long long)d * Mtot + m0 + c] = Ss[i];
    }
    if (NORM && blockIdx.z == 0)
        for (int d = threadIdx.x; d < D; d += NTHREADS) out[(long long)d * Mtot + M] = Zs[d];
}

// One thread per (bh, d, column): slot 0 becomes zero, slot g the sum of the group totals
// before g (slots 1.. hold totals of groups 0.. on entry).
__global__ void cdp_scan_states(float* __restrict__ states, long long n_bh, int per_slot, int n_groups) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_bh * per_slot) return;
    const long long bh = idx / per_slot, e = idx % per_slot;
    float* p = states + bh * n_groups * (long long)per_slot + e;
    float run = 0.f;
    p[0] = 0.f;
    for (int g = 1; g < n_groups; ++g) {
        run += p[(long long)g * per_slot];
        p[(long long)g * per_slot] = run;
    }
}

// grid (BH, n_groups, n_mtiles). states: (BH, n_groups, D, Mtot) from the scan, or null for a
// single group. den_out (BH, N) fp32 gets q_i . Z_i when NORM (blockIdx.z == 0 writes it).
// smem floats: D * TILE (S) + D (Z) + 4 * CHUNK * PITCH (Q, K, V, A) + CHUNK (den).
template <typename T, bool REV, bool NORM>
__global__ void __launch_bounds__(NTHREADS)
cdp_chunks(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
           const float* __restrict__ states, T* __restrict__ out, float* __restrict__ den_out,
           int N, int D, int M, int Mtot, int cpg, int n_groups, float eps) {
    extern __shared__ float smem[];
    float* Ss = smem;
    float* Zs = Ss + D * TILE;
    float* Qs = Zs + D;
    float* Ks = Qs + CHUNK * PITCH;
    float* Vs = Ks + CHUNK * PITCH;
    float* As = Vs + CHUNK * PITCH;
    float* dens = As + CHUNK * PITCH;
    const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
    const long long bh = blockIdx.x;
    const int g = blockIdx.y, m0 = blockIdx.z * TILE;
    const int n_chunks = (N + CHUNK - 1) / CHUNK;
    q += bh * N * D;
    k += bh * N * D;
    v += bh * N * M;
    out += bh * N * M;

    const float* st = states ? states + (bh * n_groups + g) * (long long)D * Mtot : nullptr;
    for (int i = tid; i < D * TILE; i += NTHREADS) {
        const int d = i / TILE, c = i % TILE;
        Ss[i] = (st && m0 + c < M) ? st[(long long)d * Mtot + m0 + c] : 0.f;
    }
    for (int d = tid; d < D; d += NTHREADS) Zs[d] = (NORM && st) ? st[(long long)d * Mtot + M] : 0.f;
    __syncthreads();

    const int c_end = min(n_chunks, (g + 1) * cpg);
    for (int chunk = g * cpg; chunk < c_end; ++chunk) {
        const int t0 = chunk * CHUNK;
        float a[4][4] = {}, o[4][4] = {};
        float qz = 0.f;  // thread tid < CHUNK: q_{t0+tid} . Z (the state part of the normaliser)
        for (int d0 = 0; d0 < D; d0 += TILE) {
            load_tile<T, REV>(Qs, q, t0, N, D, d0);
            load_tile<T, REV>(Ks, k, t0, N, D, d0);
            __syncthreads();
            const int dw = min(TILE, D - d0);
            for (int kk = 0; kk < dw; ++kk) {
                float qa[4], kb[4], sb[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) qa[i] = Qs[(ty + 16 * i) * PITCH + kk];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    kb[j] = Ks[(tx + 16 * j) * PITCH + kk];
                    sb[j] = Ss[(d0 + kk) * TILE + tx + 16 * j];
                }
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        a[i][j] += qa[i] * kb[j];  // scores within the chunk
                        o[i][j] += qa[i] * sb[j];  // the past chunks, through the state
                    }
            }
            if (NORM && tid < CHUNK)
                for (int kk = 0; kk < dw; ++kk) qz += Qs[tid * PITCH + kk] * Zs[d0 + kk];
            __syncthreads();  // Qs, Ks are overwritten next
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int r = ty + 16 * i, c = tx + 16 * j;
                As[r * PITCH + c] = c <= r ? a[i][j] : 0.f;  // causal within the chunk
            }
        load_tile<T, REV>(Vs, v, t0, N, M, m0);
        __syncthreads();
        if (NORM && tid < CHUNK) {
            float s = qz;
            for (int j = 0; j <= tid; ++j) s += As[tid * PITCH + j];
            dens[tid] = s;
        }
        for (int kk = 0; kk < CHUNK; ++kk) {
            float av[4], vb[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) av[i] = As[(ty + 16 * i) * PITCH + kk];
#pragma unroll
            for (int j = 0; j < 4; ++j) vb[j] = Vs[kk * PITCH + tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) o[i][j] += av[i] * vb[j];
        }
        if (NORM) __syncthreads();  // dens
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = ty + 16 * i, t = t0 + r;
            if (t >= N) continue;
            const long long row = REV ? (long long)(N - 1 - t) : (long long)t;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int col = m0 + tx + 16 * j;
                if (col < M) {
                    float x = o[i][j];
                    if (NORM) x /= dens[r] + eps;
                    out[row * M + col] = from_f<T>(x);
                }
            }
        }
        if (NORM && den_out && blockIdx.z == 0 && tid < CHUNK && t0 + tid < N) {
            const int t = t0 + tid;
            den_out[bh * N + (REV ? N - 1 - t : t)] = dens[tid];
        }
        if (chunk + 1 < c_end) {  // carry this chunk into the state for the next one
            for (int d0 = 0; d0 < D; d0 += TILE) {
                load_tile<T, REV>(Ks, k, t0, N, D, d0);
                __syncthreads();
                update_state<NORM>(Ss, Zs, Ks, Vs, d0, D);
                __syncthreads();
            }
        } else {
            __syncthreads();  // nothing follows in this block, but keep the phases uniform
        }
    }
}
