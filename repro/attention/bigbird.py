"""Local + global sparse attention: Longformer (Beltagy et al., 2020) and BigBird (Zaheer et
al., 2020) in one blocked implementation. Tokens are cut into blocks of `block`; a query in
block i attends to

  * the key blocks i - window .. i + window (the sliding window),
  * the first `global_tokens` tokens, which also attend to every token (global attention),
  * `random_blocks` further key blocks drawn outside the window (BigBird; 0 gives Longformer),

all in one softmax, each key at most once. Memory and time are O(N (2 window + 1 + random)
block + N global_tokens). The random pattern depends only on the number of blocks and a
per-layer seed (a buffer, saved with the model), so training and evaluation are deterministic.
With a window covering the sequence and no random blocks this is exactly softmax attention.
"""
import torch
import torch.nn.functional as F

from repro.attention.blocks import block_positions, gather_blocks, n_blocks, neighbour_index, pad_to_blocks
from repro.attention.noncausal import NonCausalAttention, masked_softmax


class BigBirdAttention(NonCausalAttention):
    config_name = "bigbird"

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, block: int = 64, window: int = 1,
                 global_tokens: int = 64, random_blocks: int = 2, attention_dropout: float = 0.0):
        super().__init__(d_model, n_heads, d_keys, d_values)
        if block < 1 or window < 0 or global_tokens < 0 or random_blocks < 0:
            raise ValueError(f"bigbird: need block >= 1 and window, global_tokens, random_blocks >= 0; "
                             f"got block={block}, window={window}, global_tokens={global_tokens}, "
                             f"random_blocks={random_blocks}")
        self.block, self.window, self.global_tokens = block, window, global_tokens
        self.random_blocks, self.attention_dropout = random_blocks, attention_dropout
        self.register_buffer("seed", torch.randint(2**31 - 1, ()))  # drawn from torch's RNG: differs per layer

    def random_index(self, nb: int, device=None):
        """The random key blocks of each query block: index (nb, r) and valid (nb, r); blocks
        inside the window are never drawn, and a row has fewer than r when too few remain."""
        r = min(self.random_blocks, nb)
        gen = torch.Generator().manual_seed(int(self.seed) * 100003 + nb)
        score = torch.rand(nb, nb, generator=gen)  # a random order of the key blocks, per query block
        i = torch.arange(nb)
        score[(i[:, None] - i[None, :]).abs() <= self.window] = -1.0
        top, idx = score.topk(r, dim=-1)
        return idx.to(device), (top >= 0).to(device)

    def key_index(self, nb: int, device=None):
        """All key blocks of each query block: window then random, (nb, J) index and valid."""
        idx, valid = neighbour_index(nb, self.window, device)
        if self.random_blocks:
            r_idx, r_valid = self.random_index(nb, device)
            idx, valid = torch.cat([idx, r_idx], 1), torch.cat([valid, r_valid], 1)
        return idx, valid

    def attend_bidirectional(self, q, k, v, key_padding_mask):
        (_, _, n, d), blk, g = q.shape, self.block, min(self.global_tokens, q.shape[2])
        nb = n_blocks(n, blk)
        real = None if key_padding_mask is None else pad_to_blocks(~key_padding_mask, blk, dim=1)  # (B, Np)
        q, k, v = (pad_to_blocks(t, blk) for t in (q * d ** -0.5, k, v))  # (B, H, Np, .)
        idx, valid = self.key_index(nb, q.device)  # (nb, J)
        pos = block_positions(idx, blk)  # (nb, J b)
        # A key takes part if its block is valid, it is not global (those come once, below),
        # it is inside the sequence and not padding.
        keep = valid.repeat_interleave(blk, 1) & (pos >= g) & (pos < n)  # (nb, J b)
        keep = keep[None] if real is None else keep & real[:, pos]  # (B or 1, nb, J b)
        keep = keep[:, None, :, None, :]  # (B, 1, nb, 1, J b)

        qb = q.unflatten(2, (nb, blk))  # (B, H, nb, b, D)
        logits = qb @ gather_blocks(k, idx).transpose(-1, -2)  # (B, H, nb, b, J b)
        if g:
            keep_g = torch.ones(1, g, dtype=torch.bool, device=q.device) if real is None else real[:, :g]
            logits = torch.cat([qb @ k[:, :, None, :g].transpose(-1, -2), logits], -1)  # (B, H, nb, b, g + J b)
            keep = torch.cat([keep_g[:, None, None, None, :].expand(*keep.shape[:-1], g), keep], -1)
        p = F.dropout(masked_softmax(logits, keep), self.attention_dropout, self.training)
        y = p[..., g:] @ gather_blocks(v, idx)  # (B, H, nb, b, M)
        if g:
            y = y + p[..., :g] @ v[:, :, None, :g]
        y = y.flatten(2, 3)[:, :, :n]  # (B, H, N, M)
        if not g:
            return y
        # Global queries see the whole sequence: (g, N) logits, O(g N) memory.
        keep_all = (torch.arange(k.shape[2], device=q.device) < n)[None] if real is None else real
        p_g = masked_softmax(q[:, :, :g] @ k.transpose(-1, -2), keep_all[:, None, None, :])  # (B, H, g, Np)
        y_g = F.dropout(p_g, self.attention_dropout, self.training) @ v  # (B, H, g, M)
        return torch.cat([y_g, y[:, :, g:]], 2)
