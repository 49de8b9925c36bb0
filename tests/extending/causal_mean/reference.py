"""The causal mean one step at a time, in float64: the reference the op's test compares with."""
import torch


def causal_mean_loop(v):
    """(B, H, N, M) -> (B, H, N, M): out_i = (1 / i) sum_{j<=i} v_j."""
    s, outs = torch.zeros_like(v[:, :, 0], dtype=torch.float64), []
    for i in range(v.shape[2]):
        s = s + v[:, :, i].double()
        outs.append(s / (i + 1))
    return torch.stack(outs, dim=2).to(v.dtype)
