"""The fused CPU causal product (repro/kernels/causal_product/causal_dot_cpu.c) against the float64 formula:
forward, every subset of gradients, states in and out, odd sizes and chunks, threads, non-finite
inputs (the exact path takes over) and a failed build (the PyTorch pieces take over)."""
import pytest
import torch

from repro.kernels import causal_dot_product, causal_dot_product_chunked
from repro.kernels.causal_product import cpu_native
from repro.kernels.causal_product.reference import causal_dot_product_loop, causal_dot_product_naive
from repro.kernels.plumbing import cpu_build

needs_kernel = pytest.mark.skipif(cpu_native.unavailable() is not None,
                                  reason=f"the fused CPU kernel does not build here: {cpu_native.unavailable()}")


@pytest.fixture(autouse=True)
def _unforced(monkeypatch):
    monkeypatch.delenv("REPRO_KERNEL", raising=False)


@pytest.fixture
def calls(monkeypatch):
    """How often the fused forward and backward ran."""
    seen = {"forward": 0, "backward": 0}
    for name in seen:
        real = getattr(cpu_native, name)

        def spy(*a, _real=real, _name=name, **kw):
            seen[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(cpu_native, name, spy)
    return seen


def _qkv(b, h, n, d, m, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, x, dtype=dtype, generator=g) for x in (d, d, m)]


def _close(got, ref, tol=2e-5):
    """fp32 against float64, relative to the reference's scale."""
    assert got.dtype != torch.float64
    err = (got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
    assert err < tol, f"relative error {err:.2e} >= {tol}"


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1, 1, 4, 4), (2, 3, 7, 5, 9), (1, 2, 33, 16, 8), (3, 1, 130, 32, 17),
                                   (1, 4, 257, 64, 64), (2, 2, 100, 31, 33)])
@pytest.mark.parametrize("chunk", [None, 7, 64])
def test_fused_matches_float64_formula(shape, chunk, calls):
    q64, k64, v64 = (x.requires_grad_() for x in _qkv(*shape))
    ref = causal_dot_product_naive(q64, k64, v64)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g)
    q, k, v = (x.detach().float().requires_grad_() for x in (q64, k64, v64))
    out = causal_dot_product_chunked(q, k, v, chunk)
    _close(out, ref)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), g.float()), ref_grads):
        _close(got, want)
    assert calls["forward"] >= 1 and calls["backward"] >= 1  # one call per thread's rows


@needs_kernel
@pytest.mark.parametrize("need", [(True, False, False), (False, True, False), (False, False, True),
                                  (False, True, True), (True, True, True)])
def test_every_subset_of_gradients(need, calls):
    q64, k64, v64 = (x.requires_grad_(r) for x, r in zip(_qkv(2, 2, 45, 6, 10, seed=1), need))
    ref = causal_dot_product_naive(q64, k64, v64)
    g = torch.randn_like(ref)
    wrt = [x for x in (q64, k64, v64) if x.requires_grad]
    q, k, v = (x.detach().float().requires_grad_(r) for x, r in zip((q64, k64, v64), need))
    got = torch.autograd.grad(causal_dot_product_chunked(q, k, v), [x for x in (q, k, v) if x.requires_grad],
                              g.float())
    for a, b in zip(got, torch.autograd.grad(ref, wrt, g)):
        _close(a, b)
    assert calls["backward"] >= 1


@needs_kernel
def test_states_in_and_out():
    """forward from a state S0 leaves the final sum in it; backward from S0 and a reverse state R0
    (the sum of q^T g over later tokens) gives the gradients of the longer sequence's middle."""
    rows, n, d, m = 3, 70, 9, 12
    q, k, v, g = (torch.randn(rows, n, x, dtype=torch.float64) for x in (d, d, m, m))
    s0, r0 = torch.randn(rows, d, m, dtype=torch.float64), torch.randn(rows, d, m, dtype=torch.float64)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = (qr @ kr.mT).tril() @ vr + qr @ s0
    gq, gk, gv = torch.autograd.grad(ref, (qr, kr, vr), g)
    gk, gv = gk + v @ r0.mT, gv + k @ r0  # the later tokens' share: sum_{j > N} (q_j . k_i) g_j . v_i
    f = lambda x: x.float().contiguous()
    out, state = torch.empty(rows, n, m), f(s0)
    assert cpu_native.forward(f(q), f(k), f(v), out, 16, state)
    _close(out, ref.detach())
    _close(state, s0 + k.mT @ v)
    grads = [torch.empty(rows, n, d), torch.empty(rows, n, d), torch.empty(rows, n, m)]
    assert cpu_native.backward(f(q), f(k), f(v), f(g), grads, 16, f(s0), f(r0))
    for a, b in zip(grads, (gq, gk, gv)):
        _close(a, b)


