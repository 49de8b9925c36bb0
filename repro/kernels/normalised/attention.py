"""Causal linear attention's normalised product on feature maps,

    V'_i = phi(Q_i)^T S_i / (phi(Q_i)^T Z_i + eps),  S_i = sum_{j<=i} phi(K_j) V_j^T,  Z_i = sum_{j<=i} phi(K_j),

by the fastest correct path for the inputs: the fused CUDA kernel (numerator and normaliser in one
pass, divided in fp32 inside the kernel), else the normaliser folded into the causal product as a
ones column of V (one pass over [V, 1]), its sums kept in fp32 for half-precision inputs (they
overflow fp16 at long N) and only the normalised output rounded. The attention layer
(repro.attention.linear) computes phi and calls this.

repro.kernels.normalised.blocked's normalised_forward and normalised_backward are the same attention
(causal or not) outside autograd, from the layer's q, k, v and its feature map, for the layer's own autograd Function,
which keeps only q, k, v, the output and 1 / (den + eps) and recomputes phi and [v, 1] in its
backward (the layer then keeps no more for backward than SDPA softmax: docs/attention.md). On CPU
both take the (batch, head) rows in groups, and the backward long rows in blocks of tokens, each
from phi to the finished gradient before the next (repro.kernels.normalised.blocked), so that the layer's
peak memory is SDPA's too: the full-size phi(Q), phi(K), [v, 1], their gradients and the chunk
workspace never exist at once.
"""
import torch

from repro.kernels import causal_dot_product, cupy_for
from repro.kernels.plumbing.dtypes import accumulation_dtype


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
    if cb := cupy_for("normalised", phi_q, phi_k, v):
        return cb.causal_linear_attention(phi_q, phi_k, v, eps)  # numerator and normaliser in one pass
    # phi(q_i) . sum_{j<=i} phi(k_j) is the product's ones column: one causal pass over [v, 1]
    # gives [num | den], instead of a second pass of cumsum, product and sum over (B, H, N, F).
    # Both come back in the accumulation dtype: rounded to fp16 before the division, num
    # overflows at N ~ 1,000 already (sum over j of (phi(q_i) . phi(k_j)) v_j grows with N).
    v1 = torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], -1)  # (B, H, N, M + 1)
    out = causal_dot_product(phi_q, phi_k, v1, out_dtype=accumulation_dtype(phi_q.dtype))
    return _Normalise.apply(out, eps)[0].to(v.dtype)  # (B, H, N, M)
