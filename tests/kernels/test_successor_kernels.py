"""The successors' ops (repro.kernels: gated_causal_dot_product, delta_rule_dot_product) against
their float64 recurrences (repro.kernels.causal_product.reference), forward and backward: odd lengths that are no
multiple of the chunk, D != M, gradcheck, decays that underflow over long sequences and chunks
that decay past the midpoint split's range (the exact path), causality by perturbation, bf16
against fp32, and the one-line errors. Their Function (repro.kernels.gated.chunked.RecomputedChunks) keeps
its inputs alone for backward and recomputes the chunks a group at a time: groups of one chunk
and of a few, the gradients of any subset of the inputs, second derivatives, one tensor passed
as both q and k under create_graph."""
import pytest
import torch
import torch.nn.functional as F

from repro.kernels import delta_rule_dot_product, gated_causal_dot_product
from repro.kernels.delta.reference import delta_rule_loop
from repro.kernels.gated import chunked as gated
from repro.kernels.gated.chunked import SPLIT_SPAN
from repro.kernels.gated.reference import gated_causal_dot_product_loop
from repro.training.memory import saved_bytes

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def inputs(kind, b=2, h=3, n=37, d=5, m=7, dtype=torch.float64, device="cpu", strength=1.0, seed=0):
    """q, k, v and the op's extra input (log_g per step, log_g per key dimension, beta), leaves."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in "qk")
    v = torch.randn(b, h, n, m, generator=g, dtype=torch.float64)
    if kind == "delta":
        k = F.normalize(k, dim=-1)  # as the layer feeds it: every step a contraction
        extra = torch.rand(b, h, n, generator=g, dtype=torch.float64)
    else:
        shape = (b, h, n, d) if kind == "per_dim" else (b, h, n)
        extra = strength * F.logsigmoid(torch.randn(*shape, generator=g, dtype=torch.float64) + 1)
    return [x.to(device, dtype).requires_grad_() for x in (q, k, v, extra)]


def op(kind):
    return delta_rule_dot_product if kind == "delta" else gated_causal_dot_product


def reference(kind):
    return delta_rule_loop if kind == "delta" else gated_causal_dot_product_loop


KINDS = ["per_step", "per_dim", "delta"]


def assert_fwd_bwd(kind, xs, chunk_size=None, rtol=1e-9, atol=1e-11):
    out = op(kind)(*xs, chunk_size=chunk_size)
    ref = reference(kind)(*xs)
    assert out.dtype == xs[0].dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((out.double() * w).sum(), xs)
    ref_grads = torch.autograd.grad((ref * w).sum(), xs)
    for name, a, r in zip(("q", "k", "v", "extra"), grads, ref_grads):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), r.double(), rtol=rtol, atol=atol,
                                   msg=lambda s, name=name: f"grad {name}: {s}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,chunk", [(1, 8), (13, 8), (37, 8), (67, 16), (70, None)])
def test_chunked_equals_the_float64_recurrence(kind, n, chunk):
    assert_fwd_bwd(kind, inputs(kind, n=n), chunk)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group_bytes", [1, None])
def test_gradcheck(monkeypatch, kind, group_bytes):
    """float64 gradcheck at N = 11, C = 4 (a partial last chunk), the backward's groups of one
    chunk (group_bytes 1) or the whole sequence in one (the default)."""
    if group_bytes:
        monkeypatch.setattr(gated, "RECOMPUTE_BYTES", group_bytes)
    xs = inputs(kind, b=1, h=2, n=11, d=3, m=4)
    assert torch.autograd.gradcheck(lambda *a: op(kind)(*a, chunk_size=4), xs)


@pytest.mark.parametrize("kind", KINDS)
def test_second_derivatives(kind):
    """gradgradcheck in float64: under create_graph the backward differentiates the forward
    itself, so the gradients are differentiable in turn."""
    xs = inputs(kind, b=1, h=1, n=7, d=2, m=3)
    assert torch.autograd.gradgradcheck(lambda *a: op(kind)(*a, chunk_size=3), xs)


@pytest.mark.parametrize("kind", KINDS)
def test_q_passed_as_k_under_create_graph(kind):
    """One tensor as both q and k, float64, N = 11, C = 4: the gradients of q, v and the decay or
    beta taken with create_graph=True equal those taken without and the float64 recurrence's, and
    so do the derivatives of a random sum of them. (Under create_graph each of q's two slots got
    the sum of both: q's gradient off by up to 28 / 27 / 9.9 for per_step / per_dim / delta.)"""
    q, _, v, extra = inputs(kind, b=1, h=2, n=11, d=3, m=4)
    if kind == "delta":  # unit keys, as the layer feeds them
        q = F.normalize(q.detach(), dim=-1).requires_grad_()
    wrt, w = [q, v, extra], torch.randn(1, 2, 11, 4, dtype=torch.float64)

    def grads(f, create):
        return torch.autograd.grad((f(q, q, v, extra) * w).sum(), wrt, create_graph=create)

    def second(first):
        return torch.autograd.grad(sum((a * u).sum() for a, u in zip(first, weights)), wrt)

    chunked = lambda *a: op(kind)(*a, chunk_size=4)
    without, first, ref = grads(chunked, False), grads(chunked, True), grads(reference(kind), True)
    weights = [torch.randn_like(t) for t in first]
    for name, a, b, r in zip(("q", "v", "extra"), first, without, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda s, name=name: f"grad {name}: {s}")
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11, msg=lambda s, name=name: f"grad {name}: {s}")
    for a, r in zip(second(first), second(ref)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)


