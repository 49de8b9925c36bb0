"""Softmax and linear attention against explicit float64 formulas; recurrent == parallel."""
import math

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from repro.attention import LinearAttention, SoftmaxAttention
from repro.attention.feature_maps import ReluFeatureMap
from repro.conf import compose_group


def _qkv(b=2, h=3, n=13, d=5, m=7):
    return (torch.randn(b, h, n, d, dtype=torch.float64), torch.randn(b, h, n, d, dtype=torch.float64),
            torch.randn(b, h, n, m, dtype=torch.float64))


def explicit_linear(q, k, v, causal, pad=None, eps=1e-6, phi=lambda x: F.elu(x) + 1):
    """V'_i = sum_j sim(q_i, k_j) v_j / sum_j sim(q_i, k_j), with the (N, N) matrix written out."""
    sim = phi(q) @ phi(k).transpose(-1, -2)  # (B, H, N, N)
    n = q.shape[-2]
    if causal:
        sim = sim * torch.ones(n, n, dtype=sim.dtype).tril()
    if pad is not None:
        sim = sim.masked_fill(pad[:, None, None, :], 0.0)
    return (sim @ v) / (sim.sum(-1, keepdim=True) + eps)


def explicit_softmax(q, k, v, causal, pad=None):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    if causal:
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    if pad is not None:
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    return scores.softmax(-1) @ v


def _pad(b, n):
    lengths = torch.randint(n // 2, n + 1, (b,))
    lengths[0] = n
    return torch.arange(n)[None, :] >= lengths[:, None]  # True = padding


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_linear_matches_explicit_formula(causal, padded):
    q, k, v = _qkv()
    pad = _pad(2, 13) if padded else None
    layer = LinearAttention(d_model=8, n_heads=2).double()
    torch.testing.assert_close(layer.attend(q, k, v, causal, pad), explicit_linear(q, k, v, causal, pad))


def test_linear_gradients_match_explicit_formula():
    q, k, v = (x.requires_grad_() for x in _qkv(n=37))
    layer = LinearAttention(d_model=8, n_heads=2).double()
    g = torch.randn(2, 3, 37, 7, dtype=torch.float64)
    got = torch.autograd.grad(layer.attend(q, k, v, True, None), (q, k, v), g)
    want = torch.autograd.grad(explicit_linear(q, k, v, True), (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_linear_feature_map_is_pluggable():
    q, k, v = _qkv()
    layer = LinearAttention(d_model=8, n_heads=2, feature_map=ReluFeatureMap).double()
    torch.testing.assert_close(layer.attend(q, k, v, True, None),
                               explicit_linear(q, k, v, True, phi=F.relu))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("backend", [None, "math"])
def test_softmax_matches_explicit_formula(causal, padded, backend):
    q, k, v = _qkv()
    pad = _pad(2, 13) if padded else None
    layer = SoftmaxAttention(d_model=8, n_heads=2, sdpa_backend=backend).double()
    out, ref = layer.attend(q, k, v, causal, pad), explicit_softmax(q, k, v, causal, pad)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("name", ["softmax", "linear"])
def test_padding_changes_no_real_output(name):
    layer = instantiate(compose_group("attention", name))(d_model=16, n_heads=4).eval()
    x = torch.randn(2, 11, 16)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[1, 7:] = True
    for causal in (False, True):
        y = layer(x, causal=causal, key_padding_mask=pad)
        x2 = x.clone()
        x2[1, 7:] = 100 * torch.randn(4, 16)  # garbage in the padded frames
        y2 = layer(x2, causal=causal, key_padding_mask=pad)
        torch.testing.assert_close(y[~pad], y2[~pad])


@pytest.mark.parametrize("name", ["softmax", "softmax-math", "linear"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_recurrent_step_equals_parallel(name, dtype):
    layer = instantiate(compose_group("attention", name))(d_model=24, n_heads=3).to(dtype).eval()
    x = torch.randn(2, 70, 24, dtype=dtype)  # 70 > the KV cache's initial 64: exercises its growth
    parallel = layer(x, causal=True)
    state, steps = None, []
    for t in range(x.shape[1]):
        y, state = layer.step(x[:, t], state)
        steps.append(y)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(torch.stack(steps, 1), parallel, rtol=tol, atol=tol)


def test_bfloat16_layers_track_float64():
    x = torch.randn(2, 45, 32, dtype=torch.float64)
    for name in ("softmax", "linear"):
        layer = instantiate(compose_group("attention", name))(d_model=32, n_heads=4).double().eval()
        ref = layer(x, causal=True)
        out = layer.to(torch.bfloat16)(x.to(torch.bfloat16), causal=True)
        assert out.dtype == torch.bfloat16
        assert (out.double() - ref).abs().max() / ref.abs().max() < 5e-2


def test_layer_rejects_bad_shapes():
    layer = LinearAttention(d_model=8, n_heads=2)
    with pytest.raises(ValueError, match=r"x must be \(B, N, d_model=8\)"):
        layer(torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match="key_padding_mask must be bool"):
        layer(torch.randn(2, 5, 8), key_padding_mask=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="not divisible by n_heads=3"):
        LinearAttention(d_model=8, n_heads=3)
    with pytest.raises(ValueError, match="unknown sdpa_backend 'fast'"):
        SoftmaxAttention(d_model=8, n_heads=2, sdpa_backend="fast")


@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
def test_elu_feature_map_is_elu_plus_one_contiguous_and_twice_differentiable(layout):
    """phi = elu + 1 written from the layer's strided (B, H, N, D) views straight into a
    contiguous tensor: against torch's F.elu(x) + 1 in float64, values and first and second
    derivatives (gradcheck, gradgradcheck)."""
    from repro.attention.feature_maps import EluFeatureMap
    phi = EluFeatureMap(5)
    x = torch.randn(2, 7, 3, 5, dtype=torch.float64) * 2
    x = (x.transpose(1, 2) if layout == "transposed" else x.contiguous()).requires_grad_()
    y = phi(x)
    assert y.is_contiguous() and EluFeatureMap.contiguous_output
    torch.testing.assert_close(y, F.elu(x) + 1, rtol=0, atol=1e-15)
    torch.autograd.gradcheck(phi, (x,))
    torch.autograd.gradgradcheck(phi, (x,))
    with torch.no_grad():
        torch.testing.assert_close(phi(x), F.elu(x) + 1, rtol=0, atol=1e-15)
