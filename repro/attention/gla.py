"""Gated linear attention (Yang et al. 2023, GLA): a data-dependent decay per key dimension,

    S_t = diag(alpha_t) S_{t-1} + k_t v_t^T,   o_t = S_t^T q_t,
    alpha_t = sigmoid(x_t W_1 W_2 + b)^(1 / tau)   (W_1: d_model -> 16, W_2: 16 -> H D; tau = 16),

so log alpha_t = log sigmoid(.) / tau, near 1 (slow forgetting) at initialisation. Queries are
scaled by D^-1/2; the output is GLA's y = (swish(x W_r) * LayerNorm(o)) W_O, the norm per head.
The parallel form is the chunked decayed product (repro.kernels.gated_causal_dot_product, a decay
per key dimension); the recurrent twin carries S (B, H, D, M). Causal only: the decay runs along
the sequence (causal=False is refused), unless bidirectional=True: then causal=False is the sum of
a left-to-right and a right-to-left pass (repro.attention.successors). Padding: padded keys write
nothing, padded positions decay nothing.
"""
import torch
import torch.nn.functional as F
from torch import nn

from repro.attention.successors import SuccessorAttention, new_state
from repro.kernels import gated_causal_dot_product
from repro.kernels.plumbing.dtypes import accumulation_dtype


class GatedLinearAttention(SuccessorAttention):
    causal_only = True
    config_name = "gla"

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, gate_rank: int = 16,
                 gate_temperature: float = 16.0, norm: str = "layer", output_gate: bool = True,
                 chunk_size: int | None = None, bidirectional: bool = False):
        super().__init__(d_model, n_heads, d_keys, d_values, norm=norm, output_gate=output_gate, chunk_size=chunk_size,
                         bidirectional=bidirectional)
        if gate_rank < 1 or not gate_temperature > 0:
            raise ValueError(f"gla: gate_rank must be >= 1 and gate_temperature > 0; "
                             f"got gate_rank={gate_rank}, gate_temperature={gate_temperature}")
        self.temperature = float(gate_temperature)
        self.alpha_proj = nn.Sequential(nn.Linear(d_model, gate_rank, bias=False),
                                        nn.Linear(gate_rank, n_heads * self.d_keys))

    def token_inputs(self, x):
        # log alpha in fp32 (fp64 for fp64): its sums over a chunk are what the decays are made of
        log_alpha = F.logsigmoid(self.alpha_proj(x).to(accumulation_dtype(x.dtype))) / self.temperature  # (B, [N,] H D)
        return {"log_alpha": log_alpha.unflatten(-1, (self.n_heads, self.d_keys))}  # (B, [N,] H, D)

    def memory(self, q, k, v, extra, causal, keep):
        log_alpha = extra["log_alpha"].transpose(1, 2)  # (B, H, N, D)
        if keep is not None:
            k, log_alpha = k * keep[..., None], log_alpha * keep[..., None]
        return gated_causal_dot_product(q * self.d_keys ** -0.5, k, v, log_alpha, chunk_size=self.chunk_size)

    def memory_step(self, q, k, v, extra, state):
        dtype, acc = v.dtype, accumulation_dtype(q.dtype)
        q, k, v = q.to(acc) * self.d_keys ** -0.5, k.to(acc), v.to(acc)  # (B, H, D), (B, H, M)
        state = state or new_state(q, v)
        alpha = extra["log_alpha"].to(acc).exp()  # (B, H, D)
        state.S = torch.addcmul(alpha[..., None] * state.S, k[..., :, None], v[..., None, :])  # diag(alpha) S + k v^T
        return (q[..., None, :] @ state.S)[..., 0, :].to(dtype), state
