"""Slow, obviously-correct forms of the causal dot product and its successors (the decayed
product, the delta rule), for tests and baselines.

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


def gated_causal_dot_product_loop(q, k, v, log_g):
    """The decayed recurrence in float64, one step per token: S_i = diag(exp(log_g_i)) S_{i-1}
    + k_i v_i^T, out_i = S_i^T q_i; log_g (B, H, N) or (B, H, N, D). Differentiable."""
    q, k, v, log_g = q.double(), k.double(), v.double(), log_g.double()
    g = log_g.exp()[..., None] if log_g.dim() == 4 else log_g.exp()[..., None, None]  # (B, H, N, D | 1, 1)
    s = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])  # (B, H, D, M)
    outs = []
    for i in range(q.shape[2]):
        s = g[:, :, i] * s + k[:, :, i, :, None] * v[:, :, i, None, :]
        outs.append((q[:, :, i, None, :] @ s).squeeze(-2))  # (B, H, M)
    return torch.stack(outs, dim=2)


def delta_rule_loop(q, k, v, beta):
    """The delta rule in float64, one step per token: S_t = S_{t-1} + k_t beta_t (v_t - S_{t-1}^T
    k_t)^T, out_t = S_t^T q_t; beta (B, H, N). Differentiable."""
    q, k, v, beta = q.double(), k.double(), v.double(), beta.double()
    s = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])  # (B, H, D, M)
    outs = []
    for t in range(q.shape[2]):
        k_t = k[:, :, t]
        u = beta[:, :, t, None] * (v[:, :, t] - (k_t[..., None, :] @ s).squeeze(-2))  # (B, H, M)
        s = s + k_t[..., :, None] * u[..., None, :]
        outs.append((q[:, :, t, None, :] @ s).squeeze(-2))
    return torch.stack(outs, dim=2)
