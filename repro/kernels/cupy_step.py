"""The CuPy backend's recurrent step (recurrent_step.cu): one generation step of causal linear
attention for every sequence and head of a layer in one launch. Part of repro.kernels.cupy_backend,
which imports it (its checks, step_unsupported_reason, and its launch helpers live there)."""
import math

import numpy as np
import torch
from torch import Tensor


@torch.library.custom_op("repro::linear_attention_step", mutates_args=("S", "Z"), device_types="cuda")
def _step(q: Tensor, k: Tensor, v: Tensor, S: Tensor, Z: Tensor, eps: float) -> Tensor:
    import cupy

    from repro.kernels import cupy_backend as cb  # not at the top: cupy_backend imports this module

    cb.CALLS["linear_attention_step"] += 1
    d, m = q.shape[-1], v.shape[-1]
    bh = math.prod(q.shape[:-1])
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = cb._empty(v.shape, v.dtype, v.device)
    if bh == 0 or m == 0:  # a zero grid is an invalid launch; Z still takes k
        Z += k.float()
        return out.zero_()
    smem = 4 * (2 * d + cb.STEP_THREADS)
    with cupy.cuda.Device(q.device.index), cb._stream(q.device):
        cb._kernel(f"linear_step<{cb.KERNEL_DTYPES[q.dtype]}>", q.device.index, smem)(
            (bh,), (cb.STEP_THREADS,),
            (*map(cb._ptr, (q, k, v, S, Z, out)), np.int32(d), np.int32(m), np.float32(eps)),
            shared_mem=smem)
    return out


@_step.register_fake
def _(q, k, v, S, Z, eps):
    return v.new_empty(v.shape)  # contiguous whatever v's strides, as the op returns (cupy_backend._contiguous_like)


def linear_attention_step(q, k, v, S, Z, eps: float):
    """q, k (..., D), v (..., M); S (..., D, M), Z (..., D) contiguous fp32, updated in place:
    S += k v^T, Z += k; returns (q^T S) / (q . Z + eps) (..., M) in v's dtype. One launch for
    every (batch, head). Check step_unsupported_reason first."""
    return _step(q, k, v, S, Z, float(eps))
