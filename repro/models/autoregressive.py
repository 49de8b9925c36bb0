"""A causal transformer over tokens, with step-by-step generation through the attention's
recurrent twin. Its step outputs equal its parallel forward on the same tokens: that equality
is the paper's title, and tests/models/test_model.py checks it."""
from dataclasses import dataclass, field

import torch
from torch import nn

from repro.models.transformer import Transformer, sinusoid


@dataclass
class GenerationState:
    position: int = 0
    layers: list = field(default_factory=list)


EMBEDDINGS = ("sum", "concat")


class AutoregressiveTransformer(nn.Module):
    """tokens (B, N) -> outputs (B, N, d_out); output i sees tokens 0..i only.

    The input at position i: embedding="sum" adds a d_model token embedding and a d_model
    sinusoidal position encoding (Vaswani et al.); "concat" concatenates a d_model/2 token
    embedding with a d_model/2 sinusoidal encoding, [embed(t_i), pe_i], as the authors' copy and
    image scripts do."""

    def __init__(self, attention, n_tokens: int, d_out: int | None = None, n_layers: int = 4,
                 d_model: int = 256, n_heads: int = 8, d_ff: int = 1024, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False, final_norm: bool = True,
                 embedding: str = "sum", embedding_dropout: float | None = None):
        super().__init__()
        if embedding not in EMBEDDINGS:
            raise ValueError(f"model: unknown embedding {embedding!r}; valid: {', '.join(EMBEDDINGS)}")
        if embedding == "concat" and d_model % 4:
            raise ValueError(f"model: embedding=concat splits d_model in two sinusoid halves; "
                             f"d_model must be a multiple of 4, got {d_model}")
        self.d_model, self.embedding = d_model, embedding
        self.d_position = d_model // 2 if embedding == "concat" else d_model  # width of the position encoding
        self.embed = nn.Embedding(n_tokens, d_model - self.d_position if embedding == "concat" else d_model)
        # dropout on the input (embedding + position) before the first layer; None: `dropout`. The
        # authors' scripts have none there (their position encoding's dropout defaults to 0), and
        # the paper presets follow them (conf/model/default.yaml: embedding_dropout 0.0)
        self.dropout = nn.Dropout(dropout if embedding_dropout is None else embedding_dropout)
        self.encoder = Transformer(attention, n_layers, d_model, n_heads, d_ff, dropout, activation,
                                   norm_first, final_norm)
        self.head = nn.Linear(d_model, d_out or n_tokens)

    def _input(self, embedded, pe):
        """Token embeddings (..., d_embed) and position encodings (..., d_position) -> (..., d_model)."""
        if self.embedding == "concat":
            return torch.cat([embedded, pe.expand(*embedded.shape[:-1], -1)], -1)
        return embedded + pe

    def forward(self, tokens, key_padding_mask=None):
        n = tokens.shape[1]
        x = self.embed(tokens)  # (B, N, d_embed)
        x = self._input(x, sinusoid(torch.arange(n, device=tokens.device), self.d_position).to(x.dtype))
        x = self.encoder(self.dropout(x), causal=True, key_padding_mask=key_padding_mask)
        return self.head(x)

    @torch.no_grad()
    def step(self, tokens, state: GenerationState | None = None):
        """tokens (B,) at the next position -> outputs (B, d_out), new state."""
        state = state or GenerationState()
        x = self._input(self.embed(tokens), self._position(state.position, tokens.device))  # (B, d_model)
        x, layers = self.encoder.step(self.dropout(x), state.layers or None)
        return self.head(x), GenerationState(state.position + 1, layers)

    def _position(self, i, device):
        """Row i of a table of position encodings, grown by doubling (no length limit). It starts
        long enough for a CIFAR-10 image (3072 values), so a compiled step is not recompiled
        for a bigger table in the middle of one. A position held as a tensor (a CUDA graph's
        step, repro.models.generate.GraphedSteps) is read on the device from the table as it
        is: the graph's maker grows it first."""
        table = getattr(self, "_pe", None)
        dtype = self.embed.weight.dtype
        if isinstance(i, torch.Tensor):
            return table.index_select(0, i.reshape(1))[0]
        if table is None or table.shape[0] <= i or table.device != device or table.dtype != dtype:
            n = max(4096, 2 * i + 2)
            self._pe = table = sinusoid(torch.arange(n, device=device), self.d_position).to(dtype)
        return table[i]
