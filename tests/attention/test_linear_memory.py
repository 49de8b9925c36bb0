"""The linear layer's own autograd Function (repro.attention.linear._RecomputedAttention): what it
keeps for backward, counted exactly, against SDPA softmax's; its values and gradients
against float64 formulas written out (causal or not, padded keys, feature maps, the inputs that
need a gradient); second derivatives; a feature map redrawn before the backward."""
import pytest
import torch
import torch.nn.functional as F

from repro.attention import LinearAttention, SoftmaxAttention
from repro.attention.feature_maps import ReluFeatureMap
from repro.attention.performer import FavorFeatureMap, PerformerAttention
from repro.training.memory import saved_bytes
from tests.attention.test_attention import explicit_linear


def _layer_bytes(layer, x, causal):
    """What the layer keeps, counted by hand: its input, the four weights (the biases need
    nothing), q, k and v (one storage each: the projections' outputs), the output (the output
    projection's input, the same storage) and one fp32 value per (B, H, N) (SDPA: the log-sum-exp;
    the linear layer: 1 / (den + eps))."""
    b, n, d = x.shape
    return (x.numel() * x.element_size() + 4 * d * d * x.element_size() + 4 * b * n * d * x.element_size()
            + b * layer.n_heads * n * 4)


@pytest.mark.parametrize("n", [256, 1024, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_linear_layer_keeps_no_more_for_backward_than_sdpa_softmax(n, dtype, causal):
    """Exact counts over distinct storages (repro.training.memory.saved_bytes), one layer at
    d_model 256, 8 heads, batch 1, as first measured: linear and Performer were then 1.4-4.6x
    SDPA's (35.3 MiB linear, 97.5 MiB Performer, 21.1 MiB SDPA at N = 4,096 in fp32)."""
    torch.manual_seed(0)
    x = torch.randn(1, n, 256, dtype=dtype, requires_grad=True)
    sdpa, _ = saved_bytes(SoftmaxAttention(256, 8).to(dtype), x, causal=causal)
    assert sdpa == _layer_bytes(SoftmaxAttention(256, 8), x, causal)
    for layer in (LinearAttention(256, 8), PerformerAttention(256, 8, redraw_every=None)):
        kept, y = saved_bytes(layer.to(dtype), x, causal=causal)
        assert y.dtype == dtype
        assert kept <= sdpa, f"{type(layer).__name__}: {kept / 2**20:.2f} MiB kept, SDPA {sdpa / 2**20:.2f}"
        assert kept == _layer_bytes(layer, x, causal)


def _in_graph(y, name):
    seen, todo = set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return name in {type(fn).__name__ for fn in seen}


def _views(b, n, h, d, dtype=torch.float64, gen=None):
    """(B, H, N, D) views of a (B, N, H, D) tensor: the layout the projections hand to attend."""
    return torch.randn(b, n, h, d, dtype=dtype, generator=gen).transpose(1, 2).requires_grad_()


def _against_the_formula(layer, q, k, v, causal, pad, feature_map, gen, grads_in_place=False):
    """y = layer.attend(...) and the gradients of the inputs that need one, against the float64
    formula (tests.attention.test_attention.explicit_linear) by autograd; returns y."""
    y = layer.attend(q, k, v, causal, pad)
    phi = (lambda x: F.elu(x) + 1) if feature_map == "elu" else layer.feature_map
    want = explicit_linear(q, k, v, causal, pad, layer.eps, phi)
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-10)
    g = torch.randn(y.shape, dtype=torch.float64, generator=gen)
    inputs = [x for x in (q, k, v) if x.requires_grad]
    for got, ref in zip(torch.autograd.grad(y, inputs, g), torch.autograd.grad(want, inputs, g)):
        if grads_in_place:
            assert got.transpose(1, 2).is_contiguous()  # the projection's layout: its backward copies nothing
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-10)
    return y


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("feature_map", ["elu", "relu", "favor"])
@pytest.mark.parametrize("need", ["qkv", "q", "k", "v", "kv"])
def test_recomputed_attention_matches_the_float64_formula(causal, padded, feature_map, need):
    """attend on the projections' strided views (N = 70: a partial second chunk) against the
    formula by autograd, forward and the gradients of the inputs that need one."""
    gen = torch.Generator().manual_seed(7)
    maps = {"elu": None, "relu": ReluFeatureMap, "favor": lambda d: FavorFeatureMap(d, n_features=6)}
    layer = LinearAttention(d_model=10, n_heads=2, feature_map=maps[feature_map]).double()
    q, k, v = (_views(2, 70, 2, 5, gen=gen) for _ in range(3))
    for x, name in zip((q, k, v), "qkv"):
        x.requires_grad_(name in need)
    pad = torch.arange(70)[None, :] >= torch.tensor([70, 51])[:, None] if padded else None
    y = _against_the_formula(layer, q, k, v, causal, pad, feature_map, gen)
    assert type(y.grad_fn).__name__ == "_RecomputedAttentionBackward"
    assert y.transpose(1, 2).is_contiguous()  # the output projection reads it without a copy


