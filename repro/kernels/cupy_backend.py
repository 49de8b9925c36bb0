"""The CuPy backend: raw CUDA kernels behind torch ops. causal_dot.cu (chunked causal product,
fp32 FMA, every dtype), causal_dot_tc.cu (its bf16 twin on tensor cores), causal_dot_tc_staged.cu
(that twin pipelined, behind STAGED), recurrent_step.cu.

    causal_dot_product(q, k, v)                  the dispatcher's op: sum_{j<=i} (q_i . k_j) v_j
    causal_linear_attention(q, k, v, eps)        the same with the normaliser fused:
                                                 out_i / (q_i . sum_{j<=i} k_j + eps)
    linear_attention_step(q, k, v, S, Z, eps)    one generation step, S and Z updated in place

Each is a torch.library.custom_op with its backward registered, so it runs inside
torch.compile'd models and under autocast (it takes the dtype it is given: fp32, bf16 or fp16
in, fp32 accumulation, the input dtype out). Kernels launch on torch's current stream.
The backward is the paper's cumulative-sum form with no stored per-step states:
    grad q = causal(g, v, k),  grad k = reverse-causal(v, g, q),  grad v = reverse-causal(k, q, g)
where reverse-causal runs the forward kernel backwards in time. Under create_graph (second
derivatives) the same gradients come from the differentiable forward op instead (on flipped
sequences for reverse-causal), so they are differentiable in turn.
"""
import math
from collections import Counter
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from repro.kernels import cuda_build, cuda_grid
from repro.kernels.backend import forced_backend
from repro.kernels.chunked import causal_product_grads
from repro.kernels.cuda_grid import NTHREADS, grid, smem_chunks, smem_chunks_tc, smem_group_states, smem_group_states_tc

# THE SWITCH: True since the GPU kernel tests passed on an NVIDIA H100 80GB HBM3 (88, none skipped,
# commit 239c217; results/gpu/NVIDIA_H100_80GB_HBM3/env/). Verify another GPU with
#     REPRO_KERNEL=cupy python -m pytest -q -rs tests/test_cupy_kernels.py   (reproduce_gpu step 1)
GPU_VERIFIED = True
# Verified is not faster: unforced, an op takes its kernel only in the dtypes where the same H100
# (results/gpu/.../kernels/bench.csv) measured it faster than the chunked torch path, forward and
# forward + backward; the fused normalised kernel only without gradients (its backward is 2.8x
# the product's). fp32 stays on cuBLAS, fp16 and the step were not measured: docs/kernels.md.
FASTER_DTYPES = {"causal_dot_product": (torch.bfloat16,), "causal_linear_attention": (torch.bfloat16,),
                 "linear_attention_step": ()}

# bf16 products on tensor cores (causal_dot_tc.cu); fp32 and fp16 always take the FMA kernel.
TENSOR_CORES = True
# The bare tensor-core product asks only the shared memory it uses (65 KB at D = 64: 3 blocks per
# H100 SM, not 2). Off until an H100 measures it: profile_kernels --parts variants (docs/kernels.md).
BARE_SMEM = False
# The tensor-core kernel loads its Q and K tiles 16 bytes a thread rather than 2 (where D % 8 == 0
# and the tensors are 16-byte aligned). Off until an H100 measures it, as BARE_SMEM.
VEC_LOADS = False
# The bare bf16 product and its group states by causal_dot_tc_staged.cu (the next chunk prefetched
# by cp.async, K and V loaded once and transposed by ldmatrix, S in registers; 3 blocks per H100 SM)
# where D <= 64, D and M are multiples of 8 and q, k, v are 16-byte aligned: the same sums as the
# plain kernel. Off until an H100 measures it, as BARE_SMEM (profile_kernels --parts variants).
STAGED = False

STEP_THREADS = 128  # recurrent_step.cu
KERNEL_DTYPES = {torch.float32: "float", torch.bfloat16: "bf16_t", torch.float16: "f16_t"}

# Tests set this to float("nan") so that any output element a kernel fails to write shows up.
PREFILL = None

# How often each op's CUDA implementation ran (fakes and the torch path never count): the GPU
# tests read it to prove that a layer or a compiled graph really took the CuPy path.
CALLS = Counter()


