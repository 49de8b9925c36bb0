"""The causal product's CuPy backend: raw CUDA kernels behind torch ops. causal_dot.cu (the
chunked causal product, fp32 FMA, every dtype; with the normaliser fused for
repro.kernels.normalised.cuda), causal_dot_tc.cu (its bf16 twin on tensor cores),
causal_dot_tc_staged.cu (that twin pipelined, behind the switch staged).

    causal_dot_product(q, k, v)                  the dispatcher's op: sum_{j<=i} (q_i . k_j) v_j
    cdp_backward(q, k, v, g)                     its gradients, outside autograd
    launch(q, k, v, rev, norm, eps, ...)         the kernels' three launches, for every op made of them

The op is a torch.library.custom_op with its backward registered, so it runs inside
torch.compile'd models and under autocast (it takes the dtype it is given: fp32, bf16 or fp16
in, fp32 accumulation, the input dtype out). Kernels launch on torch's current stream; the
variant a launch takes is the switches' (repro.kernels.plumbing.switches).
The backward is the paper's cumulative-sum form with no stored per-step states:
    grad q = causal(g, v, k),  grad k = reverse-causal(v, g, q),  grad v = reverse-causal(k, q, g)
where reverse-causal runs the forward kernel backwards in time. Under create_graph (second
derivatives) the same gradients come from the differentiable forward op instead (on flipped
sequences for reverse-causal), so they are differentiable in turn.
"""
import math

import numpy as np
import torch
from torch import Tensor

from repro.kernels.causal_product.chunked import causal_product_grads
from repro.kernels.plumbing import cuda_grid, switches
from repro.kernels.plumbing.cuda_grid import (
    NTHREADS,
    grid,
    smem_chunks,
    smem_chunks_tc,
    smem_group_states,
    smem_group_states_tc,
)
from repro.kernels.plumbing.cupy_launch import (
    CALLS,
    KERNEL_DTYPES,
    contiguous_like,
    device_reason,
    empty,
    flat,
    gate_reason,
    kernel,
    ptr,
    shape_reason,
    stream,
)

SOURCES = ("causal_product/causal_dot.cu", "causal_product/causal_dot_tc.cu",
           "causal_product/causal_dot_tc_staged.cu")  # FMA, tensor cores, tensor cores staged


def unsupported_reason(q, k, v):
    """None when causal_dot_product can take q, k, v, else why not (the dispatcher's hook)."""
    return gate_reason("causal_dot_product", q.dtype) or shape_reason(q, v) or device_reason(
        q, (q.shape[-1], v.shape[-1]), "causal_dot_product")


def _kernel(name, device_index, smem):
    source = SOURCES[2] if "_tc_staged<" in name else SOURCES[1] if "_tc<" in name else SOURCES[0]
    return kernel(source, name, device_index, smem)


def _takes_staged(q, k, v, on):
    """Whether the switch staged is `on` and the pipelined kernel takes these (BH, N, D|M) bf16
    tensors: its 16-byte copies need D and M multiples of 8 and 16-byte aligned rows, its one key
    tile D <= 64 (its 73,728 bytes fit every GPU of compute capability 8.0 or newer)."""
    d, m = q.shape[-1], v.shape[-1]
    return (on and d <= cuda_grid.TILE and d % 8 == 0 and m % 8 == 0
            and all(x.data_ptr() % 16 == 0 for x in (q, k, v)))


def plan(q, k, v, norm, smem_optin, tensor_cores=None):
    """(kernel, its chunk kernel's shared memory in bytes, 16-byte loads) that a launch on these
    (BH, N, D|M) tensors takes under the switches: kernel "staged" (causal_dot_tc_staged.cu),
    "tensor_cores" (causal_dot_tc.cu) or "fma" (causal_dot.cu). bf16 takes the tensor cores when
    the switch tensor_cores is on and the kernel fits the GPU's `smem_optin` bytes, unless
    `tensor_cores` says."""
    on, d = switches.current(), q.shape[-1]
    if tensor_cores is None:
        tensor_cores = on.tensor_cores and smem_chunks_tc(d, norm or not on.bare_smem) <= smem_optin
    if not (tensor_cores and q.dtype == torch.bfloat16):
        return "fma", smem_chunks(d), False
    if not norm and _takes_staged(q, k, v, on.staged):
        return "staged", cuda_grid.SMEM_STAGED, False
    vec = on.vec_loads and d % 8 == 0 and q.data_ptr() % 16 == 0 and k.data_ptr() % 16 == 0  # rows stay aligned
    return "tensor_cores", smem_chunks_tc(d, norm or not on.bare_smem), vec


