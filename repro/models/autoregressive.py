"""A causal transformer over tokens, with step-by-step generation through the attention's
recurrent twin. Its step outputs equal its parallel forward on the same tokens: that equality
is the paper's title, and tests/test_model.py checks it."""
from dataclasses import dataclass, field

import torch
from torch import nn

from .transformer import Transformer, sinusoid


@dataclass
class GenerationState:
    position: int = 0
    layers: list = field(default_factory=list)


class AutoregressiveTransformer(nn.Module):
    """tokens (B, N) -> outputs (B, N, d_out); output i sees tokens 0..i only."""

    def __init__(self, attention, n_tokens: int, d_out: int | None = None, n_layers: int = 4,
                 d_model: int = 256, n_heads: int = 8, d_ff: int = 1024, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False, final_norm: bool = True):
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(n_tokens, d_model)
        self.dropout = nn.Dropout(dropout)
        self.encoder = Transformer(attention, n_layers, d_model, n_heads, d_ff, dropout, activation,
                                   norm_first, final_norm)
        self.head = nn.Linear(d_model, d_out or n_tokens)

    def forward(self, tokens, key_padding_mask=None):
        n = tokens.shape[1]
        x = self.embed(tokens)
        x = x + sinusoid(torch.arange(n, device=tokens.device), self.d_model).to(x.dtype)
        x = self.encoder(self.dropout(x), causal=True, key_padding_mask=key_padding_mask)
        return self.head(x)

    @torch.no_grad()
    def step(self, tokens, state: GenerationState | None = None):
        """tokens (B,) at the next position -> outputs (B, d_out), new state."""
        state = state or GenerationState()
        x = self.embed(tokens) + self._position(state.position, tokens.device)
        x, layers = self.encoder.step(self.dropout(x), state.layers or None)
        return self.head(x), GenerationState(state.position + 1, layers)

    def _position(self, i, device):
        """Row i of a table of position encodings, grown by doubling (no length limit). It starts
        long enough for a CIFAR-10 image (3072 values), so a compiled step is not recompiled
        for a bigger table in the middle of one."""
        table = getattr(self, "_pe", None)
        dtype = self.embed.weight.dtype
        if table is None or table.shape[0] <= i or table.device != device or table.dtype != dtype:
            n = max(4096, 2 * i + 2)
            self._pe = table = sinusoid(torch.arange(n, device=device), self.d_model).to(dtype)
        return table[i]
