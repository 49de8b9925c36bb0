"""The dtype sums run in, for every op and attention layer of the suite."""
import torch


def accumulation_dtype(dtype):
    """Sums over the sequence run in fp32 (fp64 for fp64): sum phi(K) overflows fp16 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32
