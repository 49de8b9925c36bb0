"""Attention layers. Each is configured by a file in conf/attention (that group is the
registry) and built as `hydra.utils.instantiate(cfg.attention)(d_model=..., n_heads=...)`."""
from .base import AttentionLayer
from .linear import LinearAttention, LinearState
from .softmax import KVCache, SoftmaxAttention

__all__ = ["AttentionLayer", "LinearAttention", "LinearState", "SoftmaxAttention", "KVCache"]