def group_bytes_for(chunks, h=3, c=8, d=5, m=7):
    """RECOMPUTE_BYTES that makes the backward's groups `chunks` chunks long (its own estimate
    of a chunk's bytes, at inputs(kind)'s sizes, b=2, in float64)."""
    return chunks * 4 * 2 * h * c * (c + d + m) * 8


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunks", [1, 3, 100])
@pytest.mark.parametrize("need", ["qkvx", "q", "k", "v", "x", "qx", "kv"])
def test_the_backward_by_groups_of_chunks_equals_the_recurrence(monkeypatch, kind, chunks, need):
    """N = 67, C = 8 (9 chunks, the last partial) and the backward in groups of 1, 3 (the last
    group shorter) or all 9 chunks: the gradients of the inputs that need one against autograd
    through the float64 recurrence (the state's gradient is carried from group to group only
    where k, v or the decay need it: q's alone need none)."""
    monkeypatch.setattr(gated, "RECOMPUTE_BYTES", group_bytes_for(chunks))
    xs = inputs(kind, n=67)
    for x, name in zip(xs, "qkvx"):
        x.requires_grad_(name in need)
    out, ref = op(kind)(*xs, chunk_size=8), reference(kind)(*xs)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)
    w, wrt = torch.randn_like(ref), [x for x in xs if x.requires_grad]
    for a, r in zip(torch.autograd.grad((out * w).sum(), wrt), torch.autograd.grad((ref * w).sum(), wrt)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,d,m", [(1024, 16, 16), (301, 16, 24)])
def test_the_ops_keep_only_their_inputs_for_backward(kind, n, d, m):
    """What autograd keeps (repro.training.memory.saved_bytes, exact over distinct storages) is
    q, k, v and the decay or beta, nothing more: fp32, B = 2, H = 4, q, k, v as the projections
    hand them over ((B, H, N, D) views of (B, N, H, D) tensors). Through autograd the chunked
    path kept 3.9x (one decay per step), 4.0x (per key dimension) and 6.1x (delta) that at
    N = 1,024, D = M = 16: its (C, C) scores and masks, every chunk's state."""
    xs = [x.detach().float() for x in inputs(kind, b=2, h=4, n=n, d=d, m=m)]
    xs[:3] = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in xs[:3]]
    xs = [x.requires_grad_() for x in xs]
    kept, out = saved_bytes(op(kind), *xs)
    assert kept == sum(x.numel() * 4 for x in xs), f"{kept / 2**20:.2f} MiB"


@pytest.mark.parametrize("kind", KINDS)
def test_inside_a_layers_backward_the_ops_run_by_autograd_to_the_same_values(kind):
    """autograd_through_chunks() (a layer's own backward, which recomputes them already): the
    chunks' intermediates are kept, as autograd keeps them, and outputs and gradients are those
    of the Function."""
    xs = inputs(kind, n=45)
    out = op(kind)(*xs, chunk_size=8)
    with gated.autograd_through_chunks():
        kept, plain = saved_bytes(op(kind), *xs, chunk_size=8)
    assert kept > sum(x.numel() * 8 for x in xs) and type(plain.grad_fn).__name__ != "RecomputedChunksBackward"
    torch.testing.assert_close(plain, out, rtol=0, atol=0)
    w = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad((out * w).sum(), xs), torch.autograd.grad((plain * w).sum(), xs)):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("kind", ["per_step", "per_dim"])
