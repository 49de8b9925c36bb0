"""The discretized logistic mixture against a direct float64 formula, normalisation, sampling."""
import math

import torch

from repro.models import logistic_mixture as dmol


def naive_log_prob(params, values):
    """Straight from the definition: sum_k pi_k [sigmoid((x - mu + 1/255)/s) - sigmoid((x - mu - 1/255)/s)],
    with the edge bins open, evaluated value by value in float64."""
    out = torch.empty(values.shape, dtype=torch.float64)
    flat_p, flat_v = params.double().reshape(-1, params.shape[-1]), values.reshape(-1)
    for i in range(flat_v.numel()):
        logits, mu, log_s = flat_p[i].chunk(3)
        s, x, v = torch.exp(log_s.clamp(min=-7)), flat_v[i].double() / 127.5 - 1, int(flat_v[i])
        upper = torch.sigmoid((x - mu + 1 / 255) / s) if v < 255 else torch.ones_like(mu)
        lower = torch.sigmoid((x - mu - 1 / 255) / s) if v > 0 else torch.zeros_like(mu)
        out.view(-1)[i] = torch.log((torch.softmax(logits, 0) * (upper - lower)).sum())
    return out


def _params(*shape, k=10):
    p = torch.randn(*shape, 3 * k, dtype=torch.float64)
    p[..., 2 * k:] = p[..., 2 * k:] * 2 - 3  # log-scales across [-9, 3]: sharp and broad components
    return p


def test_matches_the_definition():
    p = _params(3, 7)
    v = torch.randint(0, 256, (3, 7))
    v[0, :3] = torch.tensor([0, 255, 128])
    torch.testing.assert_close(dmol.log_prob(p, v), naive_log_prob(p, v), rtol=1e-9, atol=1e-9)


def test_probabilities_of_all_256_values_sum_to_one():
    for dtype, tol in [(torch.float64, 1e-10), (torch.float32, 1e-4)]:
        p = _params(5).to(dtype)
        lp = dmol.log_prob(p[:, None, :].expand(5, 256, -1), torch.arange(256).expand(5, 256))
        torch.testing.assert_close(lp.exp().sum(-1), torch.ones(5, dtype=lp.dtype), rtol=tol, atol=tol)


def test_sharp_component_stays_finite_with_the_scale_floor():
    # one component asking for a tiny scale centred on value 100: the log-scale floor (-7) leaves
    # p(100) = 2 sigmoid(e^7 / 255) - 1, and log p stays finite for every value
    k = 10
    p = torch.full((1, 3 * k), -20.0)
    p[0, 0], p[0, k] = 20.0, 100 / 127.5 - 1
    lp = dmol.log_prob(p.expand(256, -1), torch.arange(256))
    assert torch.isfinite(lp).all()
    expected = 2 * torch.sigmoid(torch.tensor(math.exp(7) / 255)) - 1
    torch.testing.assert_close(lp[100].exp(), expected, rtol=1e-5, atol=1e-6)


def test_samples_follow_the_distribution():
    gen = torch.Generator().manual_seed(0)
    p = _params(1, k=3)[0]
    p[6:] = -2.5  # moderately broad components, so most of the 256 bins get mass
    samples = dmol.sample(p.expand(40000, -1), generator=gen)
    probs = dmol.log_prob(p.expand(256, -1), torch.arange(256)).exp()
    hist = torch.bincount(samples, minlength=256).double() / samples.numel()
    assert samples.min() >= 0 and samples.max() <= 255
    assert (hist - probs).abs().sum() < 0.06  # total variation of the empirical histogram


def test_bits_per_dim_is_nats_over_ln2_dims():
    assert dmol.bits_per_dim(torch.tensor(783 * math.log(2) * 0.5), 783).item() == 0.5
