"""The delta rule (Schlag, Irie and Schmidhuber 2021, "Linear Transformers Are Secretly Fast
Weight Programmers"; DeltaNet, Yang et al. 2024): a memory that writes over what a key held
instead of piling on,

    S_t = S_{t-1} + k_t beta_t (v_t - S_{t-1}^T k_t)^T,   o_t = S_t^T q_t,
    beta_t = sigmoid(x_t W_beta) per head,   q, k = phi(.) / |phi(.)|   (L2-normalised),

phi = SiLU by default (DeltaNet's; `feature_map`: silu, elu1 = elu + 1, relu, identity). With unit
keys and beta in (0, 1) each step I - beta k k^T is a contraction, so the state stays bounded.
The output is y = (RMSNorm(o) [* swish(x W_g)]) W_O, the norm per head (DeltaNet's; the gate off by
default). The parallel form is the chunked WY / UT-transform algorithm
(repro.kernels.delta_rule_dot_product); the recurrent twin carries S (B, H, D, M). Causal only:
each write depends on the state left by every earlier one (causal=False is refused), unless
bidirectional=True: then causal=False is the sum of a left-to-right and a right-to-left pass
(repro.attention.successors). Padding: padded keys write nothing (beta = 0 there).
"""
import torch
import torch.nn.functional as F
from torch import nn

from repro.attention.successors import SuccessorAttention, new_state
from repro.kernels import delta_rule_dot_product
from repro.kernels.plumbing.dtypes import accumulation_dtype

FEATURE_MAPS = {"silu": F.silu, "elu1": lambda x: F.elu(x) + 1, "relu": F.relu, "identity": lambda x: x}


class DeltaRuleAttention(SuccessorAttention):
    causal_only = True
    config_name = "delta"

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, feature_map: str = "silu",
                 norm: str = "rms", output_gate: bool = False, chunk_size: int | None = None,
                 bidirectional: bool = False):
        super().__init__(d_model, n_heads, d_keys, d_values, norm=norm, output_gate=output_gate, chunk_size=chunk_size,
                         bidirectional=bidirectional)
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"delta: feature_map must be one of {', '.join(FEATURE_MAPS)}; got {feature_map!r}")
        self.feature_map = feature_map
        self.beta_proj = nn.Linear(d_model, n_heads)

    def token_inputs(self, x):
        return {"beta": torch.sigmoid(self.beta_proj(x).to(accumulation_dtype(x.dtype)))}  # (B, [N,] H)

    def _phi(self, x):
        return F.normalize(FEATURE_MAPS[self.feature_map](x.to(accumulation_dtype(x.dtype))), dim=-1, eps=1e-6)

    def memory(self, q, k, v, extra, causal, keep):
        beta = extra["beta"].transpose(1, 2)  # (B, H, N)
        dtype, q, k = v.dtype, self._phi(q), self._phi(k)  # unit length, in fp32 (fp64 for fp64)
        if keep is not None:
            k, beta = k * keep[..., None], beta * keep
        return delta_rule_dot_product(q, k, v.to(q.dtype), beta, chunk_size=self.chunk_size).to(dtype)

    def memory_step(self, q, k, v, extra, state):
        dtype = v.dtype
        q, k = self._phi(q), self._phi(k)  # (B, H, D), unit length
        v = v.to(q.dtype)
        state = state or new_state(q, v)
        beta = extra["beta"].to(q.dtype)[..., None]  # (B, H, 1)
        u = beta * (v - (k[..., None, :] @ state.S)[..., 0, :])  # (B, H, M): what this step writes
        state.S = torch.addcmul(state.S, k[..., :, None], u[..., None, :])
        return (q[..., None, :] @ state.S)[..., 0, :].to(dtype), state