@needs_kernel
def test_two_threads_give_the_one_thread_result(calls):
    q, k, v = (x.float().requires_grad_() for x in _qkv(3, 3, 77, 8, 8, seed=2))
    g = torch.randn(3, 3, 77, 8)
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            out = causal_dot_product_chunked(q, k, v)
            results.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # rows are split, never a sum
    assert calls["forward"] >= 2


@needs_kernel
@pytest.mark.parametrize("where", ["k", "v", "q"])
def test_non_finite_inputs_keep_to_the_rows_causality_lets_them_reach(where):
    """An inf in k or v: the fused forward reports it and the exact path answers (rows before it
    finite and right); an inf in q reaches its own output row only, in either path."""
    q, k, v = (x.float() for x in _qkv(1, 2, 50, 4, 5, seed=3))
    dict(q=q, k=k, v=v)[where][0, 1, 20, 2] = float("inf")
    out = causal_dot_product_chunked(q, k, v, 8)
    ref = causal_dot_product_loop(*(x.double() for x in (q, k, v)))  # the masked formula makes 0 * inf NaN
    assert torch.isfinite(out[0, 0]).all() and torch.isfinite(out[0, 1, :20]).all()
    _close(out[0, 1, :20], ref[0, 1, :20])
    assert not torch.isfinite(out[0, 1, 20]).all()
    if where == "q":
        assert torch.isfinite(out[0, 1, 21:]).all()


@needs_kernel
def test_bf16_inputs_sum_in_fp32(calls):
    q64, k64, v64 = _qkv(1, 2, 90, 16, 16, seed=4)
    q, k, v = (x.bfloat16().requires_grad_() for x in (q64, k64, v64))
    out = causal_dot_product(q, k, v)
    assert out.dtype == torch.bfloat16
    ref = causal_dot_product_naive(*(x.detach().double() for x in (q, k, v)))
    assert ((out.double() - ref).abs().max() / ref.abs().max()) < 1e-2
    assert calls["forward"] >= 1


@needs_kernel
def test_repro_kernel_torch_turns_it_off(monkeypatch, calls):
    monkeypatch.setenv("REPRO_KERNEL", "torch")
    q, k, v = (x.float().requires_grad_() for x in _qkv(1, 1, 20, 3, 3))
    causal_dot_product(q, k, v).sum().backward()
    assert calls == {"forward": 0, "backward": 0}


def test_a_failed_build_leaves_the_pytorch_pieces(monkeypatch, tmp_path, calls):
    """No compiler: unavailable() names it, REPRO_KERNEL=cpu is a one-line error, and the product
    is still right (the chunked path's PyTorch pieces)."""
    monkeypatch.setattr(cpu_native, "_LIB", [])
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("REPRO_CACHE_DIR", str(tmp_path / "cache"))
    assert "no-such-cc" in cpu_native.unavailable()
    assert not list((tmp_path / "cache").glob("*"))  # no temporary left behind
    q, k, v = (x.float() for x in _qkv(1, 2, 30, 4, 4))
    _close(causal_dot_product(q, k, v), causal_dot_product_naive(*(x.double() for x in (q, k, v))))
    assert calls["forward"] == 0
    monkeypatch.setenv("REPRO_KERNEL", "cpu")
    with pytest.raises(RuntimeError, match="REPRO_KERNEL=cpu, but the fused CPU kernel is unavailable: .*no-such-cc"):
        causal_dot_product(q, k, v)


