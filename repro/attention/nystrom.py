"""Nystromformer (Xiong et al., 2021): softmax attention approximated through m landmarks,
the segment means of the queries (Q~) and keys (K~):

    V' = softmax(Q K~^T / sqrt(D)) A^+ softmax(Q~ K^T / sqrt(D)) V,   A = softmax(Q~ K~^T / sqrt(D)),

with A^+ the Moore-Penrose pseudo-inverse by the paper's iteration, O(N m) time and memory,
plus an optional depthwise convolution of V along the sequence (the paper's skip connection).

Segments are taken over each sequence's real tokens: the j-th real token of a sequence of L
goes to landmark floor(j m / L). So any N works (no divisibility needed), padded tokens are in
no landmark, and a padded sequence gives its real tokens the outputs of the unpadded one. When
L < m some landmarks are empty and take no part; with L = m every token is its own landmark
and the formula is exact softmax attention (up to the pseudo-inverse iteration's tolerance).
"""
import torch
from torch import nn

from repro.attention.noncausal import NonCausalAttention, masked_softmax
from repro.kernels.plumbing.dtypes import accumulation_dtype


def iterative_pinv(A, iterations: int):
    """Moore-Penrose pseudo-inverse of each (m, m) matrix in A (..., m, m) by the iteration of
    Razavi et al. used in the Nystromformer paper:
        Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4,   Z_0 = A^T / (||A||_1 ||A||_inf).
    The norms are each matrix's own, so one sequence of a batch never changes another's output."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    norm = A.abs().sum(-2).amax(-1) * A.abs().sum(-1).amax(-1)  # ||A||_1 ||A||_inf, (...)
    Z = A.transpose(-1, -2) / norm.clamp_min(torch.finfo(A.dtype).tiny)[..., None, None]
    for _ in range(iterations):
        AZ = A @ Z
        Z = 0.25 * Z @ (13 * eye - AZ @ (15 * eye - AZ @ (7 * eye - AZ)))
    return Z


def segment_means(real, m: int):
    """Averaging weights of the landmarks: real bool (B, N) -> W (B, m, N) with W @ x the mean
    of each landmark's segment of real tokens, and nonempty bool (B, m)."""
    length = real.sum(-1, keepdim=True)  # (B, 1)
    rank = real.cumsum(-1) - 1  # (B, N): index among the real tokens
    seg = torch.div(rank.clamp_min(0) * m, length.clamp_min(1), rounding_mode="floor")  # (B, N) in [0, m)
    member = (seg[:, None, :] == torch.arange(m, device=real.device)[None, :, None]) & real[:, None, :]
    count = member.sum(-1)  # (B, m)
    return member / count.clamp_min(1)[..., None], count > 0


class NystromAttention(NonCausalAttention):
    config_name = "nystrom"

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, landmarks: int = 64,
                 pinv_iterations: int = 6, conv_kernel: int | None = 33):
        super().__init__(d_model, n_heads, d_keys, d_values)
        if landmarks < 1 or pinv_iterations < 1:
            raise ValueError(f"nystrom: landmarks and pinv_iterations must be >= 1; "
                             f"got landmarks={landmarks}, pinv_iterations={pinv_iterations}")
        if conv_kernel is not None and (conv_kernel < 1 or conv_kernel % 2 == 0):
            raise ValueError(f"nystrom: conv_kernel must be an odd positive size or null; got {conv_kernel}")
        self.landmarks, self.pinv_iterations = landmarks, pinv_iterations
        # Depthwise over the sequence, one filter per head shared by the value dims.
        self.conv = None if conv_kernel is None else nn.Conv2d(
            n_heads, n_heads, (conv_kernel, 1), padding=(conv_kernel // 2, 0), groups=n_heads, bias=False)

    def attend_bidirectional(self, q, k, v, key_padding_mask):
        (b, _, n, d), dtype = q.shape, v.dtype
        if key_padding_mask is None:
            real = torch.ones(b, n, dtype=torch.bool, device=q.device)
        else:
            real = ~key_padding_mask
            v = v.masked_fill(key_padding_mask[:, None, :, None], 0.0)  # also keeps them out of the conv
        skip = self.conv(v) if self.conv is not None else None  # (B, H, N, M)
        # Landmarks, the three kernels and the pseudo-inverse in fp32: the iteration diverges in bf16.
        acc = accumulation_dtype(q.dtype)
        q, k, v = q.to(acc) * d ** -0.5, k.to(acc), v.to(acc)
        W, nonempty = segment_means(real, self.landmarks)  # (B, m, N), (B, m)
        W = W.to(acc)[:, None]  # (B, 1, m, N)
        q_l, k_l = W @ q, W @ k  # (B, H, m, D)
        col = nonempty[:, None, None, :]  # (B, 1, 1, m): landmarks that exist
        row = nonempty[:, None, :, None]  # (B, 1, m, 1)
        F1 = masked_softmax(q @ k_l.transpose(-1, -2), col)  # (B, H, N, m)
        A = masked_softmax(q_l @ k_l.transpose(-1, -2), row & col)  # (B, H, m, m)
        B3 = masked_softmax(q_l @ k.transpose(-1, -2), row & real[:, None, None, :])  # (B, H, m, N)
        y = (F1 @ (iterative_pinv(A, self.pinv_iterations) @ (B3 @ v))).to(dtype)  # (B, H, N, M)
        return y + skip if skip is not None else y
