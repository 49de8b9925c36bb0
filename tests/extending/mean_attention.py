"""A toy attention, docs/extending.md's example: every query takes the mean of the values it may
see (queries and keys are ignored), and its recurrent twin carries a running sum and count.
Copied to repro/attention/mean.py by tests/test_extending.py."""
import torch

from repro.attention.base import AttentionLayer


class MeanAttention(AttentionLayer):
    recurrent = True

    def attend(self, q, k, v, causal, key_padding_mask):
        """(B, H, N, D), (B, H, N, D), (B, H, N, M) -> (B, H, N, M)."""
        keep = torch.ones(v.shape[:3], dtype=v.dtype, device=v.device)  # (B, H, N)
        if key_padding_mask is not None:
            keep = keep * (~key_padding_mask)[:, None, :].to(v.dtype)
        if causal:
            total, count = (v * keep[..., None]).cumsum(2), keep.cumsum(2)
        else:
            total = (v * keep[..., None]).sum(2, keepdim=True).expand_as(v)
            count = keep.sum(2, keepdim=True).expand_as(keep)
        return total / count.clamp(min=1)[..., None]

    def attend_step(self, q, k, v, state):
        """(B, H, D), (B, H, D), (B, H, M), (running sum, count) or None -> (B, H, M), state."""
        total, count = state if state is not None else (torch.zeros_like(v), 0)
        total, count = total + v, count + 1
        return total / count, (total, count)