def launch(q, k, v, rev=False, norm=False, eps=0.0, cpg=None, tensor_cores=None):
    """The three launches on contiguous (BH, N, D), (BH, N, D), (BH, N, M) tensors of one dtype.
    Returns out (BH, N, M) in that dtype and, when norm, den (BH, N) fp32 (q_i . Z_i).
    `cpg` (chunks per group) is chosen from the GPU's size unless given, and bf16 takes the
    tensor-core kernel when the switch tensor_cores is on and it fits, unless `tensor_cores`
    says (tests vary both)."""
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
    out = empty((bh, n, m), q.dtype, dev)
    den = empty((bh, n), torch.float32, dev) if norm else None
    states = empty((bh, n_groups, d, mtot), torch.float32, dev) if n_groups > 1 else None
    kind, smem_chunk, vec = plan(q, k, v, norm, props.shared_memory_per_block_optin, tensor_cores)
    tensor_cores, staged = kind != "fma", kind == "staged"
    i32 = np.int32
    CALLS["launch"] += 1
    with cupy.cuda.Device(dev.index), stream(dev):
        tc = "_tc" if tensor_cores else ""
        sizes = (i32(n), i32(d), i32(m), *((i32(mtot),) if not staged else ()), i32(cpg), i32(n_groups))
        if states is not None:
            smem = (cuda_grid.SMEM_STAGED_STATES if staged else smem_group_states_tc(d) if tensor_cores
                    else smem_group_states(d))
            name = f"cdp_group_states_tc_staged<{staged_flags}>" if staged else f"cdp_group_states{tc}<{flags}>"
            _kernel(name, dev.index, smem)((bh, n_groups - 1, n_mt), (NTHREADS,),
                                           (ptr(k), ptr(v), ptr(states), *sizes), shared_mem=smem)
            per_slot = d * mtot
            _kernel("cdp_scan_states", dev.index, 0)(
                (math.ceil(bh * per_slot / 256),), (256,),
                (ptr(states), np.int64(bh), i32(per_slot), i32(n_groups)))
        if staged:
            CALLS["staged"] += 1
            _kernel(f"cdp_chunks_tc_staged<{staged_flags}>", dev.index, smem_chunk)(
                (bh, n_groups, n_mt), (NTHREADS,), (ptr(q), ptr(k), ptr(v), ptr(states), ptr(out), *sizes),
                shared_mem=smem_chunk)
            return out, den
        args = (ptr(q), ptr(k), ptr(v), ptr(states), ptr(out), ptr(den),
                i32(n), i32(d), i32(m), i32(mtot), i32(cpg), i32(n_groups), np.float32(eps))
        if tensor_cores:  # 16-byte loads of Q and K where every row stays 16-byte aligned
            args += (i32(vec),)
        _kernel(f"cdp_chunks{tc}<{flags}>", dev.index, smem_chunk)((bh, n_groups, n_mt), (NTHREADS,), args,
                                                                shared_mem=smem_chunk)
    return out, den


# --------------------------------------------------------------------------- causal_dot_product

@torch.library.custom_op("repro::causal_dot_product", mutates_args=(), device_types="cuda")
def _cdp(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    CALLS["causal_dot_product"] += 1
    out, _ = launch(flat(q), flat(k), flat(v))
    return out.view(*q.shape[:-1], v.shape[-1])


@_cdp.register_fake
def _(q, k, v):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("repro::causal_dot_product_backward", mutates_args=(), device_types="cuda")
def cdp_backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    CALLS["causal_dot_product_backward"] += 1
    q3, k3, v3, g3 = flat(q), flat(k), flat(v), flat(g.to(q.dtype))
    grad_q, _ = launch(g3, v3, k3)  # sum_{j<=i} (g_i . v_j) k_j
    grad_k, _ = launch(v3, g3, q3, rev=True)  # sum_{j>=i} (v_i . g_j) q_j
    grad_v, _ = launch(k3, q3, g3, rev=True)  # sum_{j>=i} (k_i . q_j) g_j
    return grad_q.view(q.shape), grad_k.view(k.shape), grad_v.view(v.shape)


@cdp_backward.register_fake
def _(q, k, v, g):
    return contiguous_like(q), contiguous_like(k), contiguous_like(v)


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
