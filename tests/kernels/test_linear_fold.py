"""Causal linear attention with the normaliser folded into the product (one pass over [v, 1],
repro/kernels/normalised/attention.py) against the unfused float64 formula, through the layer a model uses:
forward and backward, fp32, bf16 and fp16 (the sums in fp32, only the normalised output rounded),
and second derivatives (gradgradcheck, a gradient penalty)."""
import pytest
import torch
import torch.nn.functional as F

from repro.attention import LinearAttention
from repro.kernels.normalised.attention import causal_linear_attention


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


def test_second_derivatives_through_the_normalised_product_and_the_layer():
    """gradgradcheck (float64) through causal_linear_attention and the causal layer: _Normalise
    and the causal product beneath it were once-only backwards (create_graph gave None or partial
    gradients: a gradient penalty of 0.655 against the true 2.612)."""
    gen = torch.Generator().manual_seed(2)
    phi_q, phi_k = (torch.rand(1, 2, 13, 3, dtype=torch.float64, generator=gen).add(0.3).requires_grad_()
                    for _ in range(2))
    v = torch.randn(1, 2, 13, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda *a: causal_linear_attention(*a, 1e-6), (phi_q, phi_k, v))
    layer = LinearAttention(d_model=6, n_heads=2).double()
    x = torch.randn(1, 9, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x: layer(x, causal=True), (x,))


def test_gradient_penalty_through_the_layer_matches_the_unfused_formula():
    """sum ||d L / d x||^2, then backward (a gradient penalty), through the causal layer (N = 70:
    two chunks, the second partial) against the same through the float64 formula written out."""
    torch.manual_seed(3)
    layer = LinearAttention(d_model=16, n_heads=2).double()
    x = torch.randn(2, 70, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 70, 16, dtype=torch.float64)
    params = [x, *(p for name, p in layer.named_parameters() if name != "out_proj.bias")]  # d x leaves it out
    results = []
    for fn in (lambda x: layer(x, causal=True), lambda x: unfused(layer, x)):
        (gx,) = torch.autograd.grad((fn(x) * w).sum(), x, create_graph=True)
        penalty = gx.square().sum()
        results.append((penalty, *torch.autograd.grad(penalty, params)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_fp16_at_long_n_normalises_before_rounding():
    """fp16 at N = 4,096 with non-zero-mean inputs: the numerator sum_j (phi(q_i) . phi(k_j)) v_j
    passes fp16's 65,504 long before it is divided (26-91 % of the outputs were inf or NaN when
    it was rounded first). Against fp32 and the float64 cumulative-sum formula, forward and
    gradients."""
    gen = torch.Generator().manual_seed(4)
    b, h, n, f, m = 1, 2, 4096, 16, 8
    phi_q, phi_k = (F.elu(torch.randn(b, h, n, f, generator=gen) * 2 + 1) + 1 for _ in range(2))
    v = torch.randn(b, h, n, m, generator=gen) + 3
    g = torch.randn(b, h, n, m, generator=gen)
    q64, k64, v64 = (x.double().requires_grad_() for x in (phi_q, phi_k, v))
    s = (k64[..., :, None] * v64[..., None, :]).cumsum(2)  # (B, H, N, F, M): S_i
    den = torch.einsum("bhnf,bhnf->bhn", q64, k64.cumsum(2))  # phi(q_i) . Z_i
    ref = torch.einsum("bhnf,bhnfm->bhnm", q64, s) / (den[..., None] + 1e-6)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-2)):
        ins = [x.to(dtype).requires_grad_() for x in (phi_q, phi_k, v)]
        out = causal_linear_attention(*ins, 1e-6)
        assert out.dtype == dtype and torch.isfinite(out).all(), f"{dtype}: non-finite outputs"
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * 3)
        for name, a, r in zip(("phi q", "phi k", "v"), torch.autograd.grad(out, ins, g.to(dtype)), ref_grads):
            assert torch.isfinite(a).all() and (a.double() - r).abs().max() / r.abs().max() < tol, f"{dtype} {name}"
