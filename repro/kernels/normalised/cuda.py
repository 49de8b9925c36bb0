"""The normalised causal attention's CuPy backend: causal_dot.cu's kernels with the normaliser fused
(repro.kernels.causal_product.cuda's launch with norm), behind a torch op.

    causal_linear_attention(q, k, v, eps)        sum_{j<=i} (q_i . k_j) v_j / (q_i . sum_{j<=i} k_j + eps)

A torch.library.custom_op with its backward registered, as the causal product's; its gradients
are the product's on [v, 1], and under create_graph the same by differentiable ops.
"""
import torch
from torch import Tensor

from repro.kernels.causal_product import cuda as product
from repro.kernels.causal_product.chunked import causal_product_grads
from repro.kernels.plumbing.cupy_launch import (
    CALLS,
    contiguous_like,
    device_reason,
    flat,
    gate_reason,
    shape_reason,
)


def unsupported_reason(q, k, v):
    """None when causal_linear_attention can take q, k, v, else why not."""
    if not (q.dtype == k.dtype == v.dtype and q.shape == k.shape and q.shape[:-1] == v.shape[:-1]):
        return "q, k, v must share a dtype and (..., N) with q, k of one shape"
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return gate_reason("causal_linear_attention", q.dtype, backward) or shape_reason(q, v) or device_reason(
        q, (q.shape[-1], v.shape[-1] + 1), "causal_linear_attention")


@torch.library.custom_op("repro::causal_linear_attention", mutates_args=(), device_types="cuda")
def _cla(q: Tensor, k: Tensor, v: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    CALLS["causal_linear_attention"] += 1
    out, den = product.launch(flat(q), flat(k), flat(v), norm=True, eps=eps)
    return out.view(*q.shape[:-1], v.shape[-1]), den.view(q.shape[:-1])


@_cla.register_fake
def _(q, k, v, eps):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("repro::causal_linear_attention_backward", mutates_args=(), device_types="cuda")
def _cla_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, den: Tensor, g: Tensor,
                  g_den: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    # y = num / e with e = den + eps: dL/dnum = g / e, dL/dden = -(g . y) / e. Then num and den
    # are one causal product against [v, 1], so the gradients are the plain backward's with
    # V' = [v, 1] and G' = [dL/dnum, dL/dden]; all in fp32 (den's gradient needs the precision).
    CALLS["causal_linear_attention_backward"] += 1
    e = den.float() + eps  # (..., N)
    g32 = g.float()
    g_num = g32 / e[..., None]  # (..., N, M)
    g_d = -(g32 * out.float()).sum(-1) / e
    if g_den is not None:
        g_d = g_d + g_den.float()
    v1 = flat(torch.cat([v.float(), v.new_ones(*v.shape[:-1], 1, dtype=torch.float32)], -1))
    g1 = flat(torch.cat([g_num, g_d[..., None]], -1))
    q3, k3 = flat(q.float()), flat(k.float())
    grad_q, _ = product.launch(g1, v1, k3)
    grad_k, _ = product.launch(v1, g1, q3, rev=True)
    grad_v, _ = product.launch(k3, q3, flat(g_num), rev=True)
    return (grad_q.view(q.shape).to(q.dtype), grad_k.view(k.shape).to(k.dtype),
            grad_v.view(v.shape).to(v.dtype))


@_cla_backward.register_fake
def _(q, k, v, out, den, g, g_den, eps):
    return contiguous_like(q), contiguous_like(k), contiguous_like(v)


def _cla_setup(ctx, inputs, output):
    q, k, v, eps = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.eps = eps


def cla_grads(product, q, k, v, out, den, g, g_den, eps, need=(True, True, True)):
    """_cla_backward's gradients by differentiable ops, the causal products by `product` (the
    CuPy product op here, the torch path in the CPU tests): second derivatives. out and den, saved outputs of
    _cla, carry its graph; their gradients come back to _cla_grad as g and g_den."""
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32, as _cla_backward (fp64 in the tests)
    e = den.to(acc) + eps  # (..., N)
    g_num = g.to(acc) / e[..., None]  # (..., N, M)
    g_d = -(g.to(acc) * out.to(acc)).sum(-1) / e
    if g_den is not None:
        g_d = g_d + g_den.to(acc)
    v1 = torch.cat([v.to(acc), v.new_ones(*v.shape[:-1], 1, dtype=acc)], -1)  # (..., N, M + 1)
    grad_q, grad_k, grad_v1 = causal_product_grads(product, q.to(acc), k.to(acc), v1,
                                                   torch.cat([g_num, g_d[..., None]], -1), need)
    grads = grad_q, grad_k, None if grad_v1 is None else grad_v1[..., :-1]  # v's part of [v, 1]
    return tuple(None if gr is None else gr.to(x.dtype) for gr, x in zip(grads, (q, k, v)))


def _cla_grad(ctx, g, g_den):
    q, k, v, out, den = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable ops, the products by the forward op
        grads = cla_grads(product.causal_dot_product, q, k, v, out, den, g, g_den, ctx.eps, ctx.needs_input_grad)
        return (*grads, None)
    return (*_cla_backward(q, k, v, out, den, g, g_den, ctx.eps), None)


_cla.register_autograd(_cla_grad, setup_context=_cla_setup)


def causal_linear_attention(q, k, v, eps: float):
    """phi(q), phi(k) (..., N, F), v (..., N, M) -> (..., N, M): the causal linear attention
    sum_{j<=i} (q_i . k_j) v_j / (q_i . sum_{j<=i} k_j + eps), numerator and normaliser in one
    pass. Check unsupported_reason first."""
    return _cla(q, k, v, float(eps))[0]
