"""The linear layer's causal attention with phi = elu + 1, fused on the CPU (linear_layer_cpu.c, in
cpu_native's library): y and inv = 1 / (den + eps) straight from the projections' q, k, v, and
the gradients of q, k, v straight from the saved q, k, v, y, inv and the upstream gradient.

phi(Q), phi(K), [v, 1] and the upstream gradient's [g inv | -sum g inv y] exist a chunk at a time
inside the kernel (its scratch: a chunk's buffers and one state per head, a few dozen KiB per
thread, kept between calls), so the layer holds nothing beside its inputs and outputs: one
layer's forward + backward peaks below SDPA softmax's at every length measured (docs/attention.md;
repro.attention.linear keeps the same five tensors for backward either way).
repro.kernels.normalised.blocked does the same work for any feature map, in bounded workspace.

applies() says where the layer calls these. Both return None when a row's sum is not finite (an
inf or NaN in the inputs): the caller then takes repro.kernels.normalised.blocked's exact path.
"""
import ctypes

import torch

from repro.kernels.causal_product import cpu_native
from repro.kernels.causal_product.cpu_native import CHUNK, View, check_rc, thread_groups
from repro.kernels.normalised.blocked import heads_last
from repro.kernels.plumbing.threads import run_groups


def applies(q, k, v, causal: bool, feature_map) -> bool:
    """Causal, fp32 q, k, v on the CPU, the elu + 1 map, and the fused library available."""
    return (causal and getattr(feature_map, "fused_cpu", False)
            and all(x.dtype == torch.float32 for x in (q, k, v)) and cpu_native.native(q.device, torch.float32))


def _view(t, name, shape):
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 4 or tuple(t.shape) != shape:
        raise ValueError(f"linear_layer_cpu: {name} must be an fp32 CPU tensor of shape {shape}; got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")
    return View(t.data_ptr(), *t.stride())


def _mask(mask, b, n):
    """(pointer, batch stride) of a (B, N) bool key padding mask, or (None, 0)."""
    if mask is None:
        return None, 0, None
    if mask.dtype != torch.bool or tuple(mask.shape) != (b, n):
        raise ValueError(f"linear_layer_cpu: key_padding_mask must be bool of shape {(b, n)}; got {mask.dtype} "
                         f"{tuple(mask.shape)}")
    mask = mask.contiguous()
    return mask.data_ptr(), n, mask  # the tensor itself, kept alive for the call


def forward(q, k, v, key_padding_mask, eps: float, c: int = CHUNK):
    """q, k (B, H, N, D), v (B, H, N, M), any strides -> (y (B, H, N, M) laid out as (B, N, H, M),
    inv (B, H, N, 1)); None when a row's total state is not finite."""
    b, h, n, d = q.shape
    m = v.shape[-1]
    views = [_view(x, nm, s) for x, nm, s in ((q, "q", (b, h, n, d)), (k, "k", (b, h, n, d)), (v, "v", (b, h, n, m)))]
    mask, mask_sb, _keep = _mask(key_padding_mask, b, n)
    y, inv = heads_last((b, h, n, m), torch.float32, q.device), torch.empty(b, h, n, 1, dtype=torch.float32)
    if n == 0:
        return y, inv
    yv, lib, ok = _view(y, "y", (b, h, n, m)), cpu_native.library(), []
    refs = [ctypes.byref(x) for x in (*views, yv)]
    run_groups(lambda s: ok.append(check_rc(lib.linear_elu_forward(
        s.start, min(s.stop, b * h), h, n, d, m, c, eps, *refs[:3], mask, mask_sb, refs[3], inv.data_ptr()))),
        thread_groups(b * h))
    return (y, inv) if all(ok) else None


def backward(q, k, v, key_padding_mask, y, inv, g, need=(True, True, True), c: int = CHUNK):
    """The gradients of forward's y for the upstream g (B, H, N, M, any strides, stride 0 too): (grad
    q, grad k, grad v), each laid out as (B, N, H, X), None where `need` says so; None when a row's
    sum phi(K)^T [v, 1] or phi(Q)^T g1 is not finite."""
    b, h, n, d = q.shape
    m = v.shape[-1]
    shapes = {"q": (b, h, n, d), "k": (b, h, n, d), "v": (b, h, n, m), "y": (b, h, n, m), "g": (b, h, n, m)}
    views = [_view(x, nm, shapes[nm]) for x, nm in ((q, "q"), (k, "k"), (v, "v"), (y, "y"), (g, "g"))]
    if inv.dtype != torch.float32 or tuple(inv.shape) != (b, h, n, 1) or not inv.is_contiguous():
        raise ValueError(f"linear_layer_cpu: inv must be a contiguous fp32 tensor of shape {(b, h, n, 1)}; got "
                         f"{inv.dtype} {tuple(inv.shape)}")
    mask, mask_sb, _keep = _mask(key_padding_mask, b, n)
    grads = [heads_last((b, h, n, x), torch.float32, q.device) if r else None for x, r in zip((d, d, m), need)]
    if n == 0 or not any(need):
        return grads
    out = [None if t is None else ctypes.byref(_view(t, "grad", tuple(t.shape))) for t in grads]
    lib, ok, refs = cpu_native.library(), [], [ctypes.byref(x) for x in views]
    run_groups(lambda s: ok.append(check_rc(lib.linear_elu_backward(
        s.start, min(s.stop, b * h), h, n, d, m, c, *refs[:3], mask, mask_sb, refs[3], inv.data_ptr(), refs[4], *out))),
        thread_groups(b * h))
    return grads if all(ok) else None
