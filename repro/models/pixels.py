"""Images as sequences of 8-bit sub-pixels for the paper's autoregressive image models:
channels interleaved (r, g, b of pixel 0, then of pixel 1, ...), each value a token, the output
at position i a mixture of discretized logistics for the value at i + 1. The first sub-pixel is
input only: an image of L values gives L - 1 predictions (783 for MNIST, 3071 for CIFAR-10)."""
import torch

from repro.models import logistic_mixture as dmol
from repro.models.autoregressive import AutoregressiveTransformer

IMAGE_SHAPES = {"mnist": (1, 28, 28), "fashion_mnist": (1, 28, 28), "digits8": (1, 8, 8), "cifar": (3, 32, 32)}


def to_sequence(images):
    """(B, C, H, W) uint8 -> (B, H*W*C) int64, channels interleaved."""
    return images.permute(0, 2, 3, 1).flatten(1).long()


def to_images(seq, shape):
    """(B, H*W*C) -> (B, C, H, W) uint8."""
    c, h, w = shape
    return seq.reshape(-1, h, w, c).permute(0, 3, 1, 2).to(torch.uint8)


class PixelTransformer(AutoregressiveTransformer):
    def __init__(self, attention, n_mixtures: int = 10, **model):
        super().__init__(attention, n_tokens=256, d_out=3 * n_mixtures, **model)

    def nll(self, seq, key_padding_mask=None):
        """Sum over predicted positions of -log p, in nats: (B, L) -> (B,)."""
        params = self(seq[:, :-1], key_padding_mask)  # (B, L-1, 3K): output i predicts value i+1
        return -dmol.log_prob(params, seq[:, 1:]).sum(-1)

    def bits_per_dim(self, seq):
        return dmol.bits_per_dim(self.nll(seq).mean(), seq.shape[1] - 1)
