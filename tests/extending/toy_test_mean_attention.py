"""The toy attention against the naive formula in float64, and its recurrent twin against its
parallel form (docs/extending.md). Copied to tests/ by tests/test_extending.py."""
import torch

from repro.attention.mean import MeanAttention


def test_mean_attention_matches_the_formula_and_its_recurrent_twin():
    torch.manual_seed(0)
    layer = MeanAttention(d_model=12, n_heads=3).double()
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    v = layer._heads(x, layer.v_proj, layer.d_values)  # (B, H, N, M)
    want = torch.stack([v[:, :, : i + 1].mean(2) for i in range(7)], 2)  # the formula, token by token
    got = layer.attend(None, None, v, causal=True, key_padding_mask=None)
    torch.testing.assert_close(got, want)
    state, steps = None, []
    for t in range(7):
        y, state = layer.step(x[:, t], state)
        steps.append(y)
    torch.testing.assert_close(torch.stack(steps, 1), layer(x, causal=True))
