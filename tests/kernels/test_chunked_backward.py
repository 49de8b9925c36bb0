"""The chunked kernel's fused backward (repro/kernels/causal_product/chunked.py) against the float64 naive
formula on the layouts a user's code hands it: a stride-0 upstream gradient, any subset of
needed gradients, non-contiguous and 2-D inputs, odd sizes that pad the last chunk."""
import itertools

import pytest
import torch

from repro.attention.linear import LinearAttention
from repro.kernels import causal_dot_product_chunked, default_chunk_size
from repro.kernels.causal_product.reference import causal_dot_product_naive

ODD = [(2, 3, 37, 5, 9), (1, 2, 70, 12, 7)]  # N not a multiple of any chunk, D != M


def _inputs(b, h, n, d, m):
    g = torch.Generator().manual_seed(n)
    return [torch.randn(b, h, n, x, dtype=torch.float64, generator=g) for x in (d, d, m)]


@pytest.mark.parametrize("shape", ODD)
@pytest.mark.parametrize("chunk", [None, 16, 32])
def test_sum_backward_stride0_gradient(shape, chunk):
    """out.sum().backward() hands the kernel an expanded (stride-0) gradient."""
    q, k, v = (x.requires_grad_() for x in _inputs(*shape))
    causal_dot_product_chunked(q, k, v, chunk).sum().backward()
    got = [x.grad.clone() for x in (q, k, v)]
    want = torch.autograd.grad(causal_dot_product_naive(q, k, v).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("need", [n for n in itertools.product([False, True], repeat=3) if any(n)])
def test_every_subset_of_gradients(need):
    q, k, v = _inputs(*ODD[0])
    for x, r in zip((q, k, v), need):
        x.requires_grad_(r)
    wrt = [x for x in (q, k, v) if x.requires_grad]
    g = torch.randn(q.shape[:-1] + v.shape[-1:], dtype=torch.float64)
    got = torch.autograd.grad(causal_dot_product_chunked(q, k, v, 16), wrt, g)
    want = torch.autograd.grad(causal_dot_product_naive(q, k, v), wrt, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", ["transposed", "2d"])
def test_non_contiguous_and_2d_inputs(layout):
    b, h, n, d, m = 2, 3, 41, 6, 4
    if layout == "transposed":  # (B, N, H, D) projections seen as (B, H, N, D)
        q, k, v = (torch.randn(b, n, h, x, dtype=torch.float64).transpose(1, 2) for x in (d, d, m))
    else:  # one sequence, no batch dims
        q, k, v = (torch.randn(n, x, dtype=torch.float64) for x in (d, d, m))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = causal_dot_product_chunked(q, k, v, 16)
    ref = causal_dot_product_naive(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(ref)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_cpu_chunk_table():
    """CPU takes the measured table (repro/kernels/causal_product/chunked.py CPU_CHUNKS); other devices and
    sizes beyond the table keep the power of two nearest sqrt(D M)."""
    assert [default_chunk_size(d, d, cpu=True) for d in (8, 16, 32, 64, 128)] == [32, 32, 64, 64, 64]
    assert default_chunk_size(32, 33, cpu=True) == 64 and default_chunk_size(256, 256, cpu=True) == 256
    assert default_chunk_size(32, 32) == 32 and default_chunk_size(128, 128) == 128


@pytest.mark.parametrize("threads", [1, 2])  # 2: the groups run on two Python threads
@pytest.mark.parametrize("n", [37, 48])  # padded (results copied into place) / whole chunks (written in place)
@pytest.mark.parametrize("need", [(True, True, True), (False, True, False)])
def test_row_groups_match_naive(monkeypatch, need, n, threads):
    """CPU runs take the sequences in groups of about GROUP_CHUNKS chunks; a small GROUP_CHUNKS
    makes several groups, with a partial last one (7 rows, 3 per group)."""
    from repro.kernels.causal_product import chunked

    monkeypatch.setattr(chunked, "GROUP_CHUNKS", 9)  # N = 37 or 48 at C = 16: 3 chunks per row, 3 rows per group
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert len(chunked._row_groups(7, n, 16, torch.device("cpu"))) == 3
        q, k, v = _inputs(1, 7, n, 5, 9)
        for x, r in zip((q, k, v), need):
            x.requires_grad_(r)
        wrt = [x for x in (q, k, v) if x.requires_grad]
        out = causal_dot_product_chunked(q, k, v, 16)
        ref = causal_dot_product_naive(q, k, v)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        g = torch.randn_like(ref)
        for a, b in zip(torch.autograd.grad(out, wrt, g), torch.autograd.grad(ref, wrt, g)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        assert torch.get_num_threads() == threads  # restored after the groups ran
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_host_threads_respect_inference_mode_and_per_thread_modes(two_threads):
    """The row groups run on host threads only in plain eager mode: inference_mode reaches the
    workers, and a dispatch mode (FlopCounterMode) sees every matmul instead of none."""
    from torch.utils.flop_counter import FlopCounterMode

    layer = LinearAttention(d_model=64, n_heads=4)
    x = torch.randn(4, 300, 64)
    with torch.no_grad():
        ref = layer(x, causal=True)
    with torch.inference_mode():
        assert torch.equal(layer(x, causal=True), ref)
    q, k, v = (torch.randn(8, 4, 1000, 16) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        causal_dot_product_chunked(q, k, v)
    c = default_chunk_size(16, 16, cpu=True)
    assert counter.get_total_flops() >= 2 * 32 * 1000 * c * 16  # at least the intra-chunk scores


@pytest.mark.slow
def test_the_layer_compiles_as_one_graph(two_threads):
    torch._dynamo.reset()
    layer = LinearAttention(d_model=64, n_heads=4)
    x = torch.randn(2, 300, 64, requires_grad=True)
    compiled = torch.compile(lambda x: layer(x, causal=True), backend="aot_eager", fullgraph=True)
    out = compiled(x)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    ref = layer(x, causal=True)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad, ref_grad)


def test_the_forward_keeps_its_chunk_states_for_grad_q_only_when_it_will_be_needed(monkeypatch):
    """grad q reuses the forward's chunk states (the backward then runs one state scan, the
    reverse one, instead of two); nothing is kept under no_grad or when q needs no gradient.
    The gradients themselves are checked against the naive formula above."""
    from repro.kernels.causal_product import chunked

    kept, scans = [], []
    grouped, scan = chunked._grouped_forward, chunked._chunk_states
    monkeypatch.setattr(chunked, "_grouped_forward",
                        lambda *a, **kw: kept.append(kw["keep_states"]) or grouped(*a, **kw))
    monkeypatch.setattr(chunked, "_chunk_states",
                        lambda *a, **kw: scans.append(kw.get("reverse", False)) or scan(*a, **kw))
    q, k, v = (x.requires_grad_() for x in _inputs(*ODD[0]))
    with torch.no_grad():
        causal_dot_product_chunked(q, k, v, 16)
    causal_dot_product_chunked(q.detach(), k, v, 16)
    out = causal_dot_product_chunked(q, k, v, 16)
    assert kept == [False, False, True]
    scans.clear()
    got = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert scans and all(scans)  # the reverse state only (once per group of rows)
    want = torch.autograd.grad(causal_dot_product_naive(q, k, v).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