@pytest.mark.parametrize("causal", [True, False])
def test_half_precision_layer_against_float64(causal):
    """bf16 and fp16 layers return their dtype (the non-causal one returned fp32, which the
    output projection refused) and match the float64 layer, forward and input gradient."""
    torch.manual_seed(1)
    ref_layer = LinearAttention(d_model=32, n_heads=4).double()
    x64 = torch.randn(2, 300, 32, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 300, 32, dtype=torch.float64)
    ref = ref_layer(x64, causal=causal)
    (ref_gx,) = torch.autograd.grad(ref, x64, g)
    for dtype in (torch.bfloat16, torch.float16):
        layer = LinearAttention(d_model=32, n_heads=4)
        layer.load_state_dict(ref_layer.state_dict())
        layer = layer.to(dtype)
        x = x64.detach().to(dtype).requires_grad_()
        y = layer(x, causal=causal)
        (gx,) = torch.autograd.grad(y, x, g.to(dtype))
        assert y.dtype == gx.dtype == dtype
        for got, want in ((y, ref), (gx, ref_gx)):
            err = (got.double() - want).norm() / want.norm()
            assert err < 2e-2, f"{dtype}: relative error {err:.3g}"


@pytest.mark.slow  # double backward through whole layers: 17-31 s a case
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("attention", ["linear", "performer"])
def test_second_derivatives_through_the_recomputed_layer(causal, attention):
    """gradgradcheck in float64, padded keys included: under create_graph the Function's backward
    takes the differentiable formula, so the gradients are differentiable in turn."""
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    layer = (LinearAttention(d_model=6, n_heads=2) if attention == "linear"
             else PerformerAttention(d_model=6, n_heads=2, n_features=4, redraw_every=None)).double()
    x = torch.randn(2, 9, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    pad = torch.arange(9)[None, :] >= torch.tensor([9, 6])[:, None]
    assert _in_graph(layer(x, causal=causal, key_padding_mask=pad), "_RecomputedAttentionBackward")
    assert torch.autograd.gradgradcheck(lambda x: layer(x, causal=causal, key_padding_mask=pad), (x,))


def test_a_redraw_between_forward_and_backward_is_refused():
    """Performer's W is module state the backward reads again: redrawn in between, the gradients
    would belong to other features. The backward says so instead."""
    layer = PerformerAttention(d_model=8, n_heads=2, redraw_every=None)
    x = torch.randn(1, 20, 8, requires_grad=True)
    y = layer(x, causal=True)
    layer.feature_map.new_feature_map()
    with pytest.raises(RuntimeError, match="feature map's buffers changed between forward and backward"):
        y.sum().backward()


def test_a_non_finite_key_reaches_only_later_outputs_through_the_layer():
    """An inf in the input at position 40 of 70: the causal layer's outputs before it
    stay finite and equal the layer's on the first 40 tokens alone; those from it on are not."""
    torch.manual_seed(4)
    layer = LinearAttention(d_model=16, n_heads=2)
    x = torch.randn(1, 70, 16)
    x[0, 40, :] = float("inf")
    y = layer(x.requires_grad_(), causal=True)
    assert torch.isfinite(y[:, :40]).all() and not torch.isfinite(y[:, 40:]).any()
    torch.testing.assert_close(y[:, :40], layer(x[:, :40].detach(), causal=True), rtol=1e-6, atol=1e-6)


def test_the_dispatchers_backward_against_the_naive_formula(monkeypatch):
    """causal_dot_product_backward (the gradients without a graph, which the layer's backward
    calls): against autograd through the naive (N, N) formula, only the gradients asked for; and
    routed to the CuPy backend's backward where the forward would run there."""
    import repro.kernels as kernels
    from repro.kernels import causal_dot_product_backward
    from repro.kernels.causal_product import cuda as cupy_backend
    from repro.kernels.causal_product.reference import causal_dot_product_naive

    gen = torch.Generator().manual_seed(6)
    q, k = (torch.randn(2, 3, 75, 4, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(2))
    v = torch.randn(2, 3, 75, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    g = torch.randn(2, 3, 75, 6, dtype=torch.float64, generator=gen)
    want = torch.autograd.grad(causal_dot_product_naive(q, k, v), (q, k, v), g)
    with torch.no_grad():
        got = causal_dot_product_backward(q, k, v, g, (True, False, True))
    assert got[1] is None
    for a, b in ((got[0], want[0]), (got[2], want[2])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    calls = []
    monkeypatch.setattr(kernels, "select_backend", lambda *a: ("cupy", "a test"))
    monkeypatch.setattr(cupy_backend, "cdp_backward", lambda *a: calls.append(a) or want)
    got = causal_dot_product_backward(q, k, v, g, (False, True, True))
    assert len(calls) == 1 and got[0] is None and got[1] is want[1] and got[2] is want[2]


@pytest.mark.parametrize("workspace", [1, 500_000])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("feature_map", ["elu", "relu", "favor"])
@pytest.mark.parametrize("need", ["qkv", "q", "kv"])
def test_blocked_backward_matches_the_float64_formula(monkeypatch, workspace, causal, padded, feature_map, need):
    """The bounded-workspace paths (repro.kernels.normalised.blocked) forced at N = 150 (C = 32: a partial
    last chunk): workspace 1 byte takes every row in blocks of one chunk, twice (the chunk
    products' scans first), 500 kB groups of rows in one pass; forward and the gradients of
    the inputs that need one against the formula by autograd, on the thread pool where torch has
    more than one thread (the feature maps without a closed form take autograd there)."""
    from repro.kernels.normalised import blocked

    monkeypatch.setattr(blocked, "default_workspace", lambda q: workspace)
    gen = torch.Generator().manual_seed(11)
    maps = {"elu": None, "relu": ReluFeatureMap, "favor": lambda d: FavorFeatureMap(d, n_features=6)}
    layer = LinearAttention(d_model=15, n_heads=3, feature_map=maps[feature_map]).double()
    q, k, v = (_views(2, 150, 3, 5, gen=gen) for _ in range(3))
    assert (blocked._plan(q, v, 32)[1] == 32) == (workspace == 1)
    for x, name in zip((q, k, v), "qkv"):
        x.requires_grad_(name in need)
    pad = torch.arange(150)[None, :] >= torch.tensor([150, 97])[:, None] if padded else None
    _against_the_formula(layer, q, k, v, causal, pad, feature_map, gen, grads_in_place=True)


def test_a_non_finite_key_in_blocks_reaches_only_later_gradients(monkeypatch):
    """An inf in k at position 40 of 150, in blocks of one chunk: the safe scans keep it to the
    rows causality lets it reach; the gradient of q before it is finite and equals that of the
    first 40 tokens alone."""
    from repro.kernels.normalised import blocked

    monkeypatch.setattr(blocked, "default_workspace", lambda q: 1)
    gen = torch.Generator().manual_seed(12)
    layer = LinearAttention(d_model=10, n_heads=2).double()
    q, k, v = (_views(1, 150, 2, 5, gen=gen) for _ in range(3))
    with torch.no_grad():
        k[:, :, 40] = float("inf")
    g = torch.randn(1, 2, 150, 5, dtype=torch.float64, generator=gen)
    (gq,) = torch.autograd.grad(layer.attend(q, k, v, True, None), q, g)
    (want,) = torch.autograd.grad(layer.attend(q[:, :, :40], k[:, :, :40], v[:, :, :40], True, None), q, g[:, :, :40])
    assert torch.isfinite(gq[:, :, :40]).all() and not torch.isfinite(gq[:, :, 40:]).all()
    torch.testing.assert_close(gq[:, :, :40], want[:, :, :40], rtol=1e-10, atol=1e-10)


def layer_peaks(n, dtype, causal):
    """(SDPA softmax's, linear's) exact peak of torch's allocator, in bytes, over forward + backward
    of one layer as the benchmark runs it (d_model 256, 8 heads, 4,096 tokens: batch 4096 / N), at
    one thread (the profiler counts the calling thread's allocations)."""
    from repro.training.memory import peak_allocated_bytes

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peaks = []
        for cls in (SoftmaxAttention, LinearAttention):
            torch.manual_seed(0)
            layer = cls(256, 8).to(dtype)
            x = torch.randn(4096 // n, n, 256, dtype=dtype, requires_grad=True)
            g = torch.randn_like(x)
            layer(x, causal=causal).backward(g)  # warm: lazy initialisation is not the layer's
            peaks.append(peak_allocated_bytes(lambda f, x, g: f(x, causal=causal).backward(g), layer, x, g)[0])
    finally:
        torch.set_num_threads(threads)
    return peaks


@pytest.mark.parametrize("n", [256, 1024, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_the_layers_peak_memory_is_sdpas_plus_at_most_one_workspace(n, dtype, causal):
    """Forward + backward of one layer as the benchmark runs it (d_model 256, 8 heads, 4,096
    tokens: batch 4096 / N), the peak of bytes held by torch's allocator, exact (profiler), at one
    thread: linear at most SDPA softmax's plus repro.kernels.normalised.blocked.WORKSPACE_BYTES (8 MiB:
    39.7-41.2 MiB against SDPA's 36.3-37.1 in fp32; it was 56-58 MiB, holding full-size phi(Q),
    phi(K), [v, 1] and their gradients at once: 20 MiB over SDPA's)."""
    from repro.kernels.normalised.blocked import WORKSPACE_BYTES

    sdpa, linear = layer_peaks(n, dtype, causal)
    assert sdpa > 8 * 4096 * 256 * dtype.itemsize  # the count sees the pass: q, k, v, y, grads
    assert linear <= sdpa + WORKSPACE_BYTES, f"linear {linear / 2**20:.2f} MiB, SDPA {sdpa / 2**20:.2f} MiB"


@pytest.mark.parametrize("causal", [True, False])
def test_a_layers_own_workspace_bounds_its_peak_and_changes_no_value(monkeypatch, causal):
    """LinearAttention(workspace_mb=...) (conf: attention.workspace_mb) in place of the default:
    1 MiB takes the same rows in more groups (and blocks) than 8 MiB; outputs and input gradients
    are the same to rounding, the exact allocator peak is over 2 MiB lower (2.9 measured, causal or
    not), and the default (half of q's 4 MiB here) lies between (d_model 256, 8 heads, N = 1024,
    batch 4, fp32, 1 thread); a bad value is one line. Causal, repro.kernels.normalised.blocked's path (the
    workspace's) with the fused layer kernel, which holds no workspace, turned off."""
    from repro.kernels.normalised import cpu_layer
    from repro.training.memory import peak_allocated_bytes

    monkeypatch.setattr(cpu_layer, "applies", lambda *a: False)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out, peaks = [], []
        for mb in (8, 1, None):
            torch.manual_seed(0)
            layer = LinearAttention(256, 8, workspace_mb=mb)
            x = torch.randn(4, 1024, 256, generator=torch.Generator().manual_seed(1), requires_grad=True)
            g = torch.randn(4, 1024, 256, generator=torch.Generator().manual_seed(2))
            layer(x, causal=causal).backward(g)  # warm
            x.grad = None
            peaks.append(peak_allocated_bytes(lambda f, x, g: f(x, causal=causal).backward(g), layer, x, g)[0])
            out.append((layer(x, causal=causal).detach(), x.grad))
    finally:
        torch.set_num_threads(threads)
    for other in out[1:]:
        torch.testing.assert_close(other[0], out[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(other[1], out[0][1], rtol=1e-5, atol=1e-6)
    assert peaks[1] < peaks[0] - 2 * 2**20, f"1 MiB: {peaks[1] / 2**20:.2f} MiB, 8 MiB {peaks[0] / 2**20:.2f} MiB"
    assert peaks[1] <= peaks[2] < peaks[0], [p / 2**20 for p in peaks]
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=rf"LinearAttention: workspace_mb must be finite and > 0, or null .*{bad}"):
            LinearAttention(256, 8, workspace_mb=bad)


def test_the_default_workspace_follows_the_problem():
    """Unset, the budget is 8 MiB, or half of q's fp32 bytes when that is less (at least 64 KiB):
    the layer benchmark's 4,096 tokens x 256 keep 8 MiB, the small presets' models get less."""
    from repro.kernels.normalised.blocked import default_workspace

    assert default_workspace(torch.empty(4, 8, 1024, 32)) == 2 << 20  # q of 4 MiB
    assert default_workspace(torch.empty(16, 8, 1024, 32)) == 8 << 20  # q of 16 MiB: the cap
    assert default_workspace(torch.empty(1, 1, 24, 16)) == 64 << 10  # the floor
