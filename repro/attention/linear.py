"""Linear attention (the paper's Section 3.2): sim(q, k) = phi(q)^T phi(k), so

    V'_i = phi(Q_i)^T S / phi(Q_i)^T Z,  S = sum_j phi(K_j) V_j^T,  Z = sum_j phi(K_j),

with the sums over j <= i when causal. Its recurrent twin carries (S, Z) from token to token.
"""
import torch

from repro.attention.base import AttentionLayer
from repro.attention.feature_maps import EluFeatureMap
from repro.kernels.normalised import accumulation_dtype as _acc
from repro.kernels.normalised import causal_linear_attention
from repro.kernels.recurrent import LinearState, linear_attention_step, new_state

__all__ = ["LinearAttention", "LinearState"]


class LinearAttention(AttentionLayer):
    recurrent = True

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, feature_map=None, eps: float = 1e-6):
        super().__init__(d_model, n_heads, d_keys, d_values)
        self.feature_map = (feature_map or EluFeatureMap)(self.d_keys)
        self.eps = eps

    def attend(self, q, k, v, causal, key_padding_mask):
        # q and k are (B, N, H, D) projections seen as (B, H, N, D). A feature map that writes a
        # contiguous phi from any layout (elu + 1) takes them as they are; others get contiguous
        # copies, and so does every map under torch.compile: on such a layout torch's meta
        # function for elu's backward predicts other strides than its CPU kernel returns, which
        # breaks compiled (AOTAutograd) backward graphs.
        if not self.feature_map.contiguous_output or torch.compiler.is_compiling():
            q, k = q.contiguous(), k.contiguous()
        phi_q, phi_k = self.feature_map(q), self.feature_map(k)  # (B, H, N, F), contiguous
        if key_padding_mask is not None:
            phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)  # padded keys add nothing
        if causal:  # sums over j <= i: the kernel dispatcher picks the path
            return causal_linear_attention(phi_q, phi_k, v, self.eps)  # (B, H, N, M)
        acc = _acc(phi_q.dtype)
        phi_q, phi_k, v = phi_q.to(acc), phi_k.to(acc), v.to(acc)
        S = phi_k.transpose(-1, -2) @ v  # (B, H, F, M): sum_j phi(K_j) V_j^T
        Z = phi_k.sum(2)  # (B, H, F): sum_j phi(K_j)
        num = phi_q @ S  # (B, H, N, M)
        den = (phi_q @ Z[..., None])[..., 0]  # (B, H, N)
        return (num / (den[..., None] + self.eps)).to(v.dtype)

    def attend_step(self, q, k, v, state: LinearState | None):
        phi_q, phi_k = self.feature_map(q), self.feature_map(k)  # (B, H, F)
        if state is None:
            state = new_state(phi_q, v)  # S = 0 (B, H, F, M), Z = 0 (B, H, F)
        return linear_attention_step(phi_q, phi_k, v, state, self.eps), state  # the kernel picks the path
