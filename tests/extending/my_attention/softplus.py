"""A user's attention, written outside the suite: linear attention with phi = softplus,
sim(q, k) = phi(q) . phi(k), written the plain quadratic way (a user's first version), with its
recurrent twin (S, Z) for generation. docs/extending.md checks it with task=conformance and then
trains it on the copy task:
    PYTHONPATH=tests/extending python run.py task=conformance attention=custom \
        attention._target_=my_attention.softplus.SoftplusAttention"""
import torch.nn.functional as F

from repro.attention.base import AttentionLayer


class SoftplusAttention(AttentionLayer):
    recurrent = True

    def __init__(self, d_model: int, n_heads: int, eps: float = 1e-6):
        super().__init__(d_model, n_heads)
        self.eps = eps

    def attend(self, q, k, v, causal, key_padding_mask):
        """(B, H, N, D), (B, H, N, D), (B, H, N, M) -> (B, H, N, M)."""
        phi_q, phi_k = F.softplus(q), F.softplus(k)
        if key_padding_mask is not None:  # a padded key: no weight, so its value is never read
            phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        a = phi_q @ phi_k.transpose(-1, -2)  # (B, H, N, N)
        if causal:
            a = a.tril()
        return (a @ v) / (a.sum(-1, keepdim=True) + self.eps)

    def attend_step(self, q, k, v, state):
        """(B, H, D), (B, H, D), (B, H, M), (S, Z) or None -> (B, H, M), (S, Z)."""
        phi_q, phi_k = F.softplus(q), F.softplus(k)
        S, Z = state if state is not None else (0.0, 0.0)
        S = S + phi_k[..., :, None] * v[..., None, :]  # (B, H, D, M)
        Z = Z + phi_k  # (B, H, D)
        y = (phi_q[..., None, :] @ S).squeeze(-2) / ((phi_q * Z).sum(-1, keepdim=True) + self.eps)
        return y, (S, Z)
