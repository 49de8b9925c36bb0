"""Attentions for tests/attention/test_conformance.py: a correct one written plainly, each of the others
broken in one way that one property of the conformance check is there to catch (and named for
it), and torch's own nn.MultiheadAttention behind the suite's call (not an AttentionLayer).
tests/attention/test_conformance.py also copies this file into a temporary package, a user's, to run
them as attention=custom."""
import math
import sys

import torch
from torch import nn

from repro.attention.base import AttentionLayer


class Plain(AttentionLayer):
    """Naive softmax attention over the allowed keys, and its step over a growing key/value list."""

    recurrent = True

    def allowed(self, n, causal, key_padding_mask, device):
        keep = torch.ones(n, n, dtype=torch.bool, device=device)
        keep = keep.tril() if causal else keep
        if key_padding_mask is not None:
            keep = keep & ~key_padding_mask[:, None, None, :]  # (B, 1, N, N)
        return keep

    def logits(self, q, k):
        return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, N, N)

    def attend(self, q, k, v, causal, key_padding_mask):
        keep = self.allowed(q.shape[-2], causal, key_padding_mask, q.device)
        return self.logits(q, k).masked_fill(~keep, -math.inf).softmax(-1) @ v

    def attend_step(self, q, k, v, state):
        ks, vs = state if state is not None else ([], [])
        ks, vs = ks + [k], vs + [v]
        keys, values = torch.stack(ks, -2), torch.stack(vs, -2)  # (B, H, t, D), (B, H, t, M)
        w = (keys @ q[..., None]).squeeze(-1).div(math.sqrt(q.shape[-1])).softmax(-1)  # (B, H, t)
        return (w[..., None, :] @ values).squeeze(-2), (ks, vs)


class Leaky(Plain):
    """causality: the causal form forgets its mask and reads the future."""

    def attend(self, q, k, v, causal, key_padding_mask):
        return super().attend(q, k, v, False, key_padding_mask)


class IgnoresPadding(Plain):
    """padding invariance: the mask is taken and dropped."""

    def attend(self, q, k, v, causal, key_padding_mask):
        return super().attend(q, k, v, causal, None)


class StepOff(Plain):
    """recurrent == parallel: the step scales its scores twice."""

    def attend_step(self, q, k, v, state):
        return super().attend_step(q / math.sqrt(q.shape[-1]), k, v, state)


class Cancels(Plain):
    """float32 == float64: a large constant added to the scores (softmax takes it out again)
    leaves float32 a few bits of them; no step, so that the step's own comparison is not first."""

    recurrent = False

    def logits(self, q, k):
        return super().logits(q, k) + 1e5


class NoKeys(Plain):
    """gradients: the keys are the queries (shared QK), but k_proj is still a parameter."""

    def attend(self, q, k, v, causal, key_padding_mask):
        return super().attend(q, q, v, causal, key_padding_mask)

    def attend_step(self, q, k, v, state):
        return super().attend_step(q, q, v, state)


class Drifts(Plain):
    """repeatable: each call adds a little more than the last (a counter kept on the module)."""

    calls = 0

    def attend(self, q, k, v, causal, key_padding_mask):
        self.calls += 1
        return super().attend(q, k, v, causal, key_padding_mask) + 1e-3 * self.calls


class DrawsEachCall(Plain):
    """Draws a random temperature in every call, even in eval mode, in the input's dtype: under
    one seed float32 and float64 draw different ones (LSH with redraw: always, in small)."""

    recurrent = False

    def attend(self, q, k, v, causal, key_padding_mask):
        t = 1 + 0.5 * torch.rand((), dtype=q.dtype, device=q.device)
        return super().attend(q * t, k, v, causal, key_padding_mask)


class LeaksInTraining(Plain):
    """causality, in train mode only: the mask is dropped while training (eval mode alone passes it)."""

    def attend(self, q, k, v, causal, key_padding_mask):
        return super().attend(q, k, v, causal and not self.training, key_padding_mask)


class LeaksFrom64(Plain):
    """causality, past 64 tokens only: from position 64 on a query also sees the next token (a
    fault at a block boundary); 37 tokens, the check's former length, never reach it. Its step
    stays causal."""

    def allowed(self, n, causal, key_padding_mask, device):
        keep = super().allowed(n, causal, key_padding_mask, device)
        i = torch.arange(n, device=device)
        return keep | ((i[:, None] >= 64) & (i[None, :] == i[:, None] + 1)) if causal else keep


class MixesBatch(Plain):
    """batch independence: every sequence also gets the first one's output (a state shared
    across the batch), in the step too; the first sequence is the whole one of the padding
    check, so padding invariance holds."""

    def attend(self, q, k, v, causal, key_padding_mask):
        y = super().attend(q, k, v, causal, key_padding_mask)
        return y + 0.5 * y[:1]

    def attend_step(self, q, k, v, state):
        y, state = super().attend_step(q, k, v, state)
        return y + 0.5 * y[:1], state


class ExitsInForward(Plain):
    """interface: its forward ends the program (sys.exit(0), a script's habit)."""

    def forward(self, x, causal=False, key_padding_mask=None):
        sys.exit(0)


class ExitsInTraining(Plain):
    """repeatable and every check after it: sys.exit(0) in a training forward only."""

    def forward(self, x, causal=False, key_padding_mask=None):
        if self.training:
            sys.exit(0)
        return super().forward(x, causal, key_padding_mask)


class ExitsWhenBuilt(Plain):
    """interface: its constructor ends the program."""

    def __init__(self, d_model, n_heads):
        sys.exit(3)


class WrongShape(Plain):
    """interface: returns one value dimension short."""

    def forward(self, x, causal=False, key_padding_mask=None):
        return super().forward(x, causal, key_padding_mask)[..., :-1]


class NoMaskArgument(nn.Module):
    """interface: not an AttentionLayer, and its forward takes no key_padding_mask."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x, causal=False):
        return self.proj(x)


class TorchMultihead(nn.Module):
    """torch.nn.MultiheadAttention behind the suite's call: conforms without being an AttentionLayer."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.mha = nn.MultiheadAttention(d_model, n_heads, batch_first=True)

    def forward(self, x, causal=False, key_padding_mask=None):
        n = x.shape[1]
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1) if causal else None
        return self.mha(x, x, x, key_padding_mask=key_padding_mask, attn_mask=future, need_weights=False)[0]
