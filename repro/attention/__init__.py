"""Attention layers. Each is configured by a file in conf/attention (that group is the
registry) and built as `hydra.utils.instantiate(cfg.attention)(d_model=..., n_heads=...)`."""
from repro.attention.base import AttentionLayer
from repro.attention.linear import LinearAttention, LinearState
from repro.attention.softmax import KVCache, SoftmaxAttention

__all__ = ["AttentionLayer", "LinearAttention", "LinearState", "SoftmaxAttention", "KVCache"]
