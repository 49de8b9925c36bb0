"""Causal dot product kernels behind one dispatcher.

    causal_dot_product(q, k, v, out_dtype=None) -> out
    q, k: (B, H, N, D), v: (B, H, N, M) -> out: (B, H, N, M), in q's dtype or out_dtype
    out[..., i, :] = sum_{j<=i} (q_i . k_j) v_j        (unnormalised; no feature map)
    causal_dot_product_backward(q, k, v, g, need) -> (grad q, grad k, grad v), outside autograd

Backends, in order of preference:
  cupy   raw CUDA kernels (CUDA tensors; repro.kernels.causal_product.cuda, when CuPy is there)
  cpu    the fused C kernel (CPU tensors but fp64, sums in fp32; repro.kernels.causal_product.cpu_native
         builds it on first use with the C compiler): the chunked path's own CPU backend, inside its
         autograd Function, which falls back to the PyTorch pieces for non-finite inputs
  torch  the chunked PyTorch path (any device, any dtype)
The environment variable REPRO_KERNEL=torch|cupy|cpu forces one (read in
repro.kernels.plumbing.backend alone); REPRO_KERNEL_SWITCHES picks the CUDA kernels' variants
(repro.kernels.plumbing.switches). One folder per op holds its naive reference (for tests only),
its PyTorch path and its backends: causal_product, normalised (the normalised causal attention on
feature maps, repro.kernels.normalised.attention.causal_linear_attention), gated, delta and
recurrent (the generation step); plumbing holds what they share.

Its successors, with the same conventions (chunked PyTorch paths, any device; docs/kernels.md):
    gated_causal_dot_product(q, k, v, log_g)   S_i = diag(exp(log_g_i)) S_{i-1} + k_i v_i^T, out_i = S_i^T q_i
        log_g (B, H, N): one decay per step (retention, RFA); (B, H, N, D): one per key dimension (GLA)
    delta_rule_dot_product(q, k, v, beta)      S_t = S_{t-1} + k_t beta_t (v_t - S_{t-1}^T k_t)^T, out_t = S_t^T q_t
        beta (B, H, N)
"""
import importlib

import torch

from repro.kernels.causal_product import cpu_native
from repro.kernels.causal_product.chunked import (
    causal_dot_product_chunked,
    causal_dot_product_chunked_backward,
    default_chunk_size,
)
from repro.kernels.delta.chunked import delta_rule_dot_product_chunked
from repro.kernels.gated.chunked import gated_causal_dot_product_chunked
from repro.kernels.plumbing.backend import BACKENDS, BackendUnavailable, forced_backend
from repro.kernels.plumbing.threads import may_use_threads

__all__ = ["BACKENDS", "causal_dot_product", "causal_dot_product_backward", "select_backend", "product_backend",
           "causal_dot_product_chunked", "default_chunk_size", "gated_causal_dot_product", "delta_rule_dot_product",
           "gated_causal_dot_product_chunked", "delta_rule_dot_product_chunked", "cupy_for", "cupy_unavailable"]


def _check_inputs(q, k, v, op="causal_dot_product", min_dim=2):
    if q.dim() < min_dim or q.shape != k.shape:
        raise ValueError(f"{op}: q and k must share a shape (B, H, N, D); "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"{op}: v must be (B, H, N, M) with the B, H, N of q; "
                         f"got q {tuple(q.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"{op}: q, k, v must share one floating dtype; "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: q, k, v must be on one device; "
                         f"got {q.device}, {k.device}, {v.device}")


def _check_extra(op, name, x, q, shapes):
    """x (log_g, beta) of one of `shapes` (tuples of q's dims), floating, on q's device."""
    valid = [tuple(q.shape[i] for i in dims) for dims in shapes]
    if tuple(x.shape) not in valid or not x.is_floating_point() or x.device != q.device:
        raise ValueError(f"{op}: {name} must be a floating tensor on {q.device} of shape "
                         f"{' or '.join(str(v) for v in valid)}; got {x.dtype} {tuple(x.shape)} on {x.device}")


def gated_causal_dot_product(q, k, v, log_g, chunk_size=None):
    """out_i = sum_{j<=i} ((q_i * prod_{j<t<=i} exp(log_g_t)) . k_j) v_j; log_g <= 0 (B, H, N) or
    (B, H, N, D). The chunked path (repro.kernels.gated.chunked) on every device."""
    _check_inputs(q, k, v, "gated_causal_dot_product", 4)
    _check_extra("gated_causal_dot_product", "log_g", log_g, q, ((0, 1, 2), (0, 1, 2, 3)))
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"gated_causal_dot_product: chunk_size must be >= 1; got {chunk_size}")
    return gated_causal_dot_product_chunked(q, k, v, log_g, chunk_size)


