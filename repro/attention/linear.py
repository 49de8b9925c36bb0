"""Linear attention (the paper's Section 3.2): sim(q, k) = phi(q)^T phi(k), so

    V'_i = phi(Q_i)^T S / phi(Q_i)^T Z,  S = sum_j phi(K_j) V_j^T,  Z = sum_j phi(K_j),

with the sums over j <= i when causal. Its recurrent twin carries (S, Z) from token to token.
"""
from dataclasses import dataclass

import torch

from repro.attention.base import AttentionLayer
from repro.attention.feature_maps import EluFeatureMap
from repro.kernels import cupy_for
from repro.kernels.normalised import accumulation_dtype as _acc
from repro.kernels.normalised import causal_linear_attention


@dataclass
class LinearState:
    S: torch.Tensor  # (B, H, F, M)
    Z: torch.Tensor  # (B, H, F)
    # On CPU, S and Z are views of one buffer SZ = [S | Z]^T (B, H, M + 1, F) with Z as its last
    # row, so one batched outer product with [v, 1] updates both and one product with phi(q)
    # gives the numerator and the normaliser together; v1 holds [v, 1] between steps. F is the
    # contiguous axis: compiled, the update and the readout are loops over rows of F values.
    SZ: torch.Tensor | None = None
    v1: torch.Tensor | None = None


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
        q, k = self.feature_map(q), self.feature_map(k)  # (B, H, F)
        if state is None:
            acc = _acc(q.dtype)
            if q.is_cuda:
                state = LinearState(q.new_zeros(*q.shape, v.shape[-1], dtype=acc), q.new_zeros(q.shape, dtype=acc))
            else:
                b, h, f, m = *q.shape, v.shape[-1]
                sz = q.new_zeros(b, h, m + 1, f, dtype=acc)
                state = LinearState(sz[..., :m, :].transpose(-1, -2), sz[..., m, :], sz,
                                    q.new_ones(b, h, m + 1, 1, dtype=acc))
        if state.SZ is not None:
            return self._fused_step(q, k, v, state), state
        if cb := cupy_for("step_unsupported_reason", q, k, v, state.S, state.Z):
            return cb.linear_attention_step(q, k, v, state.S, state.Z, self.eps), state  # one launch
        dtype, acc = v.dtype, _acc(q.dtype)
        q, k, v = q.to(acc), k.to(acc), v.to(acc)
        state.S += k[..., :, None] * v[..., None, :]
        state.Z += k
        num = (q[..., None, :] @ state.S)[..., 0, :]  # (B, H, M)
        den = (q * state.Z).sum(-1, keepdim=True)
        return (num / (den + self.eps)).to(dtype), state

    def _fused_step(self, q, k, v, state: LinearState):
        """The RNN step on [S | Z]^T: [S | Z]^T += [v, 1] phi(k)^T; [num | den] = [S | Z]^T phi(q)."""
        b, h, m1, f = state.SZ.shape
        acc = state.SZ.dtype
        if torch.compiler.is_compiling():
            # Compiled, the same as elementwise loops over the state (B H (M + 1) F values) that
            # inductor fuses with phi and the division into one kernel; batched matmuls of
            # these sizes would be separate library calls around it.
            v1 = torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], -1).to(acc)  # (B, H, M + 1)
            state.SZ.add_(v1[..., :, None] * k.to(acc)[..., None, :])
            out = (state.SZ * q.to(acc)[..., None, :]).sum(-1)  # (B, H, M + 1)
        else:
            sz = state.SZ.view(b * h, m1, f)
            state.v1[..., :-1, 0].copy_(v)  # [v, 1], cast to the accumulation dtype
            sz.baddbmm_(state.v1.view(b * h, m1, 1), k.reshape(b * h, 1, f).to(acc))
            out = torch.bmm(sz, q.reshape(b * h, f, 1).to(acc)).view(b, h, m1)  # (B, H, M + 1)
        return (out[..., :-1] / (out[..., -1:] + self.eps)).to(v.dtype)
