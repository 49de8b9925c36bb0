"""causal_dot_product against the naive float64 formula: forward and gradients."""
import pytest
import torch

from repro.kernels import causal_dot_product, causal_dot_product_chunked, default_chunk_size, select_backend
from repro.kernels.causal_product import cpu_native
from repro.kernels.causal_product.reference import causal_dot_product_loop, causal_dot_product_naive

SHAPES = [  # (B, H, N, D, M): N = 1, N below / not a multiple of / far past the chunk, D != M
    (1, 1, 1, 4, 4),
    (2, 3, 7, 5, 9),
    (1, 2, 33, 16, 8),
    (3, 1, 130, 32, 17),
    (1, 4, 257, 64, 64),
]


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    """These are CPU tests of the dispatcher's torch path: REPRO_KERNEL=cupy, set for the GPU
    kernel tests, must not reach them (the tests that want it set it themselves)."""
    monkeypatch.delenv("REPRO_KERNEL", raising=False)


def _inputs(b, h, n, d, m, dtype=torch.float64):
    return [torch.randn(b, h, n, x, dtype=dtype, requires_grad=True) for x in (d, d, m)]


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk", [None, 16, 64])
def test_chunked_matches_naive_float64(shape, chunk):
    q, k, v = _inputs(*shape)
    out = causal_dot_product_chunked(q, k, v, chunk)
    ref = causal_dot_product_naive(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(ref)
    for a, b in zip(_grads(out, (q, k, v), g), _grads(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape", SHAPES[1:])
def test_float32_and_bfloat16_against_float64(shape):
    q64, k64, v64 = _inputs(*shape)
    ref = causal_dot_product_naive(q64, k64, v64)
    g = torch.randn_like(ref)
    ref_grads = _grads(ref, (q64, k64, v64), g)
    for dtype, tol in [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)]:
        q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q64, k64, v64))
        out = causal_dot_product(q, k, v)
        assert out.dtype == dtype
        # errors relative to the output's scale (bf16 inputs are themselves rounded)
        scale = ref.abs().max()
        assert ((out.double() - ref).abs().max() / scale) < tol
        for a, b in zip(_grads(out, (q, k, v), g.to(dtype)), ref_grads):
            assert a.dtype == dtype
            assert ((a.double() - b).abs().max() / b.abs().max()) < tol


def test_autocast_keeps_fp32_accumulation():
    q, k, v = (x.detach().float() for x in _inputs(1, 2, 50, 8, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = causal_dot_product(q, k, v)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), causal_dot_product_naive(q.double(), k.double(), v.double()),
                               rtol=1e-4, atol=1e-4)


def test_loop_reference_is_the_rnn_definition():
    q, k, v = _inputs(2, 2, 19, 6, 5)
    torch.testing.assert_close(causal_dot_product_loop(q, k, v), causal_dot_product_naive(q, k, v))


def test_only_requested_gradients():
    q, k, v = _inputs(1, 1, 20, 4, 3)
    k.requires_grad_(False)
    out = causal_dot_product(q, k, v)
    gq, gv = torch.autograd.grad(out.sum(), (q, v))
    rq, rv = torch.autograd.grad(causal_dot_product_naive(q, k, v).sum(), (q, v))
    torch.testing.assert_close(gq, rq)
    torch.testing.assert_close(gv, rv)


def test_default_chunk_size():
    assert default_chunk_size(64, 64) == 64
    assert default_chunk_size(32, 32) == 32
    assert default_chunk_size(1, 1) == 16 and default_chunk_size(1024, 1024) == 256


def test_bad_inputs_name_the_problem():
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="q and k must share a shape"):
        causal_dot_product(q, torch.randn(1, 2, 6, 4), torch.randn(1, 2, 5, 3))
    with pytest.raises(ValueError, match="v must be"):
        causal_dot_product(q, q, torch.randn(1, 2, 4, 3))
    with pytest.raises(ValueError, match="one floating dtype"):
        causal_dot_product(q, q, torch.randn(1, 2, 5, 3, dtype=torch.float64))


def test_dispatcher_on_cpu(monkeypatch):
    q = torch.randn(1, 1, 4, 2)
    monkeypatch.delenv("REPRO_KERNEL", raising=False)
    backend, why = select_backend(q, q, q)
    if cpu_native.unavailable():
        assert backend == "torch" and "fused CPU kernel is unavailable" in why
    else:
        assert backend == "cpu" and "fused CPU kernel" in why
    backend, why = select_backend(*(x.double() for x in (q, q, q)))
    assert backend == "torch" and "CUDA" in why
    monkeypatch.setenv("REPRO_KERNEL", "cupy")
    with pytest.raises(RuntimeError, match="REPRO_KERNEL=cupy"):
        causal_dot_product(q, q, q)
    monkeypatch.setenv("REPRO_KERNEL", "triton")
    with pytest.raises(ValueError, match="valid: cupy, cpu, torch"):
        causal_dot_product(q, q, q)
    monkeypatch.setenv("REPRO_KERNEL", "torch")
    assert select_backend(q, q, q)[0] == "torch"


