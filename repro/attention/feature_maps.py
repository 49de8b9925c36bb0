"""Feature maps phi for linear attention, sim(q, k) = phi(q)^T phi(k).

A feature map is built per layer from the head dimension (random-feature maps need it) and
maps (..., D) -> (..., F). Configs pass the class as a partial:
    feature_map: {_target_: repro.attention.feature_maps.EluFeatureMap, _partial_: true}
"""
import torch.nn.functional as F
from torch import nn


class FeatureMap(nn.Module):
    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim

    def new_feature_map(self):
        """Redraw any randomness (no-op for deterministic maps)."""


class EluFeatureMap(FeatureMap):
    """phi(x) = elu(x) + 1, the paper's choice: positive, and the identity's slope for x > 0."""

    def forward(self, x):
        # + 1 in place on elu's fresh output: one allocation fewer (elu's backward needs its
        # input, not its output, so autograd allows it).
        return F.elu(x).add_(1)


class ReluFeatureMap(FeatureMap):
    """phi(x) = relu(x): positive but can be all zero; rely on the attention's eps."""

    def forward(self, x):
        return F.relu(x)