@pytest.mark.slow  # compiles the C source from scratch
def test_the_build_is_cached_and_atomic(monkeypatch, tmp_path):
    """Built once into the cache under a name keyed by source, flags and CPU; a second process
    (here: a fresh load) reuses it without compiling."""
    if cpu_native.unavailable():
        pytest.skip(f"the fused CPU kernel does not build here: {cpu_native.unavailable()}")
    monkeypatch.setattr(cpu_native, "_LIB", [])
    monkeypatch.setenv("REPRO_CACHE_DIR", str(tmp_path))
    assert cpu_native.library() is not None
    built = list(tmp_path.glob("causal_dot_cpu-*.so"))
    assert len(built) == 1 and list(tmp_path.iterdir()) == built  # no temporary left behind
    monkeypatch.setattr(cpu_native, "_LIB", [])
    monkeypatch.setattr(cpu_build.subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
    assert cpu_native.library() is not None


@needs_kernel
def test_the_forward_keeps_no_chunk_states(calls):
    """The fused backward recomputes the states in cache: the Function keeps q, k, v only."""
    q, k, v = (x.float().requires_grad_() for x in _qkv(1, 2, 64, 8, 8))
    out = causal_dot_product_chunked(q, k, v)
    assert out.grad_fn.saved_tensors[3] is None
    assert cpu_native.native(q.device, q.dtype)


@needs_kernel
@pytest.mark.parametrize("workspace", [1, 500_000])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("feature_map", ["elu", "favor"])
@pytest.mark.parametrize("need", ["qkv", "q", "kv"])
def test_the_linear_layer_on_the_fused_kernel(monkeypatch, calls, workspace, padded, feature_map, need):
    """The causal linear layer in fp32 takes the fused kernel in both of repro.kernels.normalised.blocked's
    CPU paths (workspace 1 byte puts every row in blocks of one chunk, whose states come from the
    blocks' sums; 500 kB groups of rows in one pass), against the same layer in float64 (the
    chunked PyTorch pieces), forward and the gradients that are needed. Those paths serve the
    feature maps the fused layer kernel (repro.kernels.normalised.cpu_layer: elu + 1) does not compute, and
    elu + 1 where that kernel declines; here it is turned off."""
    from repro.attention import LinearAttention
    from repro.attention.performer import FavorFeatureMap
    from repro.kernels.normalised import blocked, cpu_layer
    from tests.attention.test_attention import explicit_linear

    monkeypatch.setattr(blocked, "default_workspace", lambda q: workspace)
    monkeypatch.setattr(cpu_layer, "applies", lambda *a: False)
    torch.manual_seed(5)
    maps = {"elu": None, "favor": lambda d: FavorFeatureMap(d, n_features=6)}
    layer = LinearAttention(d_model=15, n_heads=3, feature_map=maps[feature_map])
    gen = torch.Generator().manual_seed(13)
    q64, k64, v64 = (torch.randn(2, 150, 3, 5, dtype=torch.float64, generator=gen).transpose(1, 2) for _ in "qkv")
    pad = torch.arange(150)[None, :] >= torch.tensor([150, 97])[:, None] if padded else None
    g = torch.randn(2, 3, 150, 5, dtype=torch.float64, generator=gen)
    phi = (lambda x: torch.nn.functional.elu(x) + 1) if feature_map == "elu" else layer.feature_map.double()
    ins64 = [x.clone().requires_grad_(name in need) for x, name in zip((q64, k64, v64), "qkv")]
    want = explicit_linear(*ins64, True, pad, layer.eps, phi)
    wrt64 = [x for x in ins64 if x.requires_grad]
    ref_grads = torch.autograd.grad(want, wrt64, g)
    layer.float()
    ins = [x.float().requires_grad_(name in need) for x, name in zip((q64, k64, v64), "qkv")]
    y = layer.attend(*ins, True, pad)
    _close(y, want.detach(), 1e-5)
    for got, ref in zip(torch.autograd.grad(y, [x for x in ins if x.requires_grad], g.float()), ref_grads):
        _close(got, ref, 1e-5)
    assert calls["forward"] >= 1 and calls["backward"] >= 1


@needs_kernel
def test_the_raw_calls_refuse_what_they_cannot_read():
    """The C code reads raw pointers: a non-contiguous, wrong-dtype or wrong-shape tensor is one
    error naming it, never an out-of-bounds read."""
    q = torch.randn(2, 10, 4)
    out = torch.empty(2, 10, 4)
    want = r"causal_dot_cpu: k must be a contiguous fp32 CPU tensor of shape \(2, 10, 4\)"
    with pytest.raises(ValueError, match=want):
        cpu_native.forward(q, q.double(), q, out)
    with pytest.raises(ValueError, match="v must be .*contiguous=False"):
        cpu_native.forward(q, q, q.transpose(0, 1).contiguous().transpose(0, 1), out)
    with pytest.raises(ValueError, match=r"s0 must be .* shape \(2, 4, 4\)"):
        cpu_native.backward(q, q, q, q, [out, None, None], s0=torch.zeros(2, 4, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_tokens(dtype):
    """N = 0: empty outputs and gradients from the product and the linear layer, either path (the
    chunk views used to fail to size themselves, and the layer's chunk was 0)."""
    from repro.attention import LinearAttention

    q = torch.randn(3, 2, 0, 4, dtype=dtype, requires_grad=True)
    out = causal_dot_product(q, q, q)
    out.sum().backward()
    assert out.shape == q.grad.shape == (3, 2, 0, 4)
    for causal in (True, False):
        x = torch.randn(2, 0, 8, dtype=dtype, requires_grad=True)
        y = LinearAttention(8, 2).to(dtype)(x, causal=causal)
        y.sum().backward()
        assert y.shape == x.grad.shape == (2, 0, 8)
