"""Local (sliding-window) softmax attention: query i attends to the `window` most recent
positions i - window < j <= i when causal, |i - j| < window otherwise. The sequence is cut
into blocks of `window` tokens; each block scores itself and its neighbours only, so memory
is O(N * window). The recurrent twin keeps a rolling cache of the last `window` keys and
values (a ring buffer: softmax does not care about the order of its keys).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from repro.attention.base import AttentionLayer
from repro.kernels.plumbing.dtypes import accumulation_dtype


@dataclass
class WindowCache:
    k: torch.Tensor  # (B, H, window, D)
    v: torch.Tensor  # (B, H, window, M)
    length: int = 0  # tokens seen so far; slot t % window holds token t


class LocalAttention(AttentionLayer):
    recurrent = True

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, window: int = 64):
        super().__init__(d_model, n_heads, d_keys, d_values)
        if window < 1:
            raise ValueError(f"local: window must be >= 1; got {window}")
        self.window = window

    def attend(self, q, k, v, causal, key_padding_mask):
        b, h, n, d = q.shape
        w = self.window
        pad = (-n) % w
        dtype, acc = v.dtype, accumulation_dtype(q.dtype)
        q, k, v = (F.pad(t, (0, 0, 0, pad)).to(acc).unflatten(2, (-1, w)) for t in (q, k, v))  # (B, H, nb, w, X)
        nb = q.shape[2]
        valid = torch.arange(n + pad, device=q.device) < n
        if key_padding_mask is not None:
            valid = valid & ~F.pad(key_padding_mask, (0, pad), value=True)[:, None, :]  # (B, 1, Np)
        valid = valid.expand(b, h, n + pad).unflatten(2, (nb, w))  # (B, H, nb, w)
        pos = torch.arange(n + pad, device=q.device).unflatten(0, (nb, w))  # (nb, w)
        shifts = (1, 0) if causal else (1, 0, -1)  # previous block, own block[, next block]

        def neighbours(t, fill):  # (B, H, nb, w, ...) -> (B, H, nb, len(shifts) * w, ...)
            parts = []
            for s in shifts:
                r = t.roll(s, 2)
                edge = slice(0, s) if s > 0 else slice(nb + s, nb)  # blocks whose neighbour wrapped round
                if s:
                    r[:, :, edge] = fill
                parts.append(r)
            return torch.cat(parts, 3)

        kb, vb = neighbours(k, 0.0), neighbours(v, 0.0)
        kvalid = neighbours(valid, False)  # (B, H, nb, S w)
        kpos = torch.cat([pos.roll(s, 0) for s in shifts], 1)  # (nb, S w); wrapped ones are masked anyway
        dist = pos[:, :, None] - kpos[:, None, :]  # (nb, w, S w): i - j
        near = (dist >= 0) & (dist < w) if causal else dist.abs() < w
        mask = kvalid[..., None, :] & near  # (B, H, nb, w, S w)
        scores = (q @ kb.transpose(-1, -2)) * d ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        # A row with no key at all (a padded query): zero weights, not NaN.
        attn = torch.softmax(scores.masked_fill(~mask.any(-1, keepdim=True), 0.0), -1) * mask.any(-1, keepdim=True)
        out = attn @ vb  # (B, H, nb, w, M)
        return out.flatten(2, 3)[:, :, :n].to(dtype)

    def attend_step(self, q, k, v, state: WindowCache | None):
        if state is None:
            b, h = q.shape[:2]
            state = WindowCache(k.new_zeros(b, h, self.window, k.shape[-1]),
                                v.new_zeros(b, h, self.window, v.shape[-1]))
        slot = state.length % self.window
        state.k[:, :, slot] = k
        state.v[:, :, slot] = v
        state.length += 1
        m = min(state.length, self.window)
        y = F.scaled_dot_product_attention(q[:, :, None], state.k[:, :, :m], state.v[:, :, :m])
        return y[:, :, 0], state
