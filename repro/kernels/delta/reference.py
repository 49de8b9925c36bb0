"""The delta rule, slow and obviously correct, for tests and baselines."""
import torch


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