def _gate_reason(op, dtype, backward=False):
    """Why `op` leaves these inputs to the torch path unless REPRO_KERNEL=cupy, or None."""
    forced, how = forced_backend(), "; set REPRO_KERNEL=cupy to use it"
    if forced:
        return None if forced == "cupy" else f"forced off the CuPy kernels by REPRO_KERNEL={forced}"
    if not GPU_VERIFIED:
        return "the CuPy kernels are compile-checked but not yet verified on a GPU (GPU_VERIFIED is False)" + how
    if dtype in KERNEL_DTYPES and dtype not in FASTER_DTYPES[op]:  # others: _device_reason says why
        return f"{op} in {dtype} was not measured faster than the torch path (FASTER_DTYPES)" + how
    if backward and op == "causal_linear_attention":
        return "the fused normalised kernel's backward is slower than the product's (FASTER_DTYPES)" + how
    return None


def _device_reason(q, dims, what):
    if not q.is_cuda:
        return f"the CuPy backend runs CUDA tensors only (inputs are on {q.device})"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "the CuPy kernels need compute capability 8.0 or newer (bf16 conversions, mma.sync)"
    if q.dtype not in KERNEL_DTYPES:
        return (f"the CuPy kernels take {', '.join(str(t) for t in KERNEL_DTYPES)}; "
                f"{q.dtype} runs on the torch path")
    try:
        import cupy  # noqa: F401
    except ImportError as err:
        return f"CuPy is not importable: {err}"
    # The backward runs the kernel with the roles of D and M swapped, the normalised backward
    # with M + 1 (a column of ones): every key width the kernels will see must fit in smem.
    optin = torch.cuda.get_device_properties(q.device).shared_memory_per_block_optin
    need = smem_chunks(max(dims))
    if need > optin:
        return (f"{what} with head dims {dims} needs {need} bytes of shared memory per block; "
                f"this GPU allows {optin}")
    return None


def unsupported_reason(q, k, v):
    """None when causal_dot_product can take q, k, v, else why not (the dispatcher's hook)."""
    return _gate_reason("causal_dot_product", q.dtype) or _shape_reason(q, v) or _device_reason(
        q, (q.shape[-1], v.shape[-1]),
                                                                   "causal_dot_product")


def linear_attention_unsupported_reason(q, k, v):
    """None when causal_linear_attention can take q, k, v, else why not."""
    if not (q.dtype == k.dtype == v.dtype and q.shape == k.shape and q.shape[:-1] == v.shape[:-1]):
        return "q, k, v must share a dtype and (..., N) with q, k of one shape"
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _gate_reason("causal_linear_attention", q.dtype, backward) or _shape_reason(q, v) or _device_reason(
        q, (q.shape[-1], v.shape[-1] + 1), "causal_linear_attention")


def step_unsupported_reason(q, k, v, S, Z):
    """None when linear_attention_step can take these, else why not."""
    reason = _gate_reason("linear_attention_step", q.dtype) or _device_reason(q, (1,), "linear_attention_step")
    if reason:
        return reason
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
    d, m = q.shape[-1], v.shape[-1]
    if S.shape != (*q.shape, m) or Z.shape != q.shape or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
        return "shapes must be q, k (..., D), v (..., M), S (..., D, M), Z (..., D)"
    if S.dtype != torch.float32 or Z.dtype != torch.float32 or not (S.is_contiguous() and Z.is_contiguous()):
        return f"the state must be contiguous fp32 (got S {S.dtype}, Z {Z.dtype})"
    if 4 * (2 * d + STEP_THREADS) > torch.cuda.get_device_properties(q.device).shared_memory_per_block_optin:
        return f"D={d} is too large for the step kernel's shared memory"
    return None


def _shape_reason(q, v):
    if q.dim() < 2 or q.shape[-2] == 0:
        return f"the kernels need a non-empty sequence; got q {tuple(q.shape)}"
    if math.prod(q.shape[:-2]) >= 2 ** 31:
        return f"batch x heads = {math.prod(q.shape[:-2])} exceeds the kernels' grid"
    return None


# --------------------------------------------------------------------------- launching

def _ptr(t):
    return np.uint64(0 if t is None else t.data_ptr())


