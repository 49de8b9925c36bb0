"""Linear attention (the paper's Section 3.2): sim(q, k) = phi(q)^T phi(k), so

    V'_i = phi(Q_i)^T S / phi(Q_i)^T Z,  S = sum_j phi(K_j) V_j^T,  Z = sum_j phi(K_j),

with the sums over j <= i when causal. Its recurrent twin carries (S, Z) from token to token.

What the layer keeps for backward (docs/attention.md): its own autograd Function,
_RecomputedAttention, keeps only q, k, v (views of the projections' outputs), the output (whose
storage the output projection keeps too) and 1 / (den + eps), and recomputes phi(Q), phi(K) and
[v, 1] in its backward, so that the layer keeps no more than SDPA softmax's (x, q, k, v, the
output and a log-sum-exp). Causal fp32 calls with phi = elu + 1 on the CPU run both passes in one
fused kernel (repro.kernels.normalised.cpu_layer), which makes phi and [v, 1] a chunk at a time and holds
nothing else. Under create_graph (second derivatives) that backward runs the
differentiable formula instead (_attend_autograd), so the gradients are differentiable in turn.
"""
import torch

from repro.attention.base import AttentionLayer
from repro.attention.feature_maps import EluFeatureMap
from repro.kernels import cupy_for
from repro.kernels.normalised import cpu_layer
from repro.kernels.normalised.attention import causal_linear_attention
from repro.kernels.normalised.blocked import WORKSPACE_BYTES, normalised_backward, normalised_forward
from repro.kernels.plumbing.dtypes import accumulation_dtype
from repro.kernels.recurrent.step import LinearState, linear_attention_step, new_state

__all__ = ["LinearAttention", "LinearState"]


def _buffer_versions(module):
    return [b._version for b in module.buffers()]


def _feature_fns(layer, mask, acc):
    """The feature map as repro.kernels.normalised.blocked takes it: phi of a slice of q or k (padded keys
    zeroed), in acc; and x's gradient from phi's, by the map's closed form in phi where it has one
    (elu + 1: d phi / dx = min(phi, 1), in place, with no graph), else by autograd through the
    graph recorded when phi was taken."""
    closed = layer.feature_map.grad_from_phi

    def phi(x, idx, key, graph):
        part, m = x[idx], None if mask is None or not key else mask[idx[0], idx[2]]
        if graph and closed is None:
            with torch.enable_grad():
                xd = part.detach().requires_grad_()
                p = layer._phi_one(xd, m)  # (b, h, T, F)
            return p.detach().to(acc), (xd, p)
        return layer._phi_one(part, m).to(acc), None

    def phi_grad(handle, p, grad_p, out):
        if handle is None:
            closed(p, grad_p, out)
        else:
            (gx,) = torch.autograd.grad(handle[1], handle[0], grad_p.to(handle[1].dtype))
            out.copy_(gx)

    return phi, phi_grad


