"""Retention (Sun et al. 2023, RetNet): linear attention with a fixed decay gamma_h per head and
no normaliser,

    S_t = gamma_h S_{t-1} + k_t v_t^T,   o_t = S_t^T q_t = sum_{j<=t} gamma_h^(t-j) (q_t . k_j) v_j,

keys scaled by D^-1/2, gamma_h = 1 - 2^(-5 - h) (RetNet's multi-scale default: h = 0 remembers ~32
tokens, the last head thousands), then a per-head GroupNorm and a swish gate as RetNet's
multi-scale retention: y = (swish(x W_G) * GroupNorm(o)) W_O. RetNet's xPos rotation of q and k is
left out: positions come from the model's embeddings, as for every attention of the suite.

Causal: the chunked decayed product (repro.kernels.gated_causal_dot_product, one decay per step).
Non-causal: the decay by distance, gamma^|t-j| (as the vision retentions use it), the causal
product plus the same product backwards in time, less the j = t term counted twice. Padding:
padded keys write nothing and padded positions decay nothing, so a padded batch equals its
sequences alone. The recurrent twin carries S (B, H, D, M).
"""
import math

import torch
import torch.nn.functional as F

from repro.attention.successors import SuccessorAttention, new_state
from repro.kernels import gated_causal_dot_product
from repro.kernels.plumbing.dtypes import accumulation_dtype


def retnet_gammas(n_heads: int) -> list[float]:
    return [1 - 2.0 ** (-5 - h) for h in range(n_heads)]


class Retention(SuccessorAttention):
    config_name = "retention"

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, gammas=None, norm: str = "layer",
                 output_gate: bool = True, chunk_size: int | None = None):
        super().__init__(d_model, n_heads, d_keys, d_values, norm=norm, output_gate=output_gate, chunk_size=chunk_size)
        gammas = retnet_gammas(n_heads) if gammas is None else [float(g) for g in gammas]
        if len(gammas) != n_heads or not all(0 < g <= 1 for g in gammas):
            raise ValueError(f"retention: gammas must be {n_heads} decays in (0, 1], one per head; got {gammas}")
        self.register_buffer("log_gamma", torch.tensor([math.log(g) for g in gammas], dtype=torch.float64))

    def _log_g(self, keep, shape, dtype, device):
        log_g = self.log_gamma.to(device, dtype)[:, None].expand(shape)  # (B, H, N)
        return log_g if keep is None else log_g * keep  # padding decays nothing

    def memory(self, q, k, v, extra, causal, keep):
        k = k * self.d_keys ** -0.5
        if keep is not None:
            k = k * keep[..., None]  # padded keys write nothing
        acc = accumulation_dtype(q.dtype)
        log_g = self._log_g(keep, q.shape[:3], acc, q.device)
        out = gated_causal_dot_product(q, k, v, log_g, chunk_size=self.chunk_size)  # decays kept in fp32
        if causal:
            return out
        flip = lambda t: t.flip(2)
        # backwards in time the decay between j and t is that of the steps after j up to t, in
        # reverse: the log decays shifted by one (step t's decay belongs to the pair (t - 1, t))
        back_log_g = F.pad(flip(log_g)[..., :-1], (1, 0))
        back = flip(gated_causal_dot_product(flip(q), flip(k), flip(v), back_log_g, chunk_size=self.chunk_size))
        return out + back - (q * k).sum(-1, keepdim=True) * v  # the j = t term, counted twice

    def memory_step(self, q, k, v, extra, state):
        dtype, acc = v.dtype, accumulation_dtype(q.dtype)
        q, k, v = q.to(acc), k.to(acc) * self.d_keys ** -0.5, v.to(acc)  # (B, H, D), (B, H, M)
        state = state or new_state(q, v)
        gamma = self.log_gamma.to(acc).exp()[:, None, None]  # (H, 1, 1)
        state.S = torch.addcmul(gamma * state.S, k[..., :, None], v[..., None, :])  # gamma S + k v^T
        return (q[..., None, :] @ state.S)[..., 0, :].to(dtype), state
