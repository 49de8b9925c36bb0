"""What the paper's successors (retention, gated linear attention, the delta rule) share: an
unnormalised fast-weight memory S read by q (no phi(q)^T Z normaliser: a per-head norm of the
output keeps its scale instead), an optional swish output gate, per-token inputs computed from x
(a decay, a write strength) beside q, k and v, and, for the two whose update runs along the
sequence only (gla, delta), the refusal of causal=False unless `bidirectional` is set.

bidirectional=True (for a non-causal encoder, as bidirectional RNNs and state-space encoders do):
causal=False runs the causal memory over each sequence and over the same sequence reversed within
its own valid length, with the same weights, and sums the two readouts before the norm and gate:

    o_t = S_t^T q_t + R_t^T q_t,   S_t from tokens 1..t (left to right),
                                   R_t from tokens L..t (right to left; L = the valid length),

so the current token is seen by both passes (counted twice, as in a bidirectional RNN's two
directions; retention's own non-causal form subtracts it instead). Reversal is by index per
sequence, so padding stays at the end in both passes and a padded batch equals its sequences
alone. The recurrent twin (step) stays the causal one: the right-to-left pass needs the future.

What the layer keeps for backward (docs/attention.md): its own autograd Function,
_RecomputedReadout, keeps x and the parameters alone (x is the projections' input, kept by them
anyway) and recomputes everything between the projections and the output projection in its
backward: q, k, v from x, the per-token inputs, the memory, the norm and the gate. So the layer
keeps its input, the output projection's input and its parameters: fewer bytes than the linear
layer (x, q, k, v, its output and one normaliser per token). The memory's intermediates exist
during that backward only; the ops' own Function (repro.kernels.gated.chunked.RecomputedChunks), which
callers outside a layer get, keeps its inputs alone too."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from repro.attention.base import AttentionLayer
from repro.common.errors import ConfigError
from repro.kernels.gated.chunked import autograd_through_chunks
from repro.kernels.plumbing.dtypes import accumulation_dtype

NORMS = ("layer", "rms", "none")
BIDIRECTIONAL_CONFIGS = "softmax, linear, retention"
ENABLE_BIDIRECTIONAL = "attention.bidirectional=true (runs it in both directions, summed)"


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


def reversal_index(keep, n, device):
    """(B, N) indices that reverse each sequence's valid positions among themselves and leave
    padded ones in place (an involution); None without a mask (a plain flip). keep: (B, 1, N)."""
    if keep is None:
        return None
    keep = keep[:, 0]  # (B, N)
    pos = torch.arange(n, device=device).expand_as(keep)
    rank = keep.cumsum(-1) - 1  # (B, N): a valid position's rank among the valid ones
    length = keep.sum(-1, keepdim=True)  # (B, 1)
    # the valid positions in order, then the padded ones: valid rank r sits at by_rank[:, r]
    by_rank = torch.sort(torch.where(keep, pos, pos + n), dim=-1, stable=True).indices
    mirror = by_rank.gather(-1, (length - 1 - rank).clamp(min=0))
    return torch.where(keep, mirror, pos)


def reverse(t, index, dim):
    """t reversed along dim (the sequence's) by reversal_index's index, or flipped where it is None."""
    if index is None:
        return t.flip(dim)
    shape = [1] * t.dim()
    shape[0], shape[dim] = index.shape
    return t.gather(dim, index.view(shape).expand_as(t))


# The projections that AttentionLayer.forward applies to x before attend: q, k, v (their outputs
# are recomputed from x in _RecomputedReadout's backward), and the output projection after it
PROJECTIONS = ("q_proj.", "k_proj.", "v_proj.", "out_proj.")


class _RecomputedReadout(torch.autograd.Function):
    """(x, q, k, v) -> the layer's readout (B, H, N, M) before the output projection: per-token
    inputs from x, the memory, the norm and the gate. It keeps x and the parameters alone for
    backward (not q, k, v, the per-token inputs, the norm's or the gate's intermediates: x is kept
    by the projections anyway); its backward computes q, k, v again from x by the layer's
    projections, then the readout under autograd (the memory's chunked recurrence by autograd through
    its chunks: a layer's backward holds their intermediates while it runs, as the plain graph did)."""

    @staticmethod
    def forward(ctx, layer, causal, keep, x, q, k, v, *params):
        # the projections' parameters are saved for their version check only: a change in place
        # before the backward would recompute other q, k, v
        ctx.save_for_backward(x, *params, *(p for n, p in layer.named_parameters() if n.startswith(PROJECTIONS[:3])))
        ctx.layer, ctx.causal, ctx.keep, ctx.n_params = layer, causal, keep, len(params)
        dev = x.device.type  # the backward recomputes under the forward's autocast, to the same values
        ctx.autocast = {"device_type": dev, "dtype": torch.get_autocast_dtype(dev),
                        "enabled": torch.is_autocast_enabled(dev)}
        return layer._readout(x, q, k, v, causal, keep)

    @staticmethod
    def backward(ctx, g):
        layer, need = ctx.layer, ctx.needs_input_grad[3:]
        x, *params = ctx.saved_tensors[:1 + ctx.n_params]
        create = torch.is_grad_enabled()  # create_graph: x keeps its graph, and so do q, k, v and the gradients
        with torch.enable_grad(), torch.autocast(**ctx.autocast):
            # xd: x as the per-token inputs' input alone, a view under create_graph: q, k, v come
            # from x itself, so x's gradient here is the per-token inputs' share only (q's, k's and
            # v's reach x through the projections' own backward, once each)
            xd = x.view_as(x) if create else x.detach().requires_grad_(need[0])
            with torch.set_grad_enabled(create):
                qkv = [layer._heads(x, proj, d) for proj, d in ((layer.q_proj, layer.d_keys),
                                                                (layer.k_proj, layer.d_keys),
                                                                (layer.v_proj, layer.d_values))]
            if not create:
                qkv = [t.detach().requires_grad_(r) for t, r in zip(qkv, need[1:4])]
            with autograd_through_chunks():  # this backward recomputes them already
                y = layer._readout(xd, *qkv, ctx.causal, ctx.keep)
        wrt = [t for t, r in zip([xd, *qkv, *params], need) if r]
        grads = iter(torch.autograd.grad(y, wrt, g, allow_unused=True, create_graph=create))
        return (None, None, None, *(next(grads) if r else None for r in need))


class SuccessorAttention(AttentionLayer):
    """Subclasses implement token_inputs(x) (what they compute from x beside q, k, v: a dict of
    (B, [N,] ...) tensors), memory(q, k, v, extra, causal, keep) for the parallel form and
    memory_step(q, k, v, extra, state) for the recurrent one; this class adds the norm and the
    gate, and hands the per-token inputs of the current call to attend / attend_step; for the
    causal-only ones with bidirectional=True, the two-pass non-causal form (the module's doc).
    Under autograd, attend keeps for backward no more than x and the parameters
    (_RecomputedReadout), fewer bytes than the linear layer keeps."""

    recurrent = True
    config_name = "successor"

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, norm: str = "layer",
                 output_gate: bool = True, chunk_size: int | None = None, bidirectional: bool = False):
        super().__init__(d_model, n_heads, d_keys, d_values)
        if bidirectional and not type(self).causal_only:
            raise ValueError(f"{self.config_name}: bidirectional=true is for the causal-only attentions (gla, "
                             f"delta); {self.config_name} has its own non-causal form")
        self.bidirectional = bool(bidirectional)
        # a bidirectional layer takes causal=False, so it is no longer causal only (what the
        # config check and the tests read)
        self.causal_only = type(self).causal_only and not self.bidirectional
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"{self.config_name}: chunk_size must be >= 1 or null (the kernel's default); "
                             f"got {chunk_size}")
        self.chunk_size = chunk_size
        self.norm = None if norm == "none" else HeadNorm(norm, n_heads, self.d_values)
        self.gate_proj = nn.Linear(d_model, n_heads * self.d_values) if output_gate else None
        self._x = None  # this call's input, which the per-token inputs come from; set by forward and step only

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
                              f"{BIDIRECTIONAL_CONFIGS}, or {ENABLE_BIDIRECTIONAL}")
        self._x = x if x.dim() == 3 and x.shape[-1] == self.d_model else None  # else the base's error
        try:
            return super().forward(x, causal=causal, key_padding_mask=key_padding_mask)
        finally:
            self._x = None

    def step(self, x, state=None):
        self._x = x if x.dim() == 2 and x.shape[-1] == self.d_model else None
        try:
            return super().step(x, state)
        finally:
            self._x = None

    def _x_or_fail(self):
        if self._x is None:
            raise ValueError(f"{self.config_name}: call the layer itself (layer(x, ...) or layer.step), which "
                             f"computes its per-token inputs from x; attend() alone has none")
        return self._x

    def _finish(self, y, gate):
        """The norm, then the gate: y (B, H, [N,] M), gate (B, [N,] H, M) or None."""
        if self.norm is not None:
            y = self.norm(y)
        if gate is not None:
            y = y * (gate.transpose(1, 2) if y.dim() == 4 else gate).to(y.dtype)
        return y

    def attend(self, q, k, v, causal, key_padding_mask):
        x = self._x_or_fail()
        keep = None if key_padding_mask is None else ~key_padding_mask[:, None, :]  # (B, 1, N)
        # not in traced graphs (the compiler keeps its own choice of what to save), nor where
        # nothing needs a gradient
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            params = [p for n, p in self.named_parameters() if not n.startswith(PROJECTIONS)]
            if any(t.requires_grad for t in (x, q, k, v, *params)):
                return _RecomputedReadout.apply(self, causal, keep, x, q, k, v, *params)
        return self._readout(x, q, k, v, causal, keep)

    def _readout(self, x, q, k, v, causal, keep):
        """The per-token inputs from x, the memory over q, k, v, the norm and the gate: (B, H, N, M)."""
        extra = self._inputs(x)
        if causal or not self.bidirectional:
            y = self.memory(q, k, v, extra, causal, keep)
        else:
            y = self._both_ways(q, k, v, extra, keep)
        return self._finish(y, extra.get("gate"))

    def _both_ways(self, q, k, v, extra, keep):
        """The causal memory left to right plus the same right to left, both in causal form on
        the same per-token inputs (the gate is applied after the sum, so it is not reversed)."""
        index = reversal_index(keep, q.shape[2], q.device)  # (B, N) or None
        back = {name: reverse(t, index, 1) for name, t in extra.items() if name != "gate"}  # (B, N, H, ...)
        q_r, k_r, v_r = (reverse(t, index, 2) for t in (q, k, v))  # (B, H, N, .)
        # a reversal keeps padding where it was, so the mask is that of the left-to-right pass
        y_back = self.memory(q_r, k_r, v_r, back, True, keep)
        return self.memory(q, k, v, extra, True, keep) + reverse(y_back, index, 2)

    def attend_step(self, q, k, v, state):
        extra = self._inputs(self._x_or_fail())
        y, state = self.memory_step(q, k, v, extra, state)
        return self._finish(y, extra.get("gate")), state
