"""repro.training.memory.saved_bytes: what autograd keeps for backward, counted over distinct
storages, against sums written out by hand."""
import torch
from torch import nn

from repro.training.memory import layer_saved_mib, saved_bytes


def test_counts_each_saved_storage_once():
    x = torch.randn(7, 5, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    # x @ w keeps x and w; exp keeps its output; the view x[1:] shares x's storage
    nbytes, out = saved_bytes(lambda: ((x @ w).exp(), x[1:] * 2.0))
    assert nbytes == (7 * 5 + 5 * 3 + 7 * 3) * 4
    assert out[0].shape == (7, 3)


def test_parameters_count_and_nothing_is_kept_without_grad():
    layer = nn.Linear(16, 4).double()
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    nbytes, _ = saved_bytes(layer, x)
    assert nbytes == (3 * 16 + 4 * 16) * 8  # the input and the weight (the bias needs nothing)
    with torch.no_grad():
        assert saved_bytes(layer, x)[0] == 0
    assert layer_saved_mib(layer, torch.randn(3, 16, dtype=torch.float64)) == nbytes / 2**20
