"""Performer's FAVOR+ (Choromanski et al., 2021): linear attention whose feature map
approximates the softmax kernel, exp(q.k / sqrt(D)) ~ phi(q)^T phi(k), with positive
orthogonal random features

    phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(F),   x' = x / D^(1/4),

W: (F, D), rows drawn in blocks of D orthogonal directions with chi-distributed norms (each row
then has the norm of a Gaussian vector, so the estimate stays unbiased, with lower variance
than i.i.d. rows).

Numerical stability: completing the square, W_i x' - |x'|^2/2 = |W_i|^2/2 - |x' - W_i|^2/2
<= |W_i|^2/2, so every feature is bounded by a constant of the draw, whatever the input, and
no data-dependent maximum is subtracted. (The usual trick, subtracting the maximum over all
keys, would let future keys set the scale of causal outputs and break recurrent == parallel.)
Features are computed in fp32 and returned in the input's dtype.

The map plugs into LinearAttention (causal through causal_dot_product, recurrent twin with
(S, Z)). PerformerAttention adds the redraw policy: new features every `redraw_every`
training forwards; never in eval mode, so evaluation is deterministic.
"""
import math
from functools import partial

import torch

from repro.attention.feature_maps import FeatureMap
from repro.attention.linear import LinearAttention
from repro.kernels.plumbing.dtypes import accumulation_dtype


def orthogonal_gaussian(n_rows: int, dim: int, device=None):
    """(n_rows, dim): blocks of `dim` orthogonal rows, each row scaled to the norm of an
    independent standard Gaussian vector in R^dim."""
    blocks = []
    for _ in range(math.ceil(n_rows / dim)):
        q, _ = torch.linalg.qr(torch.randn(dim, dim, device=device))
        blocks.append(q.T)
    w = torch.cat(blocks)[:n_rows]
    return w * torch.randn(n_rows, dim, device=device).norm(dim=-1, keepdim=True)


class FavorFeatureMap(FeatureMap):
    def __init__(self, head_dim: int, n_features: int = 128, orthogonal: bool = True):
        super().__init__(head_dim)
        if n_features < 1:
            raise ValueError(f"performer: n_features must be >= 1; got {n_features}")
        self.n_features, self.orthogonal = n_features, orthogonal
        self.register_buffer("omega", torch.empty(n_features, head_dim))  # W, saved with the model
        self.new_feature_map()

    @torch.no_grad()
    def new_feature_map(self):
        device = self.omega.device
        w = (orthogonal_gaussian(self.n_features, self.head_dim, device) if self.orthogonal
             else torch.randn(self.n_features, self.head_dim, device=device))
        self.omega.copy_(w)

    def forward(self, x):
        """(..., D) -> (..., F), positive."""
        acc = accumulation_dtype(x.dtype)
        xs = x.to(acc) * self.head_dim ** -0.25  # (..., D)
        # The exponent W x' - |x'|^2 / 2 - ln(F) / 2 by one matmul, [x', -|x'|^2 / 2 - ln(F) / 2]
        # against [W, 1], then exp in place: two passes over the (..., F) features (and one, a
        # product, in the backward) where the formula as written takes four (and five): those
        # passes were most of Performer's time on CPU, and the linear layer runs phi again in
        # its backward (repro.attention.linear).
        shift = (xs * xs).sum(-1, keepdim=True).mul_(-0.5).sub_(0.5 * math.log(self.n_features))  # (..., 1)
        w = torch.cat([self.omega.to(acc), self.omega.new_ones(self.n_features, 1, dtype=acc)], 1)  # (F, D + 1)
        phi = (torch.cat([xs, shift], -1) @ w.T).exp_()  # (..., F)
        return phi.to(x.dtype)


class PerformerAttention(LinearAttention):
    """LinearAttention with FavorFeatureMap and a redraw schedule (null: fixed features)."""

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, n_features: int = 128,
                 orthogonal: bool = True, redraw_every: int | None = 1000, eps: float = 1e-6,
                 workspace_mb: float | None = None):
        if redraw_every is not None and redraw_every < 1:
            raise ValueError(f"performer: redraw_every must be null or >= 1; got {redraw_every}")
        super().__init__(d_model, n_heads, d_keys, d_values, eps=eps, workspace_mb=workspace_mb,
                         feature_map=partial(FavorFeatureMap, n_features=n_features, orthogonal=orthogonal))
        self.redraw_every = redraw_every
        self.register_buffer("training_passes", torch.zeros((), dtype=torch.long))

    def forward(self, x, causal: bool = False, key_padding_mask=None):
        if self.training and self.redraw_every:
            if self.training_passes.item() % self.redraw_every == 0 and self.training_passes.item() > 0:
                self.feature_map.new_feature_map()
            self.training_passes += 1
        return super().forward(x, causal=causal, key_padding_mask=key_padding_mask)
