"""Softmax attention through torch's scaled_dot_product_attention, and its recurrent twin with
a key/value cache (the paper's "stateful softmax", supplementary C.1)."""
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from repro.attention.base import AttentionLayer

SDPA_BACKENDS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


@dataclass
class KVCache:
    k: torch.Tensor  # (B, H, capacity, D)
    v: torch.Tensor  # (B, H, capacity, M)
    length: int | torch.Tensor = 0  # a () tensor on the device with static_cache (see attend_step)


class SoftmaxAttention(AttentionLayer):
    """softmax(q k^T / sqrt(D)) v.

    sdpa_backend: None lets torch pick (a flash kernel on CPU and most GPUs: O(N) memory);
    "math" materialises the (N, N) matrix as the paper's 2020 baseline did.
    attention_dropout: dropout on the attention weights, in training only (SDPA's dropout_p);
    0 by default, 0.1 in the paper presets (the authors' scripts).
    initial_cache: the cache's slots at the first step, doubled when full.
    static_cache: the cache never grows (initial_cache slots must hold the whole sequence) and
    its length is a tensor on the device; each step attends over every slot, those not yet
    written masked out. Every step then has the same shapes and no Python value that changes:
    what a CUDA graph of the whole step needs (repro.models.generate.GraphedSteps).
    """

    recurrent = True

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, attention_dropout: float = 0.0,
                 sdpa_backend: str | None = None, initial_cache: int = 64, static_cache: bool = False):
        super().__init__(d_model, n_heads, d_keys, d_values)
        if sdpa_backend is not None and sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"softmax: unknown sdpa_backend {sdpa_backend!r}; valid: null, {', '.join(SDPA_BACKENDS)}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"softmax: attention_dropout must be in [0, 1); got {attention_dropout}")
        self.attention_dropout = attention_dropout
        self.sdpa_backend = sdpa_backend
        self.initial_cache, self.static_cache = initial_cache, bool(static_cache)

    def _kernel(self):
        return sdpa_kernel(SDPA_BACKENDS[self.sdpa_backend]) if self.sdpa_backend else nullcontext()

    def attend(self, q, k, v, causal, key_padding_mask):
        mask = None
        if key_padding_mask is not None:
            mask = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, N): True takes part
            if causal:
                n = q.shape[-2]
                mask = mask & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        p = self.attention_dropout if self.training else 0.0
        with self._kernel():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                  is_causal=causal and mask is None)

    def attend_step(self, q, k, v, state: KVCache | None):
        if self.static_cache:
            return self._static_step(q, k, v, state)
        if state is None:
            b, h = q.shape[:2]
            state = KVCache(k.new_empty(b, h, self.initial_cache, k.shape[-1]),
                            v.new_empty(b, h, self.initial_cache, v.shape[-1]))
        elif state.length == state.k.shape[2]:  # full: double, so appends cost O(1) amortised
            state = KVCache(torch.cat([state.k, torch.empty_like(state.k)], 2),
                            torch.cat([state.v, torch.empty_like(state.v)], 2), state.length)
        # index_copy_ at a tensor index: torch.compile keeps the position symbolic (an int index
        # would recompile at every position) and writes the one slot in place even where several
        # steps share a graph (compile_step's tokens_per_call), where a copy_ into a narrow view
        # became a copy of the whole cache per layer and step, read back before the next step.
        n = state.length
        at = torch.full((1,), n, dtype=torch.long, device=k.device)
        state.k.index_copy_(2, at, k[:, :, None])
        state.v.index_copy_(2, at, v[:, :, None])
        state.length = n = n + 1
        with self._kernel():
            y = F.scaled_dot_product_attention(q[:, :, None], state.k.narrow(2, 0, n), state.v.narrow(2, 0, n))
        return y[:, :, 0], state

    def _static_step(self, q, k, v, state: KVCache | None):
        """The step on a cache of initial_cache slots that never grows, its length on the device:
        the new key and value go to slot `length`, and the query attends over every slot with
        those past it masked (their contents never reach the output)."""
        if state is None:
            b, h = q.shape[:2]
            state = KVCache(k.new_zeros(b, h, self.initial_cache, k.shape[-1]),
                            v.new_zeros(b, h, self.initial_cache, v.shape[-1]),
                            torch.zeros((), dtype=torch.long, device=q.device))
        capacity = state.k.shape[2]
        if not (q.is_cuda and torch.cuda.is_current_stream_capturing()) and int(state.length) >= capacity:
            raise ValueError(f"softmax: static_cache holds initial_cache={capacity} tokens and this sequence is "
                             f"longer: set initial_cache to the sequence's length")
        n = state.length.reshape(1)
        state.k.index_copy_(2, n, k[:, :, None])
        state.v.index_copy_(2, n, v[:, :, None])
        seen = torch.arange(capacity, device=q.device) <= n  # (capacity,): slots written so far
        with self._kernel():
            y = F.scaled_dot_product_attention(q[:, :, None], state.k, state.v, attn_mask=seen[None])  # (1, cap.)
        state.length = state.length + 1
        return y[:, :, 0], state