def delta_rule_dot_product(q, k, v, beta, chunk_size=None):
    """The delta rule's outputs o_t = S_t^T q_t; beta (B, H, N). The chunked WY / UT path
    (repro.kernels.delta.chunked) on every device."""
    _check_inputs(q, k, v, "delta_rule_dot_product", 4)
    _check_extra("delta_rule_dot_product", "beta", beta, q, ((0, 1, 2),))
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"delta_rule_dot_product: chunk_size must be >= 1; got {chunk_size}")
    return delta_rule_dot_product_chunked(q, k, v, beta, chunk_size)


def cupy_unavailable(op, *tensors):
    """None when the CuPy backend of `op` (an op folder with a cuda module: "causal_product",
    "normalised", "recurrent") takes these tensors, else the reason it cannot (its
    `unsupported_reason`). CPU tensors never import the backend."""
    if not tensors[0].is_cuda:
        return f"the CuPy backend runs CUDA tensors only (inputs are on {tensors[0].device})"
    try:
        cuda = importlib.import_module(f"repro.kernels.{op}.cuda")
    except ImportError as err:
        return f"the CuPy backend is not available: {err}"
    return cuda.unsupported_reason(*tensors)


def select_backend(q, k, v):
    """(backend name, why) for these inputs, honouring REPRO_KERNEL."""
    forced = forced_backend()
    if forced == "torch":
        return "torch", "forced by REPRO_KERNEL=torch"
    if forced == "cpu":
        if q.device.type != "cpu":
            raise BackendUnavailable(f"REPRO_KERNEL=cpu, but the inputs are on {q.device}; the fused CPU kernel takes "
                                     f"CPU tensors (unset REPRO_KERNEL, or set it to cupy or torch)")
        cpu_native.wanted()  # raises, naming why, when it cannot be built
        return "cpu", "forced by REPRO_KERNEL=cpu"
    reason = cupy_unavailable("causal_product", q, k, v)
    if forced == "cupy":
        if reason:
            raise BackendUnavailable(f"REPRO_KERNEL=cupy, but {reason}")
        return "cupy", "forced by REPRO_KERNEL=cupy"
    if reason is None:
        return "cupy", "CUDA tensors and the CuPy kernels can take them"
    if q.device.type == "cpu" and q.dtype != torch.float64 and may_use_threads():  # not while tracing
        if cpu_native.native(q.device, torch.float32):
            return "cpu", "CPU tensors: the fused CPU kernel (sums in fp32)"
        if why := cpu_native.unavailable():
            return "torch", f"the fused CPU kernel is unavailable: {why}"
    return "torch", reason


def cupy_for(op, *tensors):
    """The CuPy backend module of `op` (an op folder, as cupy_unavailable) when it takes these
    tensors, else None: the attention layers ask here, as causal_dot_product does."""
    if forced_backend() in ("torch", "cpu") or cupy_unavailable(op, *tensors) is not None:
        return None
    return importlib.import_module(f"repro.kernels.{op}.cuda")


# why product_backend keeps half-precision inputs asked for fp32 sums off the CuPy kernel (FASTER_DTYPES)
WIDE_SUMS = "half-precision inputs with fp32 sums: the chunked path's fp32 matmuls beat the fp32 CUDA kernel"


def product_backend(q, k, v, out_dtype=None):
    """(backend name, why) causal_dot_product takes for these inputs and out_dtype: select_backend's
    choice, but half-precision inputs asked for wider sums stay off the CuPy kernel unless forced."""
    backend, why = select_backend(q, k, v)
    if backend == "cupy" and out_dtype not in (None, q.dtype) and forced_backend() != "cupy":
        return "torch", WIDE_SUMS
    return backend, why


def causal_dot_product(q, k, v, out_dtype=None):
    """out_dtype (torch.float32 for half-precision inputs): the sums unrounded, in that dtype."""
    _check_inputs(q, k, v)
    backend, _ = product_backend(q, k, v, out_dtype)
    wide = out_dtype not in (None, q.dtype)  # the kernels return their inputs' dtype: fp32 inputs then
    if backend == "cupy":
        from repro.kernels.causal_product import cuda
        if wide:
            q, k, v = q.to(out_dtype), k.to(out_dtype), v.to(out_dtype)
        return cuda.causal_dot_product(q, k, v)
    return causal_dot_product_chunked(q, k, v, out_dtype=out_dtype)


def causal_dot_product_backward(q, k, v, g, need=(True, True, True)):
    """The gradients of causal_dot_product(q, k, v) for the upstream gradient g (B, H, N, M), by
    the backend the forward took for these inputs, without a graph (None where `need` is False):
    for callers that recompute q, k, v in their own backward instead of keeping the product's
    autograd node (repro.attention.linear)."""
    _check_inputs(q, k, v)
    if select_backend(q, k, v)[0] == "cupy":
        from repro.kernels.causal_product import cuda
        grads = cuda.cdp_backward(q, k, v, g)  # the op its forward registers as backward
        return tuple(gr if r else None for gr, r in zip(grads, need))
    return causal_dot_product_chunked_backward(q, k, v, g, need)