class _StreamHandle:
    """A raw cudaStream_t behind the CUDA stream protocol, which CuPy 14's Stream.from_external
    takes (its ExternalStream is deprecated); torch releases before 2.14 lack __cuda_stream__."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return 0, self.handle  # (protocol version, cudaStream_t)


@lru_cache(maxsize=64)  # one wrapper per stream: the host path of a call is most of a short one
def cupy_stream(handle: int):
    """A CuPy stream over the CUDA stream `handle` (0: the legacy default stream)."""
    import cupy
    return cupy.cuda.Stream.from_external(_StreamHandle(handle))


def _stream(device):
    return cupy_stream(torch.cuda.current_stream(device).cuda_stream)


@lru_cache(maxsize=None)
def _kernel(name, device_index, smem):
    source = ("causal_dot_tc_staged.cu" if "_tc_staged<" in name else "causal_dot_tc.cu" if "_tc<" in name else
              "causal_dot.cu" if name.startswith("cdp") else "recurrent_step.cu")
    kern = cuda_build.module(source, device_index).get_function(name)
    if smem > 48 * 1024 and kern.max_dynamic_shared_size_bytes < smem:
        kern.max_dynamic_shared_size_bytes = smem  # opt in beyond the default 48 KiB
    return kern


def _empty(shape, dtype, device):
    if PREFILL is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.full(shape, PREFILL, dtype=dtype, device=device)


def _takes_staged(q, k, v):
    """Whether STAGED is on and the pipelined kernel takes these (BH, N, D|M) bf16 tensors: its
    16-byte copies need D and M multiples of 8 and 16-byte aligned rows, its one key tile D <= 64
    (its 73,728 bytes fit every GPU of compute capability 8.0 or newer)."""
    d, m = q.shape[-1], v.shape[-1]
    return (STAGED and d <= cuda_grid.TILE and d % 8 == 0 and m % 8 == 0
            and all(x.data_ptr() % 16 == 0 for x in (q, k, v)))


def launch(q, k, v, rev=False, norm=False, eps=0.0, cpg=None, tensor_cores=None):
    """The three launches on contiguous (BH, N, D), (BH, N, D), (BH, N, M) tensors of one dtype.
    Returns out (BH, N, M) in that dtype and, when norm, den (BH, N) fp32 (q_i . Z_i).
    `cpg` (chunks per group) is chosen from the GPU's size unless given, and bf16 takes the
    tensor-core kernel when TENSOR_CORES and it fits, unless `tensor_cores` says (tests vary both)."""
    bh, n, d = q.shape
    m, dev = v.shape[-1], q.device
    if bh == 0 or m == 0 or d == 0:  # a zero grid is an invalid launch; the sums are empty or zero
        den = torch.einsum("bnd,bnd->bn", q.float(), k.float().cumsum(1)) if norm else None
        return torch.zeros(bh, n, m, dtype=q.dtype, device=dev), den
    import cupy

    t = KERNEL_DTYPES[q.dtype]
    props = torch.cuda.get_device_properties(dev)
    cpg, n_groups, n_mt = grid(bh, n, m, props.multi_processor_count, cpg)
    mtot = m + 1 if norm else m
    staged_flags = f"{t},{'true' if rev else 'false'}"
    flags = f"{staged_flags},{'true' if norm else 'false'}"
    out = _empty((bh, n, m), q.dtype, dev)
    den = _empty((bh, n), torch.float32, dev) if norm else None
    states = _empty((bh, n_groups, d, mtot), torch.float32, dev) if n_groups > 1 else None
    if tensor_cores is None:
        tensor_cores = TENSOR_CORES and smem_chunks_tc(d, norm or not BARE_SMEM) <= props.shared_memory_per_block_optin
    tensor_cores = tensor_cores and q.dtype == torch.bfloat16
    staged = tensor_cores and not norm and _takes_staged(q, k, v)
    i32 = np.int32
    CALLS["launch"] += 1
    with cupy.cuda.Device(dev.index), _stream(dev):
        tc = "_tc" if tensor_cores else ""
        sizes = (i32(n), i32(d), i32(m), *((i32(mtot),) if not staged else ()), i32(cpg), i32(n_groups))
        if states is not None:
            smem = (cuda_grid.SMEM_STAGED_STATES if staged else smem_group_states_tc(d) if tensor_cores
                    else smem_group_states(d))
            name = f"cdp_group_states_tc_staged<{staged_flags}>" if staged else f"cdp_group_states{tc}<{flags}>"
            _kernel(name, dev.index, smem)((bh, n_groups - 1, n_mt), (NTHREADS,),
                                           (_ptr(k), _ptr(v), _ptr(states), *sizes), shared_mem=smem)
            per_slot = d * mtot
            _kernel("cdp_scan_states", dev.index, 0)(
                (math.ceil(bh * per_slot / 256),), (256,),
                (_ptr(states), np.int64(bh), i32(per_slot), i32(n_groups)))
        if staged:
            CALLS["staged"] += 1
            _kernel(f"cdp_chunks_tc_staged<{staged_flags}>", dev.index, cuda_grid.SMEM_STAGED)(
                (bh, n_groups, n_mt), (NTHREADS,), (_ptr(q), _ptr(k), _ptr(v), _ptr(states), _ptr(out), *sizes),
                shared_mem=cuda_grid.SMEM_STAGED)
            return out, den
        smem = smem_chunks_tc(d, norm or not BARE_SMEM) if tensor_cores else smem_chunks(d)
        args = (_ptr(q), _ptr(k), _ptr(v), _ptr(states), _ptr(out), _ptr(den),
                i32(n), i32(d), i32(m), i32(mtot), i32(cpg), i32(n_groups), np.float32(eps))
        if tensor_cores:  # 16-byte loads of Q and K where every row stays 16-byte aligned
            args += (i32(VEC_LOADS and d % 8 == 0 and q.data_ptr() % 16 == 0 and k.data_ptr() % 16 == 0),)
        _kernel(f"cdp_chunks{tc}<{flags}>", dev.index, smem)((bh, n_groups, n_mt), (NTHREADS,), args, shared_mem=smem)
    return out, den


def _flat(x):
    """(..., N, X) -> contiguous (BH, N, X); BH spelled out, since -1 is ambiguous at 0 elements."""
    return x.reshape(math.prod(x.shape[:-2]), *x.shape[-2:]).contiguous()


def _contiguous_like(x):
    """The fakes' outputs: the real ops return fresh contiguous tensors whatever the inputs'
    strides (v often reaches them as a transposed view), and a fake must say the same, or
    inductor's assert_size_stride fails in a compiled backward."""
    return x.new_empty(x.shape)


