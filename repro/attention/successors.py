"""What the paper's successors (retention, gated linear attention, the delta rule) share: an
unnormalised fast-weight memory S read by q (no phi(q)^T Z normaliser: a per-head norm of the
output keeps its scale instead), an optional swish output gate, per-token inputs computed from x
(a decay, a write strength) beside q, k and v, and, for the two whose update runs along the
sequence only, the refusal of causal=False."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from repro.attention.base import AttentionLayer
from repro.common.errors import ConfigError

NORMS = ("layer", "rms", "none")
BIDIRECTIONAL_CONFIGS = "softmax, linear, retention"


def accumulation_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class MemoryState:
    S: torch.Tensor  # (B, H, D, M): the fast-weight memory, in fp32 (fp64 for fp64)


def new_state(q, v) -> MemoryState:
    """S = 0 for (B, H, D) queries and (B, H, M) values."""
    return MemoryState(q.new_zeros(*q.shape, v.shape[-1]))


class HeadNorm(nn.Module):
    """A norm over each head's M outputs, with a per-channel scale (and shift for `layer`):
    RetNet's GroupNorm with one group per head, GLA's LayerNorm, DeltaNet's RMSNorm. In fp32."""

    def __init__(self, kind: str, n_heads: int, d: int, eps: float = 1e-5):
        super().__init__()
        if kind not in NORMS:
            raise ValueError(f"norm must be one of {', '.join(NORMS)}; got {kind!r}")
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(n_heads, d))
        self.bias = nn.Parameter(torch.zeros(n_heads, d)) if kind == "layer" else None

    def forward(self, y):  # (B, H, [N,] M)
        dtype, y = y.dtype, y.to(accumulation_dtype(y.dtype))
        if self.kind == "layer":
            y = y - y.mean(-1, keepdim=True)
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + self.eps)
        shape = (self.weight.shape[0],) + (1,) * (y.dim() - 3) + (self.weight.shape[1],)  # (H, [1,] M)
        y = y * self.weight.view(shape).to(y.dtype)
        if self.bias is not None:
            y = y + self.bias.view(shape).to(y.dtype)
        return y.to(dtype)


class SuccessorAttention(AttentionLayer):
    """Subclasses implement token_inputs(x) (what they compute from x beside q, k, v: a dict of
    (B, [N,] ...) tensors), memory(q, k, v, extra, causal, keep) for the parallel form and
    memory_step(q, k, v, extra, state) for the recurrent one; this class adds the norm and the
    gate, and hands the per-token inputs of the current call to attend / attend_step."""

    recurrent = True
    config_name = "successor"

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, norm: str = "layer",
                 output_gate: bool = True, chunk_size: int | None = None):
        super().__init__(d_model, n_heads, d_keys, d_values)
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"{self.config_name}: chunk_size must be >= 1 or null (the kernel's default); "
                             f"got {chunk_size}")
        self.chunk_size = chunk_size
        self.norm = None if norm == "none" else HeadNorm(norm, n_heads, self.d_values)
        self.gate_proj = nn.Linear(d_model, n_heads * self.d_values) if output_gate else None
        self._extra = None  # this call's per-token inputs; set by forward and step only

    def token_inputs(self, x) -> dict:
        return {}

    def memory(self, q, k, v, extra, causal, keep):
        """(B, H, N, D), (B, H, N, D), (B, H, N, M), extra, bool, keep (B, 1, N) or None -> (B, H, N, M)."""
        raise NotImplementedError

    def memory_step(self, q, k, v, extra, state):
        """(B, H, D), (B, H, D), (B, H, M), extra, state -> (B, H, M), state."""
        raise NotImplementedError

    def _inputs(self, x):
        extra = self.token_inputs(x)
        if self.gate_proj is not None:
            extra["gate"] = F.silu(self.gate_proj(x)).unflatten(-1, (self.n_heads, self.d_values))  # (B, [N,] H, M)
        return extra

    def forward(self, x, causal: bool = False, key_padding_mask=None):
        if not causal and self.causal_only:
            raise ConfigError(f"attention {self.config_name} ({type(self).__name__}) is causal only: its update "
                              f"runs along the sequence and has no non-causal form; for causal=False use "
                              f"{BIDIRECTIONAL_CONFIGS}")
        self._extra = self._inputs(x) if x.dim() == 3 and x.shape[-1] == self.d_model else None  # else the base's error
        try:
            return super().forward(x, causal=causal, key_padding_mask=key_padding_mask)
        finally:
            self._extra = None

    def step(self, x, state=None):
        self._extra = self._inputs(x) if x.dim() == 2 and x.shape[-1] == self.d_model else None
        try:
            return super().step(x, state)
        finally:
            self._extra = None

    def _extra_or_fail(self):
        if self._extra is None:
            raise ValueError(f"{self.config_name}: call the layer itself (layer(x, ...) or layer.step), which "
                             f"computes its per-token inputs from x; attend() alone has none")
        return self._extra

    def _finish(self, y, gate):
        """The norm, then the gate: y (B, H, [N,] M), gate (B, [N,] H, M) or None."""
        if self.norm is not None:
            y = self.norm(y)
        if gate is not None:
            y = y * (gate.transpose(1, 2) if y.dim() == 4 else gate).to(y.dtype)
        return y

    def attend(self, q, k, v, causal, key_padding_mask):
        extra = self._extra_or_fail()
        keep = None if key_padding_mask is None else ~key_padding_mask[:, None, :]  # (B, 1, N)
        y = self.memory(q, k, v, extra, causal, keep)
        return self._finish(y, extra.get("gate"))

    def attend_step(self, q, k, v, state):
        extra = self._extra_or_fail()
        y, state = self.memory_step(q, k, v, extra, state)
        return self._finish(y, extra.get("gate")), state