def test_kernels_task_names_the_backend_the_dispatcher_took(compose_cfg, tmp_path):
    """task=kernels times the chunked path itself and, apart, the dispatcher (on a CPU it takes the
    fused CPU kernel where it builds; on a GPU the CuPy kernels once verified): each row says which."""
    from repro.common.results import read_jsonl
    from repro.tasks.kernels import run
    cfg = compose_cfg("task=kernels", "task.implementations=[chunked,dispatcher,naive]", "task.lengths=[20]",
                      "task.heads=1", "task.d=4", "task.m=3", "task.warmup=0", "task.repeats=1", "device=cpu",
                      f"+run_dir={tmp_path}")
    run(cfg)
    rows = {r["implementation"]: r for r in read_jsonl(tmp_path / "results.jsonl")}
    assert rows["dispatcher"]["backend"] == ("torch" if cpu_native.unavailable() else "cpu")
    assert rows["chunked"]["backend"] == "chunked"
    assert all(r["status"] == "ok" and r["forward_backward_ms"] > 0 for r in rows.values())


@pytest.mark.parametrize("shape,chunk", [((1, 2, 11, 3, 5), 4),  # 3 chunks: the triangular-matmul scan
                                         ((2, 1, 37, 3, 2), 4),  # 10 chunks: the loop scan
                                         ((1, 1, 9, 4, 3), None)])  # one partial chunk
@pytest.mark.parametrize("need", [(True, True, True), (True, False, True)])
def test_second_derivatives_through_the_chunked_product(shape, chunk, need):
    """Under create_graph the gradients are causal products themselves, differentiable in turn:
    gradgradcheck (numerical second derivatives, float64), and a gradient penalty against the
    naive formula's (its backward was once-only: create_graph gave None or partial values)."""
    q, k, v = _inputs(*shape)
    for x, r in zip((q, k, v), need):
        x.requires_grad_(r)
    assert torch.autograd.gradgradcheck(lambda *a: causal_dot_product_chunked(*a, chunk), (q, k, v))
    wrt = [x for x in (q, k, v) if x.requires_grad]
    g = torch.randn(q.shape[:-1] + v.shape[-1:], dtype=torch.float64)
    penalties = []
    for fn in (lambda *a: causal_dot_product_chunked(*a, chunk), causal_dot_product_naive):
        grads = torch.autograd.grad(fn(q, k, v), wrt, g, create_graph=True)
        penalties.append(torch.autograd.grad(sum(gr.square().sum() for gr in grads), wrt))
    for a, b in zip(*penalties):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


# The rows of (out, grad q, grad k, grad v) that a non-finite row p of q, k, v or the upstream
# gradient g reaches, by the formulas' dependencies: out_i and grad q_i read k, v at j <= i (out_i
# also q_i, grad q_i also g_i); grad k_i and grad v_i read q, g at j >= i and v_i or k_i.
REACH = {"q": ("==", None, "<=", "<="), "k": (">=", ">=", None, "=="), "v": (">=", ">=", "==", None),
         "g": (None, "==", "<=", "<=")}


@pytest.mark.parametrize("n,chunk", [(20, None), (70, None), (70, 16), (300, None)])  # one chunk, 3 and 5 (the
@pytest.mark.parametrize("which", "qkvg")                                  # triangular-matmul scan), 10 (the loop)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_non_finite_input_reaches_only_the_rows_causality_allows(monkeypatch, n, chunk, which, bad, threads):
    """An inf or NaN at position p of a 70-token sequence made all 70 outputs non-finite (masked
    zeros times inf, in the scan's triangular matmul and the intra-chunk products). Rows it does
    not reach equal the naive formula's on the inputs with that row zeroed (finite); rows it
    reaches are not finite. One row per group of rows, the groups on 1 or 2 host threads."""
    from repro.kernels.causal_product import chunked

    monkeypatch.setattr(chunked, "GROUP_CHUNKS", 1)
    gen = torch.Generator().manual_seed(n)
    clean = {x: torch.randn(2, 2, n, d, dtype=torch.float64, generator=gen) for x, d in zip("qkvg", (5, 5, 7, 7))}
    p = n * 4 // 7  # 40 of 70: inside a chunk, not at its start
    dirty = {x: t.clone() for x, t in clean.items()}
    dirty[which][..., p, :] = bad
    clean[which][..., p, :] = 0.0
    results, before = [], torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for fn, ins in ((lambda *a: causal_dot_product_chunked(*a, chunk), dirty), (causal_dot_product_naive, clean)):
            q, k, v = (ins[x].requires_grad_() for x in "qkv")
            out = fn(q, k, v)
            results.append((out, *torch.autograd.grad(out, (q, k, v), ins["g"])))
    finally:
        torch.set_num_threads(before)
    rows = torch.arange(n)
    for name, got, want, rule in zip(("out", "grad q", "grad k", "grad v"), *results, REACH[which]):
        reached = {"==": rows == p, ">=": rows >= p, "<=": rows <= p, None: rows < 0}[rule]
        assert torch.isfinite(got[..., ~reached, :]).all(), f"{name}: a row causality keeps finite is not"
        torch.testing.assert_close(got[..., ~reached, :], want[..., ~reached, :], rtol=1e-10, atol=1e-10)
        assert not torch.isfinite(got[..., reached, :]).any(), f"{name}: a reached row came out finite"
