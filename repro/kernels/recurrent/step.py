"""The recurrent step of causal linear attention (the paper's RNN form, eq. 18-20):

    S_i = S_{i-1} + phi(k_i) v_i^T,  Z_i = Z_{i-1} + phi(k_i),  v'_i = phi(q_i)^T S_i / (phi(q_i)^T Z_i + eps)

by the fastest correct path for the inputs: the CuPy kernel (one launch for the whole step), on
a CPU the state kept as one buffer [S | Z]^T so that one batched product updates both and one
reads the numerator and the normaliser together, else the formula as written. The sums run in
fp32 (fp64 for fp64) whatever the inputs' dtype. The attention layer (repro.attention.linear)
computes phi and calls this."""
from dataclasses import dataclass

import torch

from repro.kernels import cupy_for
from repro.kernels.plumbing.dtypes import accumulation_dtype


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


def new_state(phi_q, v) -> LinearState:
    """The zero state for (B, H, F) features and (B, H, M) values, laid out for their device."""
    acc = accumulation_dtype(phi_q.dtype)
    if phi_q.is_cuda:
        S = phi_q.new_zeros(*phi_q.shape, v.shape[-1], dtype=acc)  # (B, H, F, M)
        return LinearState(S, phi_q.new_zeros(phi_q.shape, dtype=acc))
    b, h, f, m = *phi_q.shape, v.shape[-1]
    sz = phi_q.new_zeros(b, h, m + 1, f, dtype=acc)
    return LinearState(sz[..., :m, :].transpose(-1, -2), sz[..., m, :], sz, phi_q.new_ones(b, h, m + 1, 1, dtype=acc))


def linear_attention_step(phi_q, phi_k, v, state: LinearState, eps: float):
    """(B, H, F), (B, H, F), (B, H, M), state -> v'_i (B, H, M) in v's dtype; the state is
    updated in place."""
    if state.SZ is not None:
        return _step_on_buffer(phi_q, phi_k, v, state, eps)
    if cb := cupy_for("recurrent", phi_q, phi_k, v, state.S, state.Z):
        return cb.linear_attention_step(phi_q, phi_k, v, state.S, state.Z, eps)  # one launch
    dtype, acc = v.dtype, accumulation_dtype(phi_q.dtype)
    phi_q, phi_k, v = phi_q.to(acc), phi_k.to(acc), v.to(acc)
    state.S += phi_k[..., :, None] * v[..., None, :]
    state.Z += phi_k
    num = (phi_q[..., None, :] @ state.S)[..., 0, :]  # (B, H, M)
    den = (phi_q * state.Z).sum(-1, keepdim=True)
    return (num / (den + eps)).to(dtype)


def _step_on_buffer(phi_q, phi_k, v, state: LinearState, eps: float):
    """The step on [S | Z]^T: [S | Z]^T += [v, 1] phi(k)^T; [num | den] = [S | Z]^T phi(q)."""
    b, h, m1, f = state.SZ.shape
    acc = state.SZ.dtype
    if torch.compiler.is_compiling():
        # Compiled, the same as elementwise loops over the state (B H (M + 1) F values) that
        # inductor fuses with phi and the division into one kernel; batched matmuls of
        # these sizes would be separate library calls around it.
        v1 = torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], -1).to(acc)  # (B, H, M + 1)
        state.SZ.add_(v1[..., :, None] * phi_k.to(acc)[..., None, :])
        out = (state.SZ * phi_q.to(acc)[..., None, :]).sum(-1)  # (B, H, M + 1)
    else:
        sz = state.SZ.view(b * h, m1, f)
        state.v1[..., :-1, 0].copy_(v)  # [v, 1], cast to the accumulation dtype
        sz.baddbmm_(state.v1.view(b * h, m1, 1), phi_k.reshape(b * h, 1, f).to(acc))
        out = torch.bmm(sz, phi_q.reshape(b * h, f, 1).to(acc)).view(b, h, m1)  # (B, H, M + 1)
    return (out[..., :-1] / (out[..., -1:] + eps)).to(v.dtype)