# --------------------------------------------------------------------------- causal_dot_product

@torch.library.custom_op("repro::causal_dot_product", mutates_args=(), device_types="cuda")
def _cdp(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    CALLS["causal_dot_product"] += 1
    out, _ = launch(_flat(q), _flat(k), _flat(v))
    return out.view(*q.shape[:-1], v.shape[-1])


@_cdp.register_fake
def _(q, k, v):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("repro::causal_dot_product_backward", mutates_args=(), device_types="cuda")
def cdp_backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    CALLS["causal_dot_product_backward"] += 1
    q3, k3, v3, g3 = _flat(q), _flat(k), _flat(v), _flat(g.to(q.dtype))
    grad_q, _ = launch(g3, v3, k3)  # sum_{j<=i} (g_i . v_j) k_j
    grad_k, _ = launch(v3, g3, q3, rev=True)  # sum_{j>=i} (v_i . g_j) q_j
    grad_v, _ = launch(k3, q3, g3, rev=True)  # sum_{j>=i} (k_i . q_j) g_j
    return grad_q.view(q.shape), grad_k.view(k.shape), grad_v.view(v.shape)


@cdp_backward.register_fake
def _(q, k, v, g):
    return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v)


def _cdp_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _cdp_grad(ctx, g):
    if torch.is_grad_enabled():  # create_graph: the gradients by the differentiable forward op
        q, k, v = ctx.saved_tensors
        return causal_product_grads(_cdp, q, k, v, g.to(q.dtype), ctx.needs_input_grad)
    return cdp_backward(*ctx.saved_tensors, g)


_cdp.register_autograd(_cdp_grad, setup_context=_cdp_setup)


def causal_dot_product(q, k, v):
    """(..., N, D), (..., N, D), (..., N, M) -> (..., N, M); the dispatcher checks inputs."""
    return _cdp(q, k, v)


# --------------------------------------------------------------------------- fused normaliser

@torch.library.custom_op("repro::causal_linear_attention", mutates_args=(), device_types="cuda")
def _cla(q: Tensor, k: Tensor, v: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    CALLS["causal_linear_attention"] += 1
    out, den = launch(_flat(q), _flat(k), _flat(v), norm=True, eps=eps)
    return out.view(*q.shape[:-1], v.shape[-1]), den.view(q.shape[:-1])


@_cla.register_fake
def _(q, k, v, eps):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("repro::causal_linear_attention_backward", mutates_args=(), device_types="cuda")
def _cla_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, den: Tensor, g: Tensor,
                  g_den: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    # y = num / e with e = den + eps: dL/dnum = g / e, dL/dden = -(g . y) / e. Then num and den
    # are one causal product against [v, 1], so the gradients are the plain backward's with
    # V' = [v, 1] and G' = [dL/dnum, dL/dden]; all in fp32 (den's gradient needs the precision).
    CALLS["causal_linear_attention_backward"] += 1
    e = den.float() + eps  # (..., N)
    g32 = g.float()
    g_num = g32 / e[..., None]  # (..., N, M)
    g_d = -(g32 * out.float()).sum(-1) / e
    if g_den is not None:
        g_d = g_d + g_den.float()
    v1 = _flat(torch.cat([v.float(), v.new_ones(*v.shape[:-1], 1, dtype=torch.float32)], -1))
    g1 = _flat(torch.cat([g_num, g_d[..., None]], -1))
    q3, k3 = _flat(q.float()), _flat(k.float())
    grad_q, _ = launch(g1, v1, k3)
    grad_k, _ = launch(v1, g1, q3, rev=True)
    grad_v, _ = launch(k3, q3, _flat(g_num), rev=True)
    return (grad_q.view(q.shape).to(q.dtype), grad_k.view(k.shape).to(k.dtype),
            grad_v.view(v.shape).to(v.dtype))


@_cla_backward.register_fake
def _(q, k, v, out, den, g, g_den, eps):
    return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v)


