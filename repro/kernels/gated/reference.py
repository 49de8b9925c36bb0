"""The decayed causal product, slow and obviously correct, for tests and baselines."""
import torch


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
