"""Blocked local attention's bookkeeping (BigBird, Long-Short): the sequence is cut into
blocks of b tokens and each query block attends to a few key blocks gathered for it, so
memory is O(N * keys per query), never O(N^2)."""
import math

import torch
import torch.nn.functional as F


def pad_to_blocks(x, block: int, dim: int = 2):
    """Zero-pad x along dim to a multiple of block (the extra positions are masked by callers)."""
    extra = -x.shape[dim] % block
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad)


def neighbour_index(n_blocks: int, reach: int, device=None):
    """Key blocks i-reach .. i+reach of each query block i: index (nb, 2 reach + 1) clamped into
    range, and valid (nb, 2 reach + 1), False where i + offset falls off either end."""
    idx = torch.arange(n_blocks, device=device)[:, None] + torch.arange(-reach, reach + 1, device=device)
    valid = (idx >= 0) & (idx < n_blocks)
    return idx.clamp(0, n_blocks - 1), valid


def gather_blocks(x, idx):
    """x (B, H, nb * b, D), idx (nb, J) -> (B, H, nb, J * b, D): for each query block the
    concatenation of its J key blocks."""
    nb = idx.shape[0]
    xb = x.unflatten(2, (nb, x.shape[2] // nb))  # (B, H, nb, b, D)
    return xb[:, :, idx].flatten(3, 4)  # (B, H, nb, J, b, D) -> (B, H, nb, J * b, D)


def block_positions(idx, block: int):
    """Token positions of the gathered keys: idx (nb, J) -> (nb, J * b)."""
    return (idx[..., None] * block + torch.arange(block, device=idx.device)).flatten(-2)


def n_blocks(n: int, block: int) -> int:
    return math.ceil(n / block)
