"""The example op against its reference: odd sizes, float64 and float32, and its gradient."""
import pytest
import torch

from repro.kernels.causal_mean.chunked import causal_mean
from repro.kernels.causal_mean.reference import causal_mean_loop


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 37, 5), (1, 2, 130, 7)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_causal_mean_matches_its_reference(shape, dtype, tol):
    v = torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(sum(shape)))
    torch.testing.assert_close(causal_mean(v), causal_mean_loop(v), rtol=tol, atol=tol)


def test_causal_mean_gradient_matches_its_reference():
    v = torch.randn(2, 2, 11, 3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 2, 11, 3, dtype=torch.float64)
    want = torch.autograd.grad(causal_mean_loop(v), v, g)[0]
    torch.testing.assert_close(torch.autograd.grad(causal_mean(v), v, g)[0], want)
