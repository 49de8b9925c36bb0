"""A mixture of discretized logistics over 8-bit values (PixelCNN++, Salimans et al. 2017), the
paper's output distribution for image generation: each predicted sub-pixel gets K components,
each a logistic (mean mu, scale s) whose mass over a bin of width 2/255 around the value (the
outermost bins reaching to +-infinity) gives the value's probability.

Parameters per position: (..., 3K) = K mixture logits, K means, K log-scales. Values are ints in
0..255, mapped to [-1, 1] as x = v / 127.5 - 1.
"""
import math

import torch
import torch.nn.functional as F

from repro.kernels.plumbing.dtypes import accumulation_dtype

HALF_BIN = 1.0 / 255.0  # half the width of a bin in [-1, 1]
LOG_SCALE_MIN = -7.0


def split_params(params):
    """(..., 3K) -> logits, mu, log_s, each (..., K), in fp32 (fp64 stays fp64)."""
    params = params.to(accumulation_dtype(params.dtype))
    logits, mu, log_s = params.chunk(3, dim=-1)
    return logits, mu, log_s.clamp(min=LOG_SCALE_MIN)


def log_prob(params, values):
    """log p(value) under the mixture. params (..., 3K), values (...) ints in 0..255 -> (...)."""
    logits, mu, log_s = split_params(params)
    x = (values.to(mu.dtype) / 127.5 - 1.0)[..., None]  # (..., 1)
    inv_s = torch.exp(-log_s)
    a = inv_s * (x - mu + HALF_BIN)  # upper edge of the bin, standardised
    b = inv_s * (x - mu - HALF_BIN)  # lower edge
    # log(sigmoid(a) - sigmoid(b)) = a + log(1 - e^(b - a)) - softplus(a) - softplus(b): exact and
    # stable however small the bin's mass is, since a - b = 2 inv_s / 255 > 0.
    log_mid = a + torch.log(-torch.expm1(b - a)) - F.softplus(a) - F.softplus(b)
    log_first = -F.softplus(-a)  # value 0: all the mass below the upper edge, log sigmoid(a)
    log_last = -F.softplus(b)  # value 255: all the mass above the lower edge, log(1 - sigmoid(b))
    v = values[..., None]
    log_comp = torch.where(v == 0, log_first, torch.where(v == 255, log_last, log_mid))
    return torch.logsumexp(log_comp + F.log_softmax(logits, dim=-1), dim=-1)


def bits_per_dim(nll_nats_sum, dims):
    """The paper's metric: negative log-likelihood in nats over all predicted dims, in bits."""
    return nll_nats_sum / (math.log(2.0) * dims)


@torch.no_grad()
def sample(params, generator=None):
    """One value in 0..255 per position. params (..., 3K) -> (...) int64.

    The component is drawn by the Gumbel-max trick, argmax_k(logit_k - log(-log u_k)), an exact
    draw from softmax(logits) that, unlike torch.multinomial, compiles into the generation
    step's graph; then the value by the logistic's inverse CDF. One uniform draw serves both."""
    logits, mu, log_s = split_params(params)
    rng = {} if generator is None else {"generator": generator}  # rand(generator=None) takes no symbolic sizes
    u = torch.rand(*logits.shape[:-1], logits.shape[-1] + 1, device=logits.device, dtype=logits.dtype,
                   **rng)  # (..., K + 1)
    gumbel = -torch.log(-torch.log(u[..., :-1].clamp(min=torch.finfo(u.dtype).tiny)))
    k = (logits + gumbel).argmax(-1, keepdim=True)  # (..., 1)
    mu, log_s = mu.gather(-1, k)[..., 0], log_s.gather(-1, k)[..., 0]
    u = u[..., -1].clamp(1e-5, 1 - 1e-5)
    x = mu + torch.exp(log_s) * (torch.log(u) - torch.log1p(-u))  # inverse CDF of the logistic
    return ((x.clamp(-1, 1) + 1) * 127.5).round().long()
