"""The causal mean in PyTorch: one cumulative sum over the sequence, in the accumulation dtype."""
import torch

from repro.kernels.plumbing.dtypes import accumulation_dtype


def causal_mean(v):
    """(B, H, N, M) -> (B, H, N, M): out_i = (1 / i) sum_{j<=i} v_j, any device and dtype."""
    acc = accumulation_dtype(v.dtype)
    n = torch.arange(1, v.shape[2] + 1, device=v.device, dtype=acc)
    return (v.to(acc).cumsum(2) / n[:, None]).to(v.dtype)
