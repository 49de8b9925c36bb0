"""Slow, obviously-correct forms of the causal dot product, for tests and baselines.

out[..., i, :] = sum_{j<=i} (q_i . k_j) v_j
"""
import torch


def causal_dot_product_naive(q, k, v):
    """The masked O(N^2) formula, computed in float64. Differentiable."""
    n = q.shape[-2]
    a = q.double() @ k.double().transpose(-1, -2)  # (B, H, N, N)
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return (a.masked_fill(~mask, 0.0) @ v.double()).to(q.dtype)


def causal_dot_product_loop(q, k, v):
    """The RNN definition: one step per token, S_i = S_{i-1} + k_i v_i^T, out_i = q_i^T S_i.

    Autograd keeps every S_i, so memory is O(N D M): this is the baseline the chunked
    kernel is measured against, not something to train with.
    """
    b, h, n, d = q.shape
    s = q.new_zeros(b, h, d, v.shape[-1])  # (B, H, D, M)
    outs = []
    for i in range(n):
        s = s + k[:, :, i, :, None] * v[:, :, i, None, :]
        outs.append((q[:, :, i, None, :] @ s).squeeze(-2))  # (B, H, M)
    return torch.stack(outs, dim=2)
