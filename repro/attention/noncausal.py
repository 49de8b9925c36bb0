"""What the non-causal family (Linformer, Nystromformer, BigBird, Long-Short) shares: the
refusal of causal=True, and a softmax over a masked set of keys that never yields NaN."""
import torch

from repro.attention.base import AttentionLayer
from repro.common.errors import ConfigError
from repro.kernels.plumbing.dtypes import accumulation_dtype

CAUSAL_CONFIGS = "softmax, softmax-math, linear"


def masked_softmax(logits, keep, dim: int = -1):
    """softmax over `dim` of the entries where keep is True (keep broadcasts to logits; None
    keeps all). Masked entries get probability 0; a row with nothing kept is all zeros rather
    than NaN, so padded rows stay finite and cannot poison later layers. Computed in fp32
    (fp64 for fp64) and returned in the logits' dtype."""
    acc = accumulation_dtype(logits.dtype)
    if keep is None:
        return torch.softmax(logits, dim, dtype=acc).to(logits.dtype)
    p = torch.softmax(logits.to(acc).masked_fill(~keep, torch.finfo(acc).min), dim)
    return (p * keep).to(logits.dtype)  # only changes rows with nothing kept (uniform -> 0)


class NonCausalAttention(AttentionLayer):
    """An attention whose parallel form lets every position see every other one (a projection
    or landmark summary of the whole sequence, or a window reaching ahead): it has no causal or
    recurrent form. Subclasses implement attend_bidirectional(q, k, v, key_padding_mask)."""

    config_name = "non-causal"

    def attend(self, q, k, v, causal, key_padding_mask):
        if causal:
            raise ConfigError(f"attention {self.config_name} ({type(self).__name__}) is non-causal only; "
                              f"for causal=True use a causal config such as {CAUSAL_CONFIGS}")
        return self.attend_bidirectional(q, k, v, key_padding_mask)

    def attend_bidirectional(self, q, k, v, key_padding_mask):
        """(B, H, N, D), (B, H, N, D), (B, H, N, M), bool (B, N) or None -> (B, H, N, M)."""
        raise NotImplementedError