class _RecomputedAttention(torch.autograd.Function):
    """(q, k, v) (B, H, N, D|M) -> y (B, H, N, M), a view of a contiguous (B, N, H, M) tensor,
    keeping q, k, v, y and inv = 1 / (den + eps) (B, H, N, 1) for backward. phi(Q), phi(K) and
    [v, 1] are recomputed there: a few elementwise passes, against 2 N F + N (M + 1) values
    per head kept otherwise (the product's chunk states, about N D M / C more, are recomputed
    too, by one matmul and a scan). Both passes run in bounded workspace (repro.kernels.normalised.blocked)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, key_padding_mask, layer):
        acc = accumulation_dtype(q.dtype)
        fused = cpu_layer.applies(q, k, v, causal, layer.feature_map)
        out = cpu_layer.forward(q, k, v, key_padding_mask, layer.eps) if fused else None
        if out is None:  # elsewhere, or an inf or NaN in k or v: the exact path
            with torch.autocast(q.device.type, enabled=False):  # dtypes are chosen here (sums in acc), not by autocast
                out = normalised_forward(q, k, v, _feature_fns(layer, key_padding_mask, acc)[0], layer.eps, causal,
                                         acc, layer.workspace)
        y, inv = out
        ctx.save_for_backward(q, k, v, y, inv)
        # The mask is the caller's and tiny; a feature map's buffers (Performer's W) are module
        # state, not copied: a redraw before this backward is caught by their versions instead.
        ctx.causal, ctx.mask, ctx.layer = causal, key_padding_mask, layer
        ctx.versions = _buffer_versions(layer.feature_map)
        return y

    @staticmethod
    def backward(ctx, g):
        q, k, v, y, inv = ctx.saved_tensors
        layer, need = ctx.layer, ctx.needs_input_grad[:3]
        if _buffer_versions(layer.feature_map) != ctx.versions:
            raise RuntimeError(f"{type(layer).__name__}: the feature map's buffers changed between forward and "
                               f"backward (a redraw, new_feature_map()); run backward before the next forward")
        if torch.is_grad_enabled():
            # create_graph: the gradients through the differentiable formula on the saved inputs
            # (which keep their graph here), so they are differentiable in turn.
            inputs = [x for x, r in zip((q, k, v), need) if r]
            with torch.enable_grad():
                out = layer._attend_autograd(q, k, v, ctx.causal, ctx.mask)
            grads = iter(torch.autograd.grad(out, inputs, g, create_graph=True))
            return (*(next(grads) if r else None for r in need), None, None, None)
        # Each in the projection's (B, N, H, X) layout, which its backward reads without a copy.
        grads = None
        if cpu_layer.applies(q, k, v, ctx.causal, layer.feature_map) and g.dtype == torch.float32:
            grads = cpu_layer.backward(q, k, v, ctx.mask, y, inv, g, need)
        if grads is None:
            with torch.autocast(q.device.type, enabled=False):
                grads = normalised_backward(q, k, v, y, inv, g, *_feature_fns(layer, ctx.mask, inv.dtype),
                                            ctx.causal, need, layer.workspace)
        return (*grads, None, None, None)


class LinearAttention(AttentionLayer):
    recurrent = True

    def __init__(self, d_model, n_heads, d_keys=None, d_values=None, feature_map=None, eps: float = 1e-6,
                 workspace_mb: float | None = None):
        super().__init__(d_model, n_heads, d_keys, d_values)
        if workspace_mb is not None and not 0 < workspace_mb < float("inf"):
            raise ValueError(f"{type(self).__name__}: workspace_mb must be finite and > 0, or null (the default: "
                             f"{WORKSPACE_BYTES / 2**20:g} MiB, less for a small problem); got {workspace_mb}")
        self.feature_map = (feature_map or EluFeatureMap)(self.d_keys)
        self.eps = eps
        # MiB per thread for the CPU passes' intermediates (repro.kernels.normalised.blocked): smaller lowers
        # the peak toward SDPA softmax's and costs speed (more, smaller groups; docs/attention.md).
        # In bytes, at least 1 (0 would read as the default).
        self.workspace = None if workspace_mb is None else max(1, int(workspace_mb * 2**20))

    def _phi(self, q, k, key_padding_mask):
        """phi(Q), phi(K) (B, H, N, F), padded keys zeroed."""
        # q and k are (B, N, H, D) projections seen as (B, H, N, D). A feature map that writes a
        # contiguous phi from any layout (elu + 1) takes them as they are; others get contiguous
        # copies, and so does every map under torch.compile: on such a layout torch's meta
        # function for elu's backward predicts other strides than its CPU kernel returns, which
        # breaks compiled (AOTAutograd) backward graphs.
        return self._phi_one(q), self._phi_one(k, key_padding_mask)

    def _phi_one(self, x, key_padding_mask=None):
        """phi(x) (B, H, N, F), contiguous; positions padded in key_padding_mask (B, N) zeroed."""
        if not self.feature_map.contiguous_output or torch.compiler.is_compiling():
            x = x.contiguous()
        phi = self.feature_map(x)
        if key_padding_mask is not None:  # padded keys add nothing; in place where no graph can need phi
            mask = key_padding_mask[:, None, :, None]
            phi = phi.masked_fill(mask, 0.0) if torch.is_grad_enabled() else phi.masked_fill_(mask, 0.0)
        return phi

    def _recomputes(self, q, k, v, causal):
        """Whether attend takes _RecomputedAttention: not in traced graphs (the compiler keeps its
        own choice of what to save), not for a feature map with trainable parameters (the
        Function returns no gradient for them), not where the fused CUDA kernel runs."""
        if torch.compiler.is_compiling() or any(p.requires_grad for p in self.feature_map.parameters()):
            return False
        return not (causal and cupy_for("normalised", q, k, v))

    def attend(self, q, k, v, causal, key_padding_mask):
        if self._recomputes(q, k, v, causal):
            return _RecomputedAttention.apply(q, k, v, causal, key_padding_mask, self)  # (B, H, N, M)
        return self._attend_autograd(q, k, v, causal, key_padding_mask)

    def _attend_autograd(self, q, k, v, causal, key_padding_mask):
        """The attention by differentiable ops (autograd keeps what each op saves): traced graphs,
        the fused CUDA kernel, and second derivatives of _RecomputedAttention."""
        phi_q, phi_k = self._phi(q, k, key_padding_mask)
        if causal:  # sums over j <= i: the kernel dispatcher picks the path
            return causal_linear_attention(phi_q, phi_k, v, self.eps)  # (B, H, N, M)
        acc = accumulation_dtype(phi_q.dtype)
        phi_q, phi_k = phi_q.to(acc), phi_k.to(acc)
        S = phi_k.transpose(-1, -2) @ v.to(acc)  # (B, H, F, M): sum_j phi(K_j) V_j^T
        Z = phi_k.sum(2)  # (B, H, F): sum_j phi(K_j)
        num = phi_q @ S  # (B, H, N, M)
        den = (phi_q @ Z[..., None])[..., 0]  # (B, H, N)
        return (num / (den[..., None] + self.eps)).to(v.dtype)

    def attend_step(self, q, k, v, state: LinearState | None):
        phi_q, phi_k = self.feature_map(q), self.feature_map(k)  # (B, H, F)
        if state is None:
            state = new_state(phi_q, v)  # S = 0 (B, H, F, M), Z = 0 (B, H, F)
        return linear_attention_step(phi_q, phi_k, v, state, self.eps), state  # the kernel picks the path
