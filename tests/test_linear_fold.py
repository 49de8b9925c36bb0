"""Causal linear attention with the normaliser folded into the product (one pass over [v, 1],
repro/attention/linear.py) against the unfused float64 formula, through the layer a model uses:
forward and backward, fp32 (folded) and bf16 (the separate fp32 normaliser)."""
import pytest
import torch
import torch.nn.functional as F

from repro.attention import LinearAttention


def unfused(layer, x):
    """The layer in float64 with num and den as two explicit (N, N) sums."""
    q, k, v = (layer._heads(x, p, d) for p, d in ((layer.q_proj, layer.d_keys), (layer.k_proj, layer.d_keys),
                                                   (layer.v_proj, layer.d_values)))
    q, k = F.elu(q) + 1, F.elu(k) + 1
    n = x.shape[1]
    sim = (q @ k.transpose(-1, -2)) * torch.ones(n, n, dtype=x.dtype).tril()  # (B, H, N, N)
    y = (sim @ v) / (sim.sum(-1, keepdim=True) + layer.eps)
    return layer.out_proj(y.transpose(1, 2).flatten(-2))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_folded_layer_matches_unfused_formula(dtype, tol):
    torch.manual_seed(0)
    ref_layer = LinearAttention(d_model=24, n_heads=3).double()
    x64 = torch.randn(2, 45, 24, dtype=torch.float64, requires_grad=True)  # N = 45: a partial chunk
    ref = unfused(ref_layer, x64)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (x64, *ref_layer.parameters()), g)

    layer = LinearAttention(d_model=24, n_heads=3).to(dtype)
    layer.load_state_dict(ref_layer.state_dict())
    x = x64.detach().to(dtype).requires_grad_()
    out = layer(x, causal=True)
    assert out.dtype == dtype
    assert (out.double() - ref).abs().max() / ref.abs().max() < tol
    for a, b in zip(torch.autograd.grad(out, (x, *layer.parameters()), g.to(dtype)), ref_grads):
        assert ((a.double() - b).abs().max() / b.abs().max()) < tol


def test_folded_layer_sum_backward():
    """out.sum().backward() (a stride-0 upstream gradient) through the folded layer."""
    torch.manual_seed(1)
    layer = LinearAttention(d_model=16, n_heads=2).double()
    x = torch.randn(1, 70, 16, dtype=torch.float64, requires_grad=True)
    layer(x, causal=True).sum().backward()
    got = x.grad.clone()
    want, = torch.autograd.grad(unfused(layer, x).sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
