"""Random Feature Attention (Peng et al., ICLR 2021).

Queries and keys are normalised to unit length, so exp(q.k / sigma^2) is proportional to the
Gaussian kernel exp(-|q - k|^2 / (2 sigma^2)), which random Fourier features estimate:

    phi(x) = [sin(W x / sigma), cos(W x / sigma)] / sqrt(F),   W: (F, D) ~ N(0, 1),

with a learned sigma per head. These features can be negative, so the normaliser
phi(q)^T Z is clamped from below at eps (RFA's features carry no positivity guarantee).

The optional gate (RFA-Gate, a learned recency bias) makes the state a decayed sum:
    g_t = sigmoid(w_g . x_t + b_g)        (one gate per head and token)
    S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T,   Z_t = g_t Z_{t-1} + (1 - g_t) phi(k_t).
Its parallel form, out_i = sum_{j<=i} exp(sum_{l=j+1..i} log g_l) (1 - g_j) (phi(q_i).phi(k_j)) v_j,
is computed chunk by chunk (repro.kernels.gated_causal_dot_product, one decay per step):
O(N (C + F M / C)) memory, never (N, N).
Without the gate, causal attention goes through repro.kernels.causal_dot_product.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from repro.attention.base import AttentionLayer
from repro.kernels import causal_dot_product, gated_causal_dot_product
from repro.kernels.plumbing.dtypes import accumulation_dtype


@dataclass
class RFAState:
    S: torch.Tensor  # (B, H, 2F, M)
    Z: torch.Tensor  # (B, H, 2F)


class RFAAttention(AttentionLayer):
    recurrent = True

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, n_features: int = 64,
                 gate: bool = True, sigma: float = 1.0, learn_sigma: bool = True, redraw: bool = True,
                 chunk_size: int = 64, eps: float = 1e-6):
        super().__init__(d_model, n_heads, d_keys, d_values)
        if n_features < 1 or sigma <= 0 or chunk_size < 1:
            raise ValueError(f"rfa: n_features and chunk_size must be >= 1 and sigma > 0; "
                             f"got n_features={n_features}, chunk_size={chunk_size}, sigma={sigma}")
        self.n_features, self.gated, self.redraw, self.chunk_size, self.eps = n_features, gate, redraw, chunk_size, eps
        log_sigma = torch.full((n_heads, 1, 1), float(sigma)).log()  # broadcasts over (B, H, N, D)
        self.log_sigma = nn.Parameter(log_sigma) if learn_sigma else nn.Buffer(log_sigma)
        self.gate = nn.Linear(d_model, n_heads) if gate else None
        # W per head; fixed in eval, redrawn every training pass when redraw=True (as RFA does).
        self.register_buffer("omega", torch.randn(n_heads, n_features, self.d_keys))
        self._log_g = None  # the gate of the current forward, (B, H, N); set by forward only

    def phi(self, x):
        """(B, H, [N,] D) -> (B, H, [N,] 2F), computed in fp32."""
        x = F.normalize(x.to(accumulation_dtype(x.dtype)), dim=-1)
        w = self.omega.to(x.dtype) / self.log_sigma.to(x.dtype).exp()  # (H, F, D)
        proj = torch.einsum("bhnd,hfd->bhnf", x, w) if x.dim() == 4 else torch.einsum("bhd,hfd->bhf", x, w)
        return torch.cat([proj.sin(), proj.cos()], -1) * self.n_features ** -0.5

    def forward(self, x, causal: bool = False, key_padding_mask=None):
        if self.gated and not causal:
            raise ValueError("rfa: the gate is a recency bias for causal attention; use causal=True or gate=false")
        if self.training and self.redraw:
            self.omega.normal_()
        if self.gated:  # attend() reads it; passed through the module because attend sees only q, k, v
            self._log_g = F.logsigmoid(self.gate(x).float()).transpose(1, 2)  # (B, H, N)
        try:
            return super().forward(x, causal=causal, key_padding_mask=key_padding_mask)
        finally:
            self._log_g = None

    def attend(self, q, k, v, causal, key_padding_mask):
        dtype, acc = v.dtype, accumulation_dtype(v.dtype)
        q, k, v = self.phi(q), self.phi(k), v.to(acc)  # (B, H, N, 2F), (B, H, N, M)
        if self.gated:
            if self._log_g is None:
                raise ValueError("rfa: with gate=true call the layer itself (layer(x, ...)), which computes the gate "
                                 "from x; attend() alone has no gate")
            log_g = self._log_g.to(acc)
            k = k * (-torch.expm1(log_g))[..., None]  # (1 - g_j) phi(k_j), 1 - g as -expm1(log g)
        keep = None
        if key_padding_mask is not None:
            keep = ~key_padding_mask[:, None, :]  # (B, 1, N)
            k = k * keep[..., None]
        ones = torch.ones_like(v[..., :1])
        vz = torch.cat([v, ones], -1)  # the last column accumulates Z
        if causal and self.gated:
            if keep is not None:  # padding neither adds nor decays
                log_g = log_g * keep
            out = gated_causal_dot_product(q, k, vz, log_g, chunk_size=self.chunk_size)
        elif causal:
            out = causal_dot_product(q, k, vz)
        else:
            out = q @ (k.transpose(-1, -2) @ vz)
        num, den = out[..., :-1], out[..., -1:]
        return (num / den.clamp_min(self.eps)).to(dtype)

    def step(self, x, state=None):
        if self.gated:
            self._log_g = F.logsigmoid(self.gate(x).float())  # (B, H)
        try:
            return super().step(x, state)
        finally:
            self._log_g = None

    def attend_step(self, q, k, v, state: RFAState | None):
        dtype, acc = v.dtype, accumulation_dtype(v.dtype)
        q, k, v = self.phi(q), self.phi(k), v.to(acc)  # (B, H, 2F), (B, H, M)
        if state is None:
            state = RFAState(k.new_zeros(*k.shape, v.shape[-1]), k.new_zeros(k.shape))
        kv = k[..., :, None] * v[..., None, :]
        if self.gated:
            g = self._log_g.to(acc).exp()[..., None]  # (B, H, 1)
            state.S.mul_(g[..., None]).add_((1 - g)[..., None] * kv)
            state.Z.mul_(g).add_((1 - g) * k)
        else:
            state.S += kv
            state.Z += k
        num = (q[..., None, :] @ state.S)[..., 0, :]  # (B, H, M)
        den = (q * state.Z).sum(-1, keepdim=True)
        return (num / den.clamp_min(self.eps)).to(dtype), state
