// One step of causal linear attention for every (batch, head) of a layer, in one launch:
//   S += k v^T,  Z += k,  out = (q^T S) / (q . Z + eps)
// S (BH, D, M) and Z (BH, D) are fp32 and updated in place; q, k (BH, D), v (BH, M) and out
// (BH, M) are fp32, bf16 or fp16. grid (BH), block STEP_THREADS; smem floats: 2 D + STEP_THREADS.
// One block owns a (batch, head), so its Z update and the normaliser that reads it are ordered
// by __syncthreads alone. dtypes.cuh is prepended by cuda_build.py.

#define STEP_THREADS 128  // a power of two: the tree reduction below halves it

template <typename T>
__global__ void __launch_bounds__(STEP_THREADS)
linear_step(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
            float* __restrict__ S, float* __restrict__ Z, T* __restrict__ out, int D, int M, float eps) {
    extern __shared__ float smem[];
    float* qs = smem;
    float* ks = qs + D;
    float* red = ks + D;
    const long long bh = blockIdx.x;
    const int tid = threadIdx.x;
    for (int d = tid; d < D; d += STEP_THREADS) {
        qs[d] = to_f(q[bh * D + d]);
        ks[d] = to_f(k[bh * D + d]);
    }
    __syncthreads();
    float part = 0.f;
    for (int d = tid; d < D; d += STEP_THREADS) {
        const float z = Z[bh * D + d] + ks[d];
        Z[bh * D + d] = z;
        part += qs[d] * z;
    }
    red[tid] = part;
    __syncthreads();
    for (int s = STEP_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        __syncthreads();
    }
    const float den = red[0] + eps;
    float* Sb = S + bh * D * (long long)M;
    for (int m = tid; m < M; m += STEP_THREADS) {  // consecutive threads, consecutive columns
        const float vm = to_f(v[bh * M + m]);
        float num = 0.f;
        for (int d = 0; d < D; ++d) {
            const float s = Sb[(long long)d * M + m] + ks[d] * vm;
            Sb[(long long)d * M + m] = s;
            num += qs[d] * s;
        }
        out[bh * M + m] = from_f<T>(num / den);
    }
}
