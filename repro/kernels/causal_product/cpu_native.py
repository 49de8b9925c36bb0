"""The fused CPU causal dot product (causal_dot_cpu.c), built on first use and called through
ctypes: the chunked path's fast CPU backend, summing in fp32 (fp32, bf16 and fp16 inputs;
repro.kernels.causal_product.chunked picks it; REPRO_KERNEL=torch turns it off). ctypes releases the GIL during a
call, so the chunked path's host threads run groups of rows on it in parallel. The same library
holds the linear layer's fused attention (linear_layer_cpu.c; repro.kernels.normalised.cpu_layer).

The shared library is compiled by the C compiler on the PATH (cc, or $CC) with -O3 -march=native
on first use, through repro.kernels.plumbing.cpu_build's cache (keyed by the sources, flags, compiler and
CPU; a cached file is checked before it is loaded, and rebuilt when it is cut short, for another
machine, lacks an entry point or could be someone else's). No compiler, or a failed build (a
compiler without GCC's vector extensions, which GCC and Clang have): unavailable(), with the
reason, and the chunked path runs its plain PyTorch pieces instead.
"""
import ctypes
from pathlib import Path

import torch

from repro.kernels.plumbing import cpu_build
from repro.kernels.plumbing.backend import BackendUnavailable, forced_backend
from repro.kernels.plumbing.threads import may_use_threads, run_groups

# One shared library: the causal product (causal_dot_cpu.c), the linear layer's fused attention
# (linear_layer_cpu.c, called by repro.kernels.normalised.cpu_layer) and the products both are made of.
KERNELS = Path(__file__).resolve().parent.parent  # repro/kernels/
SOURCES = [KERNELS / "causal_product" / "causal_dot_cpu.c", KERNELS / "normalised" / "linear_layer_cpu.c"]
HEADERS = [KERNELS / "plumbing" / "cpu_blas.h"]
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]
# The fused kernel's chunk C, measured (1 thread, medians of 7 interleaved rounds, C = 16, 32, 48,
# 64, 96; rows x N = 8 x 4096 at D = M = 64, 32 x 33, 16 x 16, and 8 x 1024, 128 x 256): 32 is
# within 6 % of the fastest forward and 10 % of the fastest backward everywhere; 64 loses 10-25 %
# forward (its (C, C) blocks do more masked work), 16 loses 20-30 % backward.
CHUNK = 32

# The entry points the library must hold (checked in the file before it is loaded).
SYMBOLS = ("causal_dot_forward", "causal_dot_backward", "linear_elu_forward", "linear_elu_backward")

_LIB: list = []  # [ctypes library or None, why not]


