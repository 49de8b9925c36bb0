"""The paper's transformer layer and stack, running any attention, with a recurrent step."""
import math

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class TransformerLayer(nn.Module):
    """Post-norm as in the authors' library (x = norm1(x + attn(x)); norm2(x + ff(x))), or
    pre-norm with norm_first=True."""

    def __init__(self, attention, d_model: int, d_ff: int, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"model: unknown activation {activation!r}; valid: {', '.join(ACTIVATIONS)}")
        self.attention = attention
        self.linear1, self.linear2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = ACTIVATIONS[activation]
        self.norm_first = norm_first

    def _ff(self, x):
        return self.dropout(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def _block(self, x, attend):
        if self.norm_first:
            x = x + self.dropout(attend(self.norm1(x)))
            return x + self._ff(self.norm2(x))
        x = self.norm1(x + self.dropout(attend(x)))
        return self.norm2(x + self._ff(x))

    def forward(self, x, causal=False, key_padding_mask=None):
        return self._block(x, lambda h: self.attention(h, causal=causal, key_padding_mask=key_padding_mask))

    def step(self, x, state=None):
        """x: (B, d_model) for one token -> (B, d_model), new attention state."""
        if not (self.training or torch.is_grad_enabled()):
            return self._step_eval(x, state)
        new_state = None

        def attend(h):
            nonlocal new_state
            y, new_state = self.attention.step(h, state)
            return y

        return self._block(x, attend), new_state


    def _step_eval(self, x, state):
        """The same step for generation (eval, no grad): dropout is the identity, and the layer's
        modules are called as functions, a few ops per token fewer (the cost of generating at
        batch 1 is mostly per-op overhead)."""
        n1, n2, l1, l2 = self.norm1, self.norm2, self.linear1, self.linear2
        h = n1(x) if self.norm_first else x
        y, state = self.attention.step(h, state)
        x = x + y
        if not self.norm_first:
            x = h = F.layer_norm(x, n1.normalized_shape, n1.weight, n1.bias, n1.eps)
        else:
            h = F.layer_norm(x, n2.normalized_shape, n2.weight, n2.bias, n2.eps)
        f = torch.addmm(l1.bias, h, l1.weight.t())  # (B, d_ff)
        f = f.relu_() if self.activation is F.relu else self.activation(f)
        x = torch.addmm(l2.bias, f, l2.weight.t()).add_(x)
        if not self.norm_first:
            x = F.layer_norm(x, n2.normalized_shape, n2.weight, n2.bias, n2.eps)
        return x, state


class Transformer(nn.Module):
    """n_layers TransformerLayers; `attention` is the partial from conf/attention."""

    def __init__(self, attention, n_layers: int, d_model: int, n_heads: int, d_ff: int,
                 dropout: float = 0.1, activation: str = "relu", norm_first: bool = False,
                 final_norm: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(
            TransformerLayer(attention(d_model=d_model, n_heads=n_heads), d_model, d_ff, dropout,
                             activation, norm_first)
            for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model) if final_norm else nn.Identity()

    def forward(self, x, causal=False, key_padding_mask=None):
        for layer in self.layers:
            x = layer(x, causal=causal, key_padding_mask=key_padding_mask)
        return self.norm(x)

    def step(self, x, states=None):
        states = states or [None] * len(self.layers)
        new_states = []
        for layer, s in zip(self.layers, states):
            x, s = layer.step(x, s)
            new_states.append(s)
        return self.norm(x), new_states


def sinusoid(positions, d_model: int):
    """Sinusoidal position encodings (Vaswani et al.) for integer positions (N,) -> (N, d_model).
    Computed on the fly, so generation has no length limit."""
    half = torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32)
    angle = positions.float()[:, None] * torch.exp(half * (-math.log(10000.0) / d_model))
    enc = torch.zeros(len(positions), d_model, device=positions.device)
    enc[:, 0::2] = torch.sin(angle)
    enc[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return enc
