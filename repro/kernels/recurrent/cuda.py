"""The recurrent step's CuPy backend: one generation step of causal linear attention
(recurrent_step.cu) for every sequence and head of a layer in one launch, behind a torch op.

    linear_attention_step(q, k, v, S, Z, eps)    S += k v^T, Z += k in place; (q^T S) / (q . Z + eps)
"""
import math

import numpy as np
import torch
from torch import Tensor

from repro.kernels.plumbing.cupy_launch import (
    CALLS,
    KERNEL_DTYPES,
    device_reason,
    empty,
    gate_reason,
    kernel,
    ptr,
    stream,
)

SOURCE = "recurrent/recurrent_step.cu"
STEP_THREADS = 128  # recurrent_step.cu


def unsupported_reason(q, k, v, S, Z):
    """None when linear_attention_step can take these, else why not."""
    reason = gate_reason("linear_attention_step", q.dtype) or device_reason(q, (1,), "linear_attention_step")
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


@torch.library.custom_op("repro::linear_attention_step", mutates_args=("S", "Z"), device_types="cuda")
def _step(q: Tensor, k: Tensor, v: Tensor, S: Tensor, Z: Tensor, eps: float) -> Tensor:
    import cupy

    CALLS["linear_attention_step"] += 1
    d, m = q.shape[-1], v.shape[-1]
    bh = math.prod(q.shape[:-1])
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = empty(v.shape, v.dtype, v.device)
    if bh == 0 or m == 0:  # a zero grid is an invalid launch; Z still takes k
        Z += k.float()
        return out.zero_()
    smem = 4 * (2 * d + STEP_THREADS)
    with cupy.cuda.Device(q.device.index), stream(q.device):
        kernel(SOURCE, f"linear_step<{KERNEL_DTYPES[q.dtype]}>", q.device.index, smem)(
            (bh,), (STEP_THREADS,),
            (*map(ptr, (q, k, v, S, Z, out)), np.int32(d), np.int32(m), np.float32(eps)),
            shared_mem=smem)
    return out


@_step.register_fake
def _(q, k, v, S, Z, eps):
    return v.new_empty(v.shape)  # contiguous whatever v's strides, as the op returns (contiguous_like)


def linear_attention_step(q, k, v, S, Z, eps: float):
    """q, k (..., D), v (..., M); S (..., D, M), Z (..., D) contiguous fp32, updated in place:
    S += k v^T, Z += k; returns (q^T S) / (q . Z + eps) (..., M) in v's dtype. One launch for
    every (batch, head). Check unsupported_reason first."""
    return _step(q, k, v, S, Z, float(eps))
