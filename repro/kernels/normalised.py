"""Causal linear attention's normalised product on feature maps,

    V'_i = phi(Q_i)^T S_i / (phi(Q_i)^T Z_i + eps),  S_i = sum_{j<=i} phi(K_j) V_j^T,  Z_i = sum_{j<=i} phi(K_j),

by the fastest correct path for the inputs: the fused CUDA kernel (numerator and normaliser in one
pass), else the normaliser folded into the causal product as a ones column of V (one pass over
[V, 1]), else (half precision) the normaliser as its own fp32 pass, since sum phi(K) overflows
fp16. The attention layer (repro.attention.linear) computes phi and calls this."""
import torch
from torch.autograd.function import once_differentiable

from repro.kernels import causal_dot_product, cupy_for


def accumulation_dtype(dtype):
    """Sums over the sequence run in fp32 (fp64 for fp64): sum phi(K) overflows fp16 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Normalise(torch.autograd.Function):
    """[num | den] (B, H, N, M + 1) -> num / (den + eps) (B, H, N, M). Its backward builds the
    gradient of [num | den] as one tensor (autograd's slice and division would zero-fill two
    full-size gradients, add them and take five elementwise passes):
        d num = g / (den + eps),  d den = -sum_m g_m num_m / (den + eps)^2 = -sum_m (d num)_m y_m."""

    @staticmethod
    def forward(ctx, out, eps):
        inv = 1.0 / (out[..., -1:] + eps)  # (B, H, N, 1)
        y = out[..., :-1] * inv
        ctx.save_for_backward(y, inv)
        return y

    @staticmethod
    @once_differentiable  # as the causal product beneath it
    def backward(ctx, g):
        y, inv = ctx.saved_tensors
        d_num = g * inv  # (B, H, N, M)
        return torch.cat([d_num, (d_num * y).sum(-1, keepdim=True).neg_()], -1), None  # (B, H, N, M + 1)


def causal_linear_attention(phi_q, phi_k, v, eps: float):
    """(B, H, N, F), (B, H, N, F), (B, H, N, M) -> (B, H, N, M): V' above, in v's dtype."""
    acc = accumulation_dtype(phi_q.dtype)
    if cb := cupy_for("linear_attention_unsupported_reason", phi_q, phi_k, v):
        return cb.causal_linear_attention(phi_q, phi_k, v, eps)  # numerator and normaliser in one pass
    if acc == phi_q.dtype:
        # phi(q_i) . sum_{j<=i} phi(k_j) is the product's ones column: one causal pass over [v, 1]
        # gives [num | den], instead of a second pass of cumsum, product and sum over (B, H, N, F)
        v1 = torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], -1)  # (B, H, N, M + 1)
        return _Normalise.apply(causal_dot_product(phi_q, phi_k, v1), eps)  # (B, H, N, M)
    # half precision: the kernel rounds its output to the input dtype, and den must stay in fp32
    num = causal_dot_product(phi_q, phi_k, v).to(acc)  # (B, H, N, M)
    den = torch.einsum("bhnf,bhnf->bhn", phi_q.to(acc), phi_k.to(acc).cumsum(2))  # phi(Q_i)^T Z_i
    return (num / (den[..., None] + eps)).to(v.dtype)
