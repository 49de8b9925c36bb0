"""Causal linear attention's normalised product on feature maps,

    V'_i = phi(Q_i)^T S_i / (phi(Q_i)^T Z_i + eps),  S_i = sum_{j<=i} phi(K_j) V_j^T,  Z_i = sum_{j<=i} phi(K_j),

by the fastest correct path for the inputs: the fused CUDA kernel (numerator and normaliser in one
pass, divided in fp32 inside the kernel), else the normaliser folded into the causal product as a
ones column of V (one pass over [V, 1]), its sums kept in fp32 for half-precision inputs (they
overflow fp16 at long N) and only the normalised output rounded. The attention layer
(repro.attention.linear) computes phi and calls this.

normalised_forward and normalised_backward are the same attention (causal or not) outside
autograd, for the layer's own autograd Function, which keeps only the layer's q, k, v, the output
and 1 / (den + eps) and recomputes phi and [v, 1] in its backward (the layer then keeps no more
for backward than SDPA softmax: docs/attention.md)."""
import torch

from repro.kernels import causal_dot_product, causal_dot_product_backward, cupy_for


def accumulation_dtype(dtype):
    """Sums over the sequence run in fp32 (fp64 for fp64): sum phi(K) overflows fp16 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Normalise(torch.autograd.Function):
    """[num | den] (B, H, N, M + 1) -> y = num * inv (B, H, N, M) and inv = 1 / (den + eps)
    (B, H, N, 1). Its backward builds the gradient of [num | den] as one tensor (autograd's slice
    and division would zero-fill two full-size gradients, add them and take five elementwise
    passes):
        d num = g inv,  d den = -sum_m (d num)_m y_m - g_inv inv^2.
    inv is an output (callers drop it) so that this formula, in the saved outputs y and inv, is
    differentiable in turn: under create_graph their gradients come back here as g and g_inv."""

    @staticmethod
    def forward(ctx, out, eps):
        inv = 1.0 / (out[..., -1:] + eps)  # (B, H, N, 1)
        y = out[..., :-1] * inv
        ctx.save_for_backward(y, inv)
        ctx.set_materialize_grads(False)  # g_inv is None unless a second derivative asks for it
        return y, inv

    @staticmethod
    def backward(ctx, g, g_inv):
        y, inv = ctx.saved_tensors
        d_num = (torch.zeros_like(y) if g is None else g) * inv  # (B, H, N, M)
        d_den = (d_num * y).sum(-1, keepdim=True).neg_()  # (B, H, N, 1)
        if g_inv is not None:
            d_den = d_den - g_inv * inv * inv
        return torch.cat([d_num, d_den], -1), None  # (B, H, N, M + 1)


def causal_linear_attention(phi_q, phi_k, v, eps: float):
    """(B, H, N, F), (B, H, N, F), (B, H, N, M) -> (B, H, N, M): V' above, in v's dtype."""
    if cb := cupy_for("linear_attention_unsupported_reason", phi_q, phi_k, v):
        return cb.causal_linear_attention(phi_q, phi_k, v, eps)  # numerator and normaliser in one pass
    # phi(q_i) . sum_{j<=i} phi(k_j) is the product's ones column: one causal pass over [v, 1]
    # gives [num | den], instead of a second pass of cumsum, product and sum over (B, H, N, F).
    # Both come back in the accumulation dtype: rounded to fp16 before the division, num
    # overflows at N ~ 1,000 already (sum over j of (phi(q_i) . phi(k_j)) v_j grows with N).
    v1 = torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], -1)  # (B, H, N, M + 1)
    out = causal_dot_product(phi_q, phi_k, v1, out_dtype=accumulation_dtype(phi_q.dtype))
    return _Normalise.apply(out, eps)[0].to(v.dtype)  # (B, H, N, M)


def _with_ones(v, dtype):
    """[v | 1] (B, H, N, M + 1), contiguous, in dtype: the normaliser as the product's last column."""
    v1 = torch.empty(*v.shape[:-1], v.shape[-1] + 1, dtype=dtype, device=v.device)
    v1[..., :-1].copy_(v)
    v1[..., -1].fill_(1.0)
    return v1


def _heads_last(shape, dtype, device):
    """An empty (B, H, N, X) tensor laid out as (B, N, H, X): flattening its transpose to the
    (B, N, H X) the output projection reads is then a view, not a copy."""
    b, h, n, x = shape
    return torch.empty(b, n, h, x, dtype=dtype, device=device).transpose(1, 2)


def normalised_forward(phi_q, phi_k, v, eps: float, causal: bool):
    """phi_q, phi_k (B, H, N, F) in the accumulation dtype, v (B, H, N, M) in any layout ->
    (y (B, H, N, M) in v's dtype, a view of a contiguous (B, N, H, M) tensor; inv = 1 / (den + eps)
    (B, H, N, 1) in the accumulation dtype). Causal: sums over j <= i. No graph is recorded."""
    v1 = _with_ones(v, phi_q.dtype)  # (B, H, N, M + 1)
    if causal:
        out = causal_dot_product(phi_q, phi_k, v1)  # [num | den] (B, H, N, M + 1)
    else:
        out = phi_q @ (phi_k.mT @ v1)  # phi(Q) [S | Z]: S1 (B, H, F, M + 1)
    inv = out[..., -1:].add(eps).reciprocal_()  # (B, H, N, 1)
    y = _heads_last(v.shape, v.dtype, v.device)
    torch.mul(out[..., :-1], inv, out=y)  # rounded to v's dtype only here
    return y, inv


def normalised_backward(phi_q, phi_k, v, y, inv, g, causal: bool, need=(True, True, True)):
    """The gradients (phi_q's and phi_k's in their dtype, v's in the accumulation dtype; None
    where `need` says so) of normalised_forward's y for the upstream gradient g (B, H, N, M), from
    its saved y and inv (_Normalise's backward, then the product's with V' = [v, 1]):
        g_num = g inv,  g_den = -sum_m g_num,m y_m."""
    m = v.shape[-1]
    g1 = torch.empty(*y.shape[:-1], m + 1, dtype=inv.dtype, device=inv.device)  # (B, H, N, M + 1)
    g_num = torch.mul(g, inv, out=g1[..., :-1])
    torch.sum(g_num * y, -1, keepdim=True, out=g1[..., -1:]).neg_()
    v1 = _with_ones(v, phi_q.dtype)
    if causal:
        grad_q, grad_k, grad_v1 = causal_dot_product_backward(phi_q, phi_k, v1, g1, need)
        return grad_q, grad_k, None if grad_v1 is None else grad_v1[..., :-1]
    s1 = phi_k.mT @ v1  # (B, H, F, M + 1), recomputed: kept, it would cost D (M + 1) per head
    grad_s1 = phi_q.mT @ g1 if need[1] or need[2] else None  # (B, H, F, M + 1)
    return (g1 @ s1.mT if need[0] else None, v1 @ grad_s1.mT if need[1] else None,
            phi_k @ grad_s1[..., :-1] if need[2] else None)