def _cla_setup(ctx, inputs, output):
    q, k, v, eps = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.eps = eps


def cla_grads(product, q, k, v, out, den, g, g_den, eps, need=(True, True, True)):
    """_cla_backward's gradients by differentiable ops, the causal products by `product` (_cdp
    here, the torch path in the CPU tests): second derivatives. out and den, saved outputs of
    _cla, carry its graph; their gradients come back to _cla_grad as g and g_den."""
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32, as _cla_backward (fp64 in the tests)
    e = den.to(acc) + eps  # (..., N)
    g_num = g.to(acc) / e[..., None]  # (..., N, M)
    g_d = -(g.to(acc) * out.to(acc)).sum(-1) / e
    if g_den is not None:
        g_d = g_d + g_den.to(acc)
    v1 = torch.cat([v.to(acc), v.new_ones(*v.shape[:-1], 1, dtype=acc)], -1)  # (..., N, M + 1)
    grad_q, grad_k, grad_v1 = causal_product_grads(product, q.to(acc), k.to(acc), v1,
                                                   torch.cat([g_num, g_d[..., None]], -1), need)
    grads = grad_q, grad_k, None if grad_v1 is None else grad_v1[..., :-1]  # v's part of [v, 1]
    return tuple(None if gr is None else gr.to(x.dtype) for gr, x in zip(grads, (q, k, v)))


def _cla_grad(ctx, g, g_den):
    q, k, v, out, den = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable ops, the products by the forward op
        return (*cla_grads(_cdp, q, k, v, out, den, g, g_den, ctx.eps, ctx.needs_input_grad), None)
    return (*_cla_backward(q, k, v, out, den, g, g_den, ctx.eps), None)


_cla.register_autograd(_cla_grad, setup_context=_cla_setup)


def causal_linear_attention(q, k, v, eps: float):
    """phi(q), phi(k) (..., N, F), v (..., N, M) -> (..., N, M): the causal linear attention
    sum_{j<=i} (q_i . k_j) v_j / (q_i . sum_{j<=i} k_j + eps), numerator and normaliser in one
    pass. Check linear_attention_unsupported_reason first."""
    return _cla(q, k, v, float(eps))[0]


# --------------------------------------------------------------------------- the recurrent step
# One generation step of causal linear attention (recurrent_step.cu) for every sequence and head
# of a layer in one launch.

@torch.library.custom_op("repro::linear_attention_step", mutates_args=("S", "Z"), device_types="cuda")
def _step(q: Tensor, k: Tensor, v: Tensor, S: Tensor, Z: Tensor, eps: float) -> Tensor:
    import cupy

    CALLS["linear_attention_step"] += 1
    d, m = q.shape[-1], v.shape[-1]
    bh = math.prod(q.shape[:-1])
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = _empty(v.shape, v.dtype, v.device)
    if bh == 0 or m == 0:  # a zero grid is an invalid launch; Z still takes k
        Z += k.float()
        return out.zero_()
    smem = 4 * (2 * d + STEP_THREADS)
    with cupy.cuda.Device(q.device.index), _stream(q.device):
        _kernel(f"linear_step<{KERNEL_DTYPES[q.dtype]}>", q.device.index, smem)(
            (bh,), (STEP_THREADS,),
            (*map(_ptr, (q, k, v, S, Z, out)), np.int32(d), np.int32(m), np.float32(eps)),
            shared_mem=smem)
    return out


@_step.register_fake
def _(q, k, v, S, Z, eps):
    return v.new_empty(v.shape)  # contiguous whatever v's strides, as the op returns (_contiguous_like)


def linear_attention_step(q, k, v, S, Z, eps: float):
    """q, k (..., D), v (..., M); S (..., D, M), Z (..., D) contiguous fp32, updated in place:
    S += k v^T, Z += k; returns (q^T S) / (q . Z + eps) (..., M) in v's dtype. One launch for
    every (batch, head). Check step_unsupported_reason first."""
    return _step(q, k, v, S, Z, float(eps))
