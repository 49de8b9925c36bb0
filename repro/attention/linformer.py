"""Linformer (Wang et al., 2020): keys and values projected along the sequence to a fixed
length k by learned matrices E, F of shape (k, max_len), then softmax attention over those k:

    V'_i = softmax(Q_i (E K)^T / sqrt(D)) (F V),   O(N k) time and memory.

E and F are shared by the heads of a layer (the paper's headwise sharing; share_kv=True also
uses E for the values). A sequence of N <= max_len tokens uses the first N columns; a longer
one is refused with an error naming max_len, since there are no learned columns for it.
Padded keys and values are zeroed before the projection, so they add nothing to E K or F V:
a padded sequence gives its real tokens the same outputs as the unpadded one.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from repro.attention.noncausal import NonCausalAttention


class LinformerAttention(NonCausalAttention):
    config_name = "linformer"

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, proj_len: int = 256,
                 max_len: int = 8192, share_kv: bool = False, attention_dropout: float = 0.0):
        super().__init__(d_model, n_heads, d_keys, d_values)
        if proj_len < 1 or max_len < 1:
            raise ValueError(f"linformer: proj_len and max_len must be positive; got proj_len={proj_len}, "
                             f"max_len={max_len}")
        self.proj_len, self.max_len, self.attention_dropout = proj_len, max_len, attention_dropout
        # The paper's E = delta R with R_ij ~ N(0, 1/k): a Johnson-Lindenstrauss projection at init.
        self.E = nn.Parameter(torch.randn(proj_len, max_len) / math.sqrt(proj_len))  # (k, max_len)
        self.F = None if share_kv else nn.Parameter(torch.randn(proj_len, max_len) / math.sqrt(proj_len))

    def attend_bidirectional(self, q, k, v, key_padding_mask):
        n = q.shape[-2]
        if n > self.max_len:
            raise ValueError(f"linformer: sequence length {n} exceeds max_len={self.max_len}, the length its "
                             f"projections E, F were built for; set attention max_len >= {n}")
        if key_padding_mask is not None:
            pad = key_padding_mask[:, None, :, None]  # (B, 1, N, 1)
            k, v = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
        E = self.E[:, :n]
        Fv = E if self.F is None else self.F[:, :n]
        k = torch.einsum("kn,bhnd->bhkd", E, k)  # (B, H, k, D)
        v = torch.einsum("kn,bhnm->bhkm", Fv, v)  # (B, H, k, M)
        p = self.attention_dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # (B, H, N, M)