def _build() -> tuple:
    dll, why = cpu_build.load("causal_dot_cpu", SOURCES, HEADERS, FLAGS, SYMBOLS)
    if dll is None:
        return None, why
    ptr, i, l = ctypes.c_void_p, ctypes.c_int, ctypes.c_long  # noqa: E741
    dll.causal_dot_forward.argtypes = [l, i, i, i, i, ptr, ptr, ptr, ptr, ptr]
    dll.causal_dot_backward.argtypes = [l, i, i, i, i, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
    view, f = ctypes.POINTER(View), ctypes.c_float
    dll.linear_elu_forward.argtypes = [l, l, i, i, i, i, i, f, view, view, view, ptr, l, view, ptr]
    dll.linear_elu_backward.argtypes = [l, l, i, i, i, i, i, view, view, view, ptr, l, view, ptr, view, view, view,
                                        view]
    dll.causal_dot_forward.restype = dll.causal_dot_backward.restype = i
    dll.linear_elu_forward.restype = dll.linear_elu_backward.restype = i
    return dll, None


class View(ctypes.Structure):
    """linear_layer_cpu.c's `view`: a strided fp32 (B, H, N, X) tensor, strides in elements."""
    _fields_ = [("p", ctypes.c_void_p), ("sb", ctypes.c_long), ("sh", ctypes.c_long), ("sn", ctypes.c_long),
                ("sj", ctypes.c_long)]


def library():
    """The loaded library, or None (unavailable() says why). Built once per process."""
    if not _LIB:
        _LIB.extend(_build())
    return _LIB[0]


def unavailable() -> str | None:
    library()
    return _LIB[1]


def wanted() -> bool:
    """False under REPRO_KERNEL=torch (plain PyTorch everywhere); REPRO_KERNEL=cpu insists on this
    kernel: one error naming why it cannot be built."""
    forced = forced_backend()
    if forced == "cpu" and library() is None:
        raise BackendUnavailable(f"REPRO_KERNEL=cpu, but the fused CPU kernel is unavailable: {unavailable()}")
    return forced != "torch"


def _ptr(t):
    return None if t is None else t.data_ptr()


def _require(shapes: dict):
    """Every tensor fp32, on the CPU, contiguous and of its expected shape: the C code reads raw
    pointers, so anything else would be read out of bounds instead of failing."""
    for name, (t, shape) in shapes.items():
        if t is None:
            continue
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != shape:
            raise ValueError(f"causal_dot_cpu: {name} must be a contiguous fp32 CPU tensor of shape {shape}; "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}, contiguous={t.is_contiguous()}")


def check_rc(rc):
    if rc < 0:
        raise MemoryError("causal_dot_cpu: out of memory for the per-call workspace")
    return rc == 0


def forward(q, k, v, out, c=CHUNK, state=None) -> bool:
    """out (rows, N, M) = the causal product of q, k (rows, N, D), v (rows, N, M), plus q_i^T S0
    where state (rows, D, M) holds S0; state then holds each row's final sum. False when a row's
    total is not finite (k or v holds an inf or NaN): the caller takes the exact path then."""
    rows, n, d = q.shape
    m = v.shape[-1]
    _require({"q": (q, (rows, n, d)), "k": (k, (rows, n, d)), "v": (v, (rows, n, m)), "out": (out, (rows, n, m)),
              "state": (state, (rows, d, m))})
    return check_rc(library().causal_dot_forward(rows, n, d, v.shape[-1], c, _ptr(q), _ptr(k), _ptr(v), _ptr(out),
                                               _ptr(state)))


def backward(q, k, v, g, grads, c=CHUNK, s0=None, r0=None) -> bool:
    """grads (grad q, grad k, grad v; each (rows, N, D|M) or None) of forward's out for the upstream
    g, with s0 the state before the rows (forward's S0) and r0 the reverse state after them (sum of
    q^T g over later tokens), each (rows, D, M) or None (zeros). False when a row's sum k v^T or
    sum q g^T is not finite: the caller takes the exact path then."""
    rows, n, d = q.shape
    m = v.shape[-1]
    _require({"q": (q, (rows, n, d)), "k": (k, (rows, n, d)), "v": (v, (rows, n, m)), "g": (g, (rows, n, m)),
              "grad q": (grads[0], (rows, n, d)), "grad k": (grads[1], (rows, n, d)),
              "grad v": (grads[2], (rows, n, m)), "s0": (s0, (rows, d, m)), "r0": (r0, (rows, d, m))})
    return check_rc(library().causal_dot_backward(rows, n, d, v.shape[-1], c, _ptr(q), _ptr(k), _ptr(v), _ptr(g),
                                                *(_ptr(x) for x in grads), _ptr(s0), _ptr(r0)))


def native(device, dtype) -> bool:
    """Whether the fused CPU kernel computes in this device and dtype:
    fp32 on the CPU, in plain eager mode (a trace or a dispatch mode cannot see into it), not turned
    off by REPRO_KERNEL=torch, and built on this machine."""
    return (device.type == "cpu" and dtype == torch.float32 and may_use_threads()
            and wanted() and library() is not None)


def thread_groups(rows):
    """One slice of rows per thread: the fused kernel has no per-call cost to amortise, and its
    workspace is a few (C, C) and (D, M) blocks whatever the group."""
    threads = torch.get_num_threads() if may_use_threads() else 1
    per = -(-rows // max(1, threads))
    return [slice(i, i + per) for i in range(0, rows, per)]


def run_forward(q3, k3, v3, c, state=None):
    """The fused forward of (rows, N, D|M) fp32 tensors, one group of rows per host thread, or None
    when some row's total is not finite (an inf or NaN in k or v: the exact path's case). Each
    thread makes its own rows contiguous (a no-op when they are): a copy of the whole inputs
    before the pool would run on torch's OpenMP threads, still spinning when the pool starts."""
    out, ok = v3.new_empty(v3.shape), []
    run_groups(lambda s: ok.append(forward(*(x[s].contiguous() for x in (q3, k3, v3)), out[s], c,
                                            None if state is None else state[s])), thread_groups(q3.shape[0]))
    return out if all(ok) else None


def run_backward(q3, k3, v3, g3, c, need, s0=None, r0=None):
    """The fused backward's (grad q, grad k, grad v) (None where `need` says so), or None when
    some row's sum k v^T or q g^T is not finite (the exact path's case). g may be an expanded
    stride-0 tensor (after out.sum().backward()): each thread copies its own rows (run_forward)."""
    grads = [x.new_empty(x.shape) if r else None for x, r in zip((q3, k3, v3), need)]
    ok = []
    run_groups(lambda s: ok.append(backward(
        *(x[s].contiguous() for x in (q3, k3, v3, g3)), [None if x is None else x[s] for x in grads], c,
        None if s0 is None else s0[s], None if r0 is None else r0[s])), thread_groups(q3.shape[0]))
    return grads if all(ok) else None
