"""What the successors' layers (retention, gla, delta) keep for backward, counted exactly
(repro.training.memory.saved_bytes), against the linear layer's at the same shapes; their own
autograd Function (repro.attention.successors._RecomputedReadout) against plain autograd through
the same layer: outputs and the gradients of x and every parameter, causal or not, padded, under
bf16 autocast, with only some inputs needing a gradient; second derivatives, and gradients taken
with create_graph against those without and plain autograd's; a parameter changed between forward
and backward."""
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from repro.attention import LinearAttention, successors
from repro.conf import compose_group
from repro.kernels.gated import chunked as gated
from repro.training.memory import saved_bytes

NAMES = ["retention", "gla", "delta"]


def build(name, d_model, n_heads, dtype=torch.float32, **kw):
    cfg = compose_group("attention", name)
    OmegaConf.set_struct(cfg, False)
    return instantiate(OmegaConf.merge(cfg, kw))(d_model=d_model, n_heads=n_heads).to(dtype)


def expected_bytes(layer, x):
    """Its input, the output projection's input (a (B, N, H M) copy of the readout) and its
    parameters, but the output projection's bias (its gradient needs nothing)."""
    b, n, _ = x.shape
    params = sum(p.numel() for p in layer.parameters()) - layer.out_proj.bias.numel()
    return (x.numel() + b * n * layer.n_heads * layer.d_values + params) * x.element_size()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [256, 1024])
@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_successor_layer_keeps_no_more_for_backward_than_linear(name, n, d, dtype):
    """One layer, B = 2, H = 4, head size D, causal: at most the linear layer's bytes (x, q, k,
    v, its output, 1 / (den + eps)), exactly x, the readout and the parameters. Through plain
    autograd they kept 2.7-5.2x linear's in fp32 (N = 1,024, D = 16: 8.4, 12.8 and 13.5 MiB
    against 2.6): q, k, v scaled or normalised, the chunks' (C, C) scores and states, the norm's
    and the gate's intermediates."""
    torch.manual_seed(0)
    x = torch.randn(2, n, 4 * d, dtype=dtype, requires_grad=True)
    linear, _ = saved_bytes(LinearAttention(4 * d, 4).to(dtype), x, causal=True)
    layer = build(name, 4 * d, 4, dtype)
    kept, y = saved_bytes(layer, x, causal=True)
    assert kept <= linear, f"{name}: {kept / 2**20:.3f} MiB kept, linear {linear / 2**20:.3f} MiB"
    assert kept == expected_bytes(layer, x)
    y.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters())


@pytest.mark.parametrize("name,kw", [("retention", {}), ("gla", {"bidirectional": True}),
                                     ("delta", {"bidirectional": True})])
def test_non_causal_and_padded_layers_keep_no_more_than_linear(name, kw):
    """causal=False (retention's decay by distance; gla and delta in both directions: two passes)
    with padded keys: x, the readout and the parameters, under non-causal linear's bytes."""
    torch.manual_seed(0)
    x = torch.randn(2, 256, 64, requires_grad=True)
    pad = torch.arange(256)[None, :] >= torch.tensor([256, 190])[:, None]
    linear, _ = saved_bytes(LinearAttention(64, 4), x, causal=False, key_padding_mask=pad)
    layer = build(name, 64, 4, **kw)
    kept, _ = saved_bytes(layer, x, causal=False, key_padding_mask=pad)
    assert kept <= linear and kept == expected_bytes(layer, x)


def plain_autograd(monkeypatch):
    """Route attend around the Function: plain autograd through the same readout."""
    monkeypatch.setattr(successors._RecomputedReadout, "apply",
                        lambda layer, causal, keep, x, q, k, v, *params: layer._readout(x, q, k, v, causal, keep))


def in_graph(y, name):
    seen, todo = set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            todo.extend(f for f, _ in fn.next_functions)
    return name in {type(fn).__name__ for fn in seen}


def outputs_and_grads(layer, x, causal, pad, g):
    y = layer(x, causal=causal, key_padding_mask=pad)
    wrt = [t for t in (x, *layer.parameters()) if t.requires_grad]
    return y, torch.autograd.grad(y, wrt, g, allow_unused=True)


@pytest.mark.parametrize("name,causal,kw", [("retention", True, {}), ("retention", False, {}), ("gla", True, {}),
                                            ("gla", False, {"bidirectional": True}), ("delta", True, {}),
                                            ("delta", False, {"bidirectional": True, "output_gate": True})])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("need", ["all", "parameters", "x", "some"])
