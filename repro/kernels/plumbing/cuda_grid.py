"""The CUDA kernels' launch geometry: tile sizes (as causal_dot.cu and causal_dot_tc.cu define
them), shared memory per block, and the grid of a launch (chunks per group, groups, value
tiles). Plain arithmetic, no CUDA: repro.kernels.causal_product.cuda launches with it, and the tests
and the profiler read it on any machine."""
import math

CHUNK, TILE, PITCH, NTHREADS = 64, 64, 65, 256  # causal_dot.cu's tile geometry
TC_P, TC_SP = 72, 72  # causal_dot_tc.cu's tile pitches

GRID_YZ_MAX = 65535  # CUDA's limit on gridDim.y and gridDim.z


def smem_chunks(d):
    return 4 * (d * TILE + d + 4 * CHUNK * PITCH + CHUNK)


def smem_chunks_tc(d, norm=True):
    """The tensor-core chunk kernel's bytes; its fp32 scores tile only with the normaliser (the
    bare product at D = 64: 65,024 bytes, 3 blocks per H100 SM, where 83,456 fit 2)."""
    dp = math.ceil(d / TILE) * TILE
    return 4 * (dp * TC_SP + (CHUNK * TC_SP if norm else 0) + dp + CHUNK) + 2 * (4 * CHUNK * TC_P + TILE * (dp + 8))


# causal_dot_tc_staged.cu's bytes (D <= 64, all 16-bit tiles): the chunk kernel's two stages of Q, K,
# V, the masked scores and S^T, 73,728 (3 blocks per H100 SM); the group states' two stages of K, V.
SMEM_STAGED = 2 * 8 * CHUNK * TC_P
SMEM_STAGED_STATES = 2 * 4 * CHUNK * TC_P


def smem_group_states_tc(d):
    dp = math.ceil(d / TILE) * TILE
    return 4 * (dp * TC_SP + dp) + 2 * (2 * CHUNK * TC_P)


def smem_group_states(d):
    return 4 * (d * TILE + d + 2 * CHUNK * PITCH)


MAX_CPG = 8  # measured on the H100: docs/kernels.md, "Chunks per group"


def chunks_per_group(blocks_per_group, n_chunks, n_sms):
    """Chunks each block walks in sequence: enough groups for ~4 blocks per SM, and at most
    MAX_CPG, so a long sequence fills many waves (an extra group costs a (D, M) state)."""
    n_groups = max(1, min(n_chunks, math.ceil(4 * n_sms / blocks_per_group)))
    return min(math.ceil(n_chunks / n_groups), MAX_CPG)


def grid(bh, n, m, n_sms, cpg=None):
    """(cpg, n_groups, n_mt) of a launch on (BH, N, .) x (., M): chunks per group (from the GPU's
    size unless given), groups (gridDim.y) and value tiles (gridDim.z). A given cpg is raised
    where it would need more than 65535 groups: gridDim.y cannot hold them."""
    n_chunks, n_mt = math.ceil(n / CHUNK), math.ceil(m / TILE)
    cpg = max(cpg or chunks_per_group(bh * n_mt, n_chunks, n_sms), math.ceil(n_chunks / GRID_YZ_MAX))
    return cpg, math.ceil(n_chunks / cpg), n_mt
