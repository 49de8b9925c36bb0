"""Speech encoders for CTC (the paper's Table 3): a non-causal transformer over filterbank
frames, running any attention, and the Bi-LSTM baseline. Both map padded features (B, T, F)
and their lengths to per-frame log-probabilities over blank + phonemes (B, T', C) and the
output lengths T'; padding never changes the outputs on real frames."""
import math

import torch
import torch.nn.functional as F
from torch import nn

from repro.models.transformer import Transformer, sinusoid


def padding_mask(lengths, n):
    return torch.arange(n, device=lengths.device)[None, :] >= lengths[:, None]   # (B, n) True at padding


class ConvSubsampling(nn.Module):
    """log2(factor) strided Conv1d + ReLU layers, each halving the frame rate (optional: the
    paper fed frames straight in). Padded frames are zeroed after every layer, so a padded
    batch gives the same outputs as each utterance alone."""

    def __init__(self, n_features: int, d_model: int, factor: int):
        super().__init__()
        if factor < 1 or factor & (factor - 1):
            raise ValueError(f"model.subsample={factor}: must be a power of two (1: no subsampling)")
        n = int(math.log2(factor))
        self.convs = nn.ModuleList(nn.Conv1d(n_features if i == 0 else d_model, d_model, 3, stride=2, padding=1)
                                   for i in range(n))
        self.proj = nn.Linear(n_features, d_model) if n == 0 else None

    def forward(self, x, lengths):
        if self.proj is not None:
            return self.proj(x), lengths
        x = x.transpose(1, 2)                                           # (B, F, T)
        for conv in self.convs:
            x = x.masked_fill(padding_mask(lengths, x.shape[-1])[:, None, :], 0.0)
            x, lengths = F.relu(conv(x)), (lengths - 1) // 2 + 1
        x = x.masked_fill(padding_mask(lengths, x.shape[-1])[:, None, :], 0.0)
        return x.transpose(1, 2), lengths                               # (B, T', d_model)


class CTCTransformer(nn.Module):
    """Frames -> (optional conv subsampling | linear) + sinusoidal positions -> the paper's
    transformer (non-causal, key-padding mask) -> linear -> log-softmax over blank + phonemes."""

    causal = False  # its attention sees the whole utterance (what a timing row's kernel is asked for)

    def __init__(self, attention, n_labels: int, n_features: int = 40, n_layers: int = 9, d_model: int = 192,
                 n_heads: int = 6, d_ff: int = 768, dropout: float = 0.1, activation: str = "relu",
                 norm_first: bool = False, final_norm: bool = True, subsample: int = 1):
        super().__init__()
        if attention is None:
            raise ValueError("model: the transformer encoder needs an attention (attention=<conf/attention>)")
        self.front = ConvSubsampling(n_features, d_model, subsample)
        self.dropout = nn.Dropout(dropout)
        self.encoder = Transformer(attention, n_layers, d_model, n_heads, d_ff, dropout, activation, norm_first,
                                   final_norm)
        self.out = nn.Linear(d_model, n_labels)
        self.d_model = d_model

    def forward(self, features, lengths):
        x, lengths = self.front(features, lengths)                      # (B, T', D)
        mask = padding_mask(lengths, x.shape[1])
        x = self.dropout(x + sinusoid(torch.arange(x.shape[1], device=x.device), self.d_model))
        x = self.encoder(x, causal=False, key_padding_mask=mask if mask.any() else None)
        return F.log_softmax(self.out(x).float(), dim=-1), lengths      # (B, T', C)


class BiLSTMEncoder(nn.Module):
    """The paper's baseline: a bidirectional LSTM (3 layers, 320 units each way) over packed
    sequences, so padding is never read. `attention` is accepted and unused, so every ASR model
    config builds the same way."""

    def __init__(self, n_labels: int, n_features: int = 40, n_layers: int = 3, hidden: int = 320,
                 dropout: float = 0.1, subsample: int = 1, attention=None):
        super().__init__()
        self.front = ConvSubsampling(n_features, n_features, subsample) if subsample > 1 else None
        self.lstm = nn.LSTM(n_features, hidden, n_layers, batch_first=True, bidirectional=True,
                            dropout=dropout if n_layers > 1 else 0.0)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(2 * hidden, n_labels)

    def forward(self, features, lengths):
        if self.front is not None:
            features, lengths = self.front(features, lengths)
        packed = nn.utils.rnn.pack_padded_sequence(features, lengths.cpu(), batch_first=True, enforce_sorted=False)
        y, _ = self.lstm(packed)
        y, _ = nn.utils.rnn.pad_packed_sequence(y, batch_first=True, total_length=features.shape[1])  # (B, T, 2H)
        return F.log_softmax(self.out(self.dropout(y)).float(), dim=-1), lengths
