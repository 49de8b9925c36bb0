"""Long-Short Transformer (Zhu et al., 2021), non-causal form: each query attends, in one
softmax, to

  * short-term: the keys of its segment of `window` tokens and window/2 tokens either side,
  * long-range: r keys and values summarised by a dynamic projection of the whole sequence,
        P = softmax_N(K W_P)  (N, r, per head),  K_bar = P^T K,  V_bar = P^T V,

with DualLN: separate LayerNorms for the long-range and the short-term keys/values, whose
scales differ. O(N (2 window + r)) time and memory. Padded keys are out of both the window and
P's softmax over the sequence, so a padded sequence gives its real tokens the outputs of the
unpadded one.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from repro.attention.blocks import block_positions, gather_blocks, n_blocks, neighbour_index, pad_to_blocks
from repro.attention.noncausal import NonCausalAttention, masked_softmax


class LongShortAttention(NonCausalAttention):
    config_name = "longshort"

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, window: int = 128, rank: int = 64,
                 dual_ln: bool = True, attention_dropout: float = 0.0):
        super().__init__(d_model, n_heads, d_keys, d_values)
        if window < 2 or rank < 1:
            raise ValueError(f"longshort: need window >= 2 and rank >= 1; got window={window}, rank={rank}")
        self.window, self.rank, self.attention_dropout = window, rank, attention_dropout
        self.W_P = nn.Parameter(torch.randn(n_heads, self.d_keys, rank) / math.sqrt(self.d_keys))  # (H, D, r)
        ln = (lambda dim: nn.LayerNorm(dim)) if dual_ln else (lambda dim: nn.Identity())
        # DualLN; keys and values get their own norms (their widths may differ).
        self.ln_long_k, self.ln_long_v = ln(self.d_keys), ln(self.d_values)
        self.ln_short_k, self.ln_short_v = ln(self.d_keys), ln(self.d_values)

    def attend_bidirectional(self, q, k, v, key_padding_mask):
        (_, _, n, d), w = q.shape, self.window
        real = None if key_padding_mask is None else ~key_padding_mask  # (B, N)

        # Long-range: a softmax over the sequence (the real tokens) for each of the r rows of P.
        s = torch.einsum("bhnd,hdr->bhnr", k, self.W_P)  # (B, H, N, r)
        P = masked_softmax(s, None if real is None else real[:, None, :, None], dim=-2)
        k_long = self.ln_long_k(P.transpose(-1, -2) @ k)  # (B, H, r, D)
        v_long = self.ln_long_v(P.transpose(-1, -2) @ v)  # (B, H, r, M)

        # Short-term: segment i's queries see keys in [i w - w/2, (i + 1) w + w/2), gathered from
        # blocks i-1, i, i+1 and cut to that span.
        nb, half = n_blocks(n, w), w // 2
        q = pad_to_blocks(q * d ** -0.5, w)
        k_s, v_s = pad_to_blocks(self.ln_short_k(k), w), pad_to_blocks(self.ln_short_v(v), w)
        idx, valid = neighbour_index(nb, 1, q.device)  # (nb, 3)
        pos = block_positions(idx, w)  # (nb, 3 w)
        start = torch.arange(nb, device=q.device)[:, None] * w
        keep = valid.repeat_interleave(w, 1) & (pos >= start - half) & (pos < start + w + half) & (pos < n)
        keep = keep[None] if real is None else keep & pad_to_blocks(real, w, dim=1)[:, pos]  # (B, nb, 3 w)

        qb = q.unflatten(2, (nb, w))  # (B, H, nb, w, D)
        logits = torch.cat([qb @ k_long[:, :, None].transpose(-1, -2),  # (B, H, nb, w, r)
                            qb @ gather_blocks(k_s, idx).transpose(-1, -2)], -1)  # (B, H, nb, w, r + 3 w)
        keep = torch.cat([keep.new_ones(*keep.shape[:-1], self.rank), keep], -1)[:, None, :, None, :]
        p = F.dropout(masked_softmax(logits, keep), self.attention_dropout, self.training)
        y = p[..., :self.rank] @ v_long[:, :, None] + p[..., self.rank:] @ gather_blocks(v_s, idx)  # (B, H, nb, w, M)
        return y.flatten(2, 3)[:, :, :n]