def test_decays_that_underflow_over_a_long_sequence(kind):
    """Every token decays the state by e^-3 (per key dimension: up to e^-6), 2,000 tokens: the
    decay from the first token to the last is e^-6000, far below any dtype; nothing is NaN or
    inf, and fp32 still matches the float64 recurrence."""
    xs = inputs(kind, b=1, h=2, n=2000, d=4, m=3, strength=3.0, dtype=torch.float32)
    with torch.no_grad():
        xs[3].clamp_(max=-1.0)
    assert_fwd_bwd(kind, xs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("group_bytes", [1, None])
def test_chunks_past_the_split_range_take_the_exact_path(monkeypatch, dtype, group_bytes):
    """Per key dimension: half the chunks decay by more than SPLIT_SPAN in one dimension (the
    midpoint split's factors would overflow there), the rest gently; both kinds match, the
    backward in groups of one chunk too."""
    if group_bytes:
        monkeypatch.setattr(gated, "RECOMPUTE_BYTES", group_bytes)
    c = 16
    xs = inputs("per_dim", b=1, h=2, n=5 * c + 3, d=4, m=3, dtype=dtype)
    with torch.no_grad():
        strong = torch.zeros_like(xs[3])
        for start in range(0, xs[3].shape[2], 2 * c):
            strong[:, :, start:start + c, 1] = -4 * SPLIT_SPAN[dtype] / c  # split factors: exp(2 SPLIT_SPAN)
        xs[3].add_(strong)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {}
    assert_fwd_bwd("per_dim", xs, chunk_size=c, **tol)


@pytest.mark.parametrize("kind", KINDS)
def test_perturbing_step_j_changes_nothing_before_j(kind):
    n, j = 41, 23
    q, k, v, extra = (x.detach() for x in inputs(kind, n=n))
    out = op(kind)(q, k, v, extra, chunk_size=8)
    for which in range(4):
        xs = [q.clone(), k.clone(), v.clone(), extra.clone()]
        xs[which][:, :, j] += 0.5 * torch.rand_like(xs[which][:, :, j]) * (-1 if which == 3 and kind != "delta" else 1)
        out2 = op(kind)(*xs, chunk_size=8)
        torch.testing.assert_close(out2[:, :, :j], out[:, :, :j], rtol=0, atol=1e-12)
        assert (out2[:, :, j:] - out[:, :, j:]).abs().max() > 1e-6, f"input {which} reaches no later output"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_close_to_float32(kind, device):
    """bf16 inputs run in fp32 inside and return bf16: relative error of the outputs and the
    gradients below 2e-2 (bf16 keeps 8 bits: inputs rounded to ~4e-3 each)."""
    xs = inputs(kind, b=2, h=2, n=150, d=16, m=16, dtype=torch.float32, device=device)
    xb = [x.detach().to(torch.bfloat16).requires_grad_() for x in xs]
    out, outb = op(kind)(*xs), op(kind)(*xb)
    assert outb.dtype == torch.bfloat16
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
    assert rel(outb, out) < 2e-2
    w = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((outb.float() * w).sum(), xb), torch.autograd.grad((out * w).sum(), xs)):
        assert a.dtype == torch.bfloat16 and rel(a, b) < 2e-2


@pytest.mark.parametrize("kind", KINDS)
def test_float32_under_autocast_keeps_fp32_sums(kind):
    xs = inputs(kind, n=50, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = op(kind)(*xs)
    torch.testing.assert_close(out, op(kind)(*xs), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_equals_the_recurrence(kind):
    xs = [x.detach().cuda().requires_grad_() for x in inputs(kind, n=150)]
    assert_fwd_bwd(kind, xs)


def test_bad_inputs_get_one_line_errors():
    q = torch.randn(1, 2, 5, 4)
    v = torch.randn(1, 2, 5, 3)
    with pytest.raises(ValueError, match=r"log_g must be .* of shape \(1, 2, 5\) or \(1, 2, 5, 4\); got .*\(1, 2, 4\)"):
        gated_causal_dot_product(q, q, v, torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match=r"beta must be .* of shape \(1, 2, 5\); got .*\(1, 2, 5, 4\)"):
        delta_rule_dot_product(q, q, v, torch.zeros(1, 2, 5, 4))
    with pytest.raises(ValueError, match="v must be"):
        delta_rule_dot_product(q, q, v[:, :, :3], torch.zeros(1, 2, 5))
    with pytest.raises(ValueError, match="chunk_size must be >= 1; got 0"):
        gated_causal_dot_product(q, q, v, torch.zeros(1, 2, 5), chunk_size=0)
