"""Feature maps phi for linear attention, sim(q, k) = phi(q)^T phi(k).

A feature map is built per layer from the head dimension (random-feature maps need it) and
maps (..., D) -> (..., F). Configs pass the class as a partial:
    feature_map: {_target_: repro.attention.feature_maps.EluFeatureMap, _partial_: true}
"""
import torch
import torch.nn.functional as F
from torch import nn


class _EluPlusOne(torch.autograd.Function):
    """elu(x) + 1 from any layout into a new contiguous tensor, where a contiguous copy first
    would read and write every value once more (measured: the layer's fwd + bwd 1-4% faster at
    N = 256). On CPU as exp(min(x, 0)) + max(x, 0) (the same function, and exact where elu's
    expm1(x) + 1 rounds twice): torch's CPU elu kernel takes ~20 ns per value, 3-4x these three
    passes (1M fp32 values, 1 thread: 20-24 ms against 5.8-6.0 ms, load ~5), and the linear layer
    runs it again in its backward (repro.attention.linear). Its backward is elu's, on the saved
    input (twice differentiable), written in the input's layout."""

    @staticmethod
    def forward(ctx, x):
        phi = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ctx.save_for_backward(x)
        if x.device.type == "cpu":
            torch.clamp(x, min=0, out=phi)
            return phi.add_(x.clamp(max=0).exp_())
        torch.ops.aten.elu.out(x, 1.0, 1, 1, out=phi)
        return phi.add_(1)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the functional op, which has a derivative
            return torch.ops.aten.elu_backward(g, 1.0, 1, 1, False, x)
        # In x's layout (the projection's (B, N, H, D)), which the projection's backward then reads
        # without a copy: 1.6 ms -> 0.85 ms for 1M values with that copy, measured at 1 thread.
        return torch.ops.aten.elu_backward.grad_input(g, 1.0, 1, 1, False, x, grad_input=torch.empty_like(x))


class FeatureMap(nn.Module):
    # True where forward returns a contiguous tensor whatever the input's layout (the attention
    # then hands it its strided views as they are).
    contiguous_output = False

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim

    # grad_from_phi(phi, grad_phi, out): x's gradient from phi(x) alone, written into out (phi may
    # be overwritten), for maps with such a closed form; 0 where phi is 0 (padded keys). None:
    # autograd through phi (the linear layer's backward, repro.attention.linear).
    grad_from_phi = None
    # True where the linear layer's fused CPU kernel (repro.kernels.normalised.cpu_layer) computes this map
    # itself, inside the kernel: elu + 1 only (a subclass that changes forward must set it False).
    fused_cpu = False

    def new_feature_map(self):
        """Redraw any randomness (no-op for deterministic maps)."""


class EluFeatureMap(FeatureMap):
    """phi(x) = elu(x) + 1, the paper's choice: positive, and the identity's slope for x > 0."""

    contiguous_output = True
    fused_cpu = True

    @staticmethod
    def grad_from_phi(phi, grad_phi, out):
        """d phi / dx = 1 for x > 0 (phi = x + 1 > 1), e^x = phi for x <= 0 (phi <= 1): min(phi, 1),
        one pass with no graph where autograd would take phi's again and elu's backward on x."""
        torch.mul(grad_phi, phi.clamp_(max=1), out=out)

    def forward(self, x):
        if torch.compiler.is_compiling():
            # Traced: the plain ops, which inductor fuses anyway (the layout is the caller's:
            # LinearAttention makes q and k contiguous first when compiling). + 1 in place on
            # elu's fresh output: elu's backward needs its input, not its output.
            return F.elu(x).add_(1)
        return _EluPlusOne.apply(x)


class ReluFeatureMap(FeatureMap):
    """phi(x) = relu(x): positive but can be all zero; rely on the attention's eps."""

    def forward(self, x):
        return F.relu(x)