def test_the_recomputed_layer_equals_plain_autograd(monkeypatch, name, causal, kw, padded, need):
    """float64, N = 37 (C = 8: a partial last chunk), D = 6 != M = 10: y and the gradients of x
    and every parameter that needs one, through the Function and through plain autograd, equal
    to rounding; need: everything, the parameters alone (x without gradient: a model's first
    layer on fixed inputs), x alone (every parameter frozen), or x with the q and gate projections
    and the norm frozen."""
    torch.manual_seed(1)
    layer = build(name, 24, 3, torch.float64, d_keys=6, d_values=10, chunk_size=8, **kw)
    x = torch.randn(3, 37, 24, dtype=torch.float64, requires_grad=need != "parameters")
    for pname, p in layer.named_parameters():
        p.requires_grad_(need in ("all", "parameters") or need == "some" and not pname.startswith(
            ("q_proj", "gate_proj", "norm")))
    pad = torch.arange(37)[None, :] >= torch.tensor([37, 30, 11])[:, None] if padded else None
    g = torch.randn(3, 37, 24, dtype=torch.float64)
    y, grads = outputs_and_grads(layer, x, causal, pad, g)
    assert in_graph(y, "_RecomputedReadoutBackward")
    with monkeypatch.context() as m:
        plain_autograd(m)
        y_ref, ref = outputs_and_grads(layer, x, causal, pad, g)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    assert len(grads) == len(ref) > 0
    for a, r in zip(grads, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_under_autocast_the_backward_recomputes_what_the_forward_computed(monkeypatch, name):
    """The forward under bf16 autocast on the CPU, the backward after it (the trainer's dtype
    option): the backward recomputes under the forward's autocast, so every parameter's gradient
    is plain autograd's (outside it, the readout would run in fp32 and the gradients would belong
    to another function: off by 0.02-0.3 here). x's gradient sums its parts in another order (plain
    autograd in bf16 at x's one cached bf16 copy; here the readout's part comes in fp32): close."""
    torch.manual_seed(2)
    layer = build(name, 64, 4, chunk_size=16)
    x = torch.randn(2, 50, 64, requires_grad=True)
    g = torch.randn(2, 50, 64)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x, causal=True)
        return y, torch.autograd.grad(y, [x, *layer.parameters()], g, allow_unused=True)

    y, (gx, *grads) = run()
    with monkeypatch.context() as m:
        plain_autograd(m)
        y_ref, (gx_ref, *ref) = run()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    for a, r in zip(grads, ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
    assert (gx - gx_ref).norm() / gx_ref.norm() < 1e-2


@pytest.mark.parametrize("name,causal,kw", [("retention", True, {}), ("retention", False, {}), ("gla", True, {}),
                                            ("delta", True, {}), ("delta", False, {"bidirectional": True})])
def test_second_derivatives_through_the_layer(name, causal, kw):
    """gradgradcheck in float64 with padded keys: under create_graph the Function's backward
    recomputes the readout differentiably from x (which keeps its graph)."""
    torch.manual_seed(3)
    layer = build(name, 4, 2, torch.float64, chunk_size=3, **kw)
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    pad = torch.arange(5)[None, :] >= torch.tensor([5, 4])[:, None]
    assert torch.autograd.gradgradcheck(lambda x: layer(x, causal=causal, key_padding_mask=pad), (x,))


@pytest.mark.parametrize("name,causal,kw", [("retention", True, {}), ("retention", False, {}), ("gla", True, {}),
                                            ("gla", False, {"bidirectional": True}), ("delta", True, {}),
                                            ("delta", False, {"bidirectional": True})])
def test_gradients_under_create_graph_equal_those_without_and_plain_autograds(monkeypatch, name, causal, kw):
    """float64, d_model 16, 2 heads, N = 9 (C = 4), padded keys: the gradients of x and every
    parameter taken with create_graph=True equal those taken without, and plain autograd's through
    the chunks (autograd_through_chunks, no Function at all); the derivatives of a random sum of
    them equal plain autograd's too. (x's share through q, k and v was counted twice under
    create_graph: x's gradient off by up to 1.8, 1.3, 4.5, 1.2, 4.3, 29.7 in the cases below.)"""
    torch.manual_seed(4)
    layer = build(name, 16, 2, torch.float64, chunk_size=4, **kw)
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    pad = torch.arange(9)[None, :] >= torch.tensor([9, 6])[:, None]
    g = torch.randn(2, 9, 16, dtype=torch.float64)
    wrt = [x, *layer.parameters()]

    def grads(create):
        y = layer(x, causal=causal, key_padding_mask=pad)
        return torch.autograd.grad(y, wrt, g, create_graph=create)

    def second(first):
        total = sum((a * w).sum() for a, w in zip(first, weights))
        return torch.autograd.grad(total, wrt, allow_unused=True, materialize_grads=True)

    without, first = grads(False), grads(True)
    assert in_graph(layer(x, causal=causal, key_padding_mask=pad), "_RecomputedReadoutBackward")
    weights = [torch.randn_like(t) for t in first]
    with monkeypatch.context() as m, gated.autograd_through_chunks():
        plain_autograd(m)
        ref = grads(True)
        ref_second = second(ref)
    for a, b, r in zip(first, without, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    for a, r in zip(second(first), ref_second):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)


def test_a_projection_changed_before_the_backward_is_refused():
    """The backward computes q, k, v again from x by the projections: one changed in place in
    between (an optimizer step before backward) would give other q, k, v, and is refused."""
    layer = build("gla", 16, 2)
    y = layer(torch.randn(1, 20, 16, requires_grad=True), causal=True)
    with torch.no_grad():
        layer.k_proj.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
