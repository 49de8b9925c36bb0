"""What the ops' CuPy backends (causal_product.cuda, normalised.cuda, recurrent.cuda) share: when
a kernel may take its inputs (the dispatcher's reasons), the compiled kernels, torch's stream
as CuPy's, and the launch counter. The ops are torch.library custom ops; the switches their
launches read are repro.kernels.plumbing.switches'."""
import math
from collections import Counter
from functools import cache, lru_cache

import numpy as np
import torch

from repro.kernels.plumbing import cuda_build, switches
from repro.kernels.plumbing.backend import forced_backend
from repro.kernels.plumbing.cuda_grid import smem_chunks

# Verified is not faster: unforced, an op takes its kernel only in the dtypes where the same H100
# (results/gpu/.../kernels/bench.csv) measured it faster than the chunked torch path, forward and
# forward + backward; the fused normalised kernel only without gradients (its backward is 2.8x
# the product's). fp32 stays on cuBLAS, fp16 and the step were not measured: docs/kernels.md.
FASTER_DTYPES = {"causal_dot_product": (torch.bfloat16,), "causal_linear_attention": (torch.bfloat16,),
                 "linear_attention_step": ()}
KERNEL_DTYPES = {torch.float32: "float", torch.bfloat16: "bf16_t", torch.float16: "f16_t"}

# How often each op's CUDA implementation ran (fakes and the torch path never count): the GPU
# tests read it to prove that a layer or a compiled graph really took the CuPy path.
CALLS = Counter()


def gate_reason(op, dtype, backward=False):
    """Why `op` leaves these inputs to the torch path unless REPRO_KERNEL=cupy, or None."""
    forced, how = forced_backend(), "; set REPRO_KERNEL=cupy to use it"
    if forced:
        return None if forced == "cupy" else f"forced off the CuPy kernels by REPRO_KERNEL={forced}"
    if not switches.current().gpu_verified:
        return ("the CuPy kernels are compile-checked but not yet verified on a GPU (the switch gpu_verified "
                "is off)" + how)
    if dtype in KERNEL_DTYPES and dtype not in FASTER_DTYPES[op]:  # others: device_reason says why
        return f"{op} in {dtype} was not measured faster than the torch path (FASTER_DTYPES)" + how
    if backward and op == "causal_linear_attention":
        return "the fused normalised kernel's backward is slower than the product's (FASTER_DTYPES)" + how
    return None


def device_reason(q, dims, what):
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


def shape_reason(q, v):
    if q.dim() < 2 or q.shape[-2] == 0:
        return f"the kernels need a non-empty sequence; got q {tuple(q.shape)}"
    if math.prod(q.shape[:-2]) >= 2 ** 31:
        return f"batch x heads = {math.prod(q.shape[:-2])} exceeds the kernels' grid"
    return None


def ptr(t):
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


def stream(device):
    return cupy_stream(torch.cuda.current_stream(device).cuda_stream)


@cache
def kernel(source, name, device_index, smem):
    """The kernel `name` of the .cu `source` (cuda_build.SOURCES' key), compiled for one GPU."""
    kern = cuda_build.module(source, device_index).get_function(name)
    if smem > 48 * 1024 and kern.max_dynamic_shared_size_bytes < smem:
        kern.max_dynamic_shared_size_bytes = smem  # opt in beyond the default 48 KiB
    return kern


def empty(shape, dtype, device):
    """A kernel's output: uninitialised, or all NaN under the switch prefill_nan."""
    if not switches.current().prefill_nan:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def flat(x):
    """(..., N, X) -> contiguous (BH, N, X); BH spelled out, since -1 is ambiguous at 0 elements."""
    return x.reshape(math.prod(x.shape[:-2]), *x.shape[-2:]).contiguous()


def contiguous_like(x):
    """The fakes' outputs: the real ops return fresh contiguous tensors whatever the inputs'
    strides (v often reaches them as a transposed view), and a fake must say the same, or
    inductor's assert_size_stride fails in a compiled backward."""
    return x.new_empty(x.shape)
