"""The CuPy CUDA backends (repro/kernels/{causal_product,normalised,recurrent}/cuda.py, causal_dot*.cu,
recurrent_step.cu; their switches, repro/kernels/plumbing/switches.py).

Without a GPU: every .cu source compiles with NVRTC for sm_80 and sm_90 (and with nvcc when
it is installed), the numpy model of the kernels' tiling (tests/kernel_emulation.py) matches
the float64 reference, the ops' fakes (what torch.compile sees) match the real ops, and the
backend declines CPU tensors with its reason.
With a GPU: forward and gradients against the float64 reference, on odd shapes, with every
output pre-filled with NaN so an element no thread writes fails the test.

The GPU verification command (docs/gpu.md); it needs only torch, CuPy,
numpy and pytest:
    REPRO_KERNEL=cupy python -m pytest -q tests/kernels/test_cupy_kernels.py
Every test here sets the backend it needs itself (REPRO_KERNEL is cleared for each test and
the GPU tests force cupy), so the variable cannot break the CPU tests; the CPU references
never go through the dispatcher.
"""
import json
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import kernel_emulation as emulate  # tests/kernel_emulation.py: the numpy model of the kernels' tiling
import numpy as np
import pytest
import torch

from repro.kernels import causal_dot_product, causal_dot_product_chunked, select_backend
from repro.kernels.causal_product import cuda as product_cuda
from repro.kernels.causal_product.reference import causal_dot_product_naive
from repro.kernels.normalised import cuda as normalised_cuda
from repro.kernels.plumbing import cuda_build, cuda_grid, switches
from repro.kernels.plumbing.cupy_launch import CALLS, cupy_stream
from repro.kernels.plumbing.switches import switched
from repro.kernels.recurrent import cuda as step_cuda

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="no CUDA device: the GPU tests of the CuPy kernels "
                               "run only on a machine with one")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    """Each test picks its backend and switches: `REPRO_KERNEL=cupy pytest ...` must not reach the
    CPU tests, nor REPRO_KERNEL_SWITCHES a test that sets its own."""
    monkeypatch.delenv("REPRO_KERNEL", raising=False)
    monkeypatch.delenv(switches.ENV, raising=False)


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    assert not torch.isnan(x).any(), "an output element was never written (still NaN)"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------- CPU: build checks

@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", sorted(cuda_build.SOURCES))
def test_nvrtc_compiles_every_instance(name, arch):
    lowered = cuda_build.nvrtc_check(name, arch)
    assert set(lowered) == set(cuda_build.SOURCES[name]) and all(lowered.values())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("name", sorted(cuda_build.SOURCES))
def test_nvcc_compiles_every_instance(name, tmp_path):
    unit = tmp_path / "unit.cu"
    unit.write_text(cuda_build.nvcc_instantiation_unit(name))
    cubin = tmp_path / "unit.cubin"  # device code only: the host compiler has nothing to check
    res = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_80", "-cubin", str(unit), "-o", str(cubin)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    kernels = set(re.findall(rb"\.text\.(_Z\w+)", cubin.read_bytes()))
    assert len(kernels) == len(cuda_build.SOURCES[name]), "an instance was not compiled"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(cuda_build.SOURCES))
def test_no_kernel_the_suite_launches_spills_on_an_h100(name):
    """Every instance as the suite builds it (NVRTC, what CuPy launches) for sm_90: no register
    spills. nvcc, from the same source and launch bounds, spills 16 bytes in the reversed bf16
    product (docs/kernels.md): that build is not the one that runs."""
    usage = cuda_build.ptxas_usage(name, "sm_90")
    assert set(usage) == set(cuda_build.SOURCES[name])
    assert all(spills == 0 for _, spills in usage.values()), usage


def test_tile_constants_agree():
    """The .cu's tile geometry is what the launcher sizes shared memory for and what the
    emulation models."""
    src = cuda_build.source("causal_product/causal_dot.cu")
    defs = {k: int(v) for k, v in re.findall(r"#define (\w+) (\d+)", src)}
    assert (defs["CHUNK"], defs["TILE"], defs["PITCH"], defs["NTHREADS"]) == \
        (cuda_grid.CHUNK, cuda_grid.TILE, cuda_grid.PITCH, cuda_grid.NTHREADS)
    assert (defs["CHUNK"], defs["TILE"]) == (emulate.CHUNK, emulate.TILE)
    assert defs["NTHREADS"] == 16 * 16 and defs["CHUNK"] == defs["TILE"] == 4 * 16  # 4 x 4 per thread
    step = dict(re.findall(r"#define (\w+) (\d+)", cuda_build.source("recurrent/recurrent_step.cu")))
    step = {k: int(v) for k, v in step.items()}
    assert step["STEP_THREADS"] == step_cuda.STEP_THREADS
    tc = dict(re.findall(r"#define (\w+) (\d+)", cuda_build.source("causal_product/causal_dot_tc.cu")))
    tc = {k: int(v) for k, v in tc.items()}
    assert (tc["TC_CHUNK"], tc["TC_TILE"], tc["TC_THREADS"]) == (defs["CHUNK"], defs["TILE"], defs["NTHREADS"])
    assert (tc["TC_P"], tc["TC_SP"]) == (cuda_grid.TC_P, cuda_grid.TC_SP) and tc["TC_P"] == emulate.TC_P


def test_the_bare_tensor_core_product_fits_three_blocks_per_h100_sm():
    """The tensor-core chunk kernel's shared memory at D = 64 (causal_dot_tc.cu's layout): with
    the normaliser's fp32 scores 83,456 bytes, 2 blocks in an H100 SM (228 KiB, 1 KiB reserved
    per block; the profile found 2 and a latency-bound kernel), without them 65,024, 3. The
    kernels' correctness at both sizes is the GPU tests' (and memcheck's) to show."""
    per_sm, reserved = 228 * 1024, 1024
    for norm, size, blocks in ((True, 83456, 2), (False, 65024, 3)):
        got = cuda_grid.smem_chunks_tc(64, norm)
        assert (got, per_sm // (got + reserved)) == (size, blocks)
    assert cuda_grid.smem_chunks_tc(130, False) < cuda_grid.smem_chunks_tc(130, True)


def test_the_staged_kernel_fits_three_blocks_per_h100_sm():
    """causal_dot_tc_staged.cu's kernels as ptxas compiles them for an H100 (sm_90): no spills, and
    registers (64K an SM, given out per warp in 256s) and shared memory (228 KiB an SM, 1 KiB
    reserved per block) for 3 blocks of 256 threads, where cdp_chunks_tc with the normaliser fits 2."""
    usage = cuda_build.ptxas_usage("causal_product/causal_dot_tc_staged.cu", "sm_90")
    assert set(usage) == set(cuda_build.SOURCES["causal_product/causal_dot_tc_staged.cu"])
    for instance, (regs, spills) in usage.items():
        per_block = -(-regs * 32 // 256) * 256 * cuda_grid.NTHREADS // 32
        assert spills == 0 and 65536 // per_block >= 3, (instance, regs, spills)
    assert (228 * 1024) // (cuda_grid.SMEM_STAGED + 1024) == 3
    plain = cuda_build.ptxas_usage("causal_product/causal_dot_tc.cu", "sm_90")
    assert max(r for r, _ in plain.values()) > 85  # the check can fail


def _np(*shape, rng):
    return rng.standard_normal(shape)


@pytest.mark.parametrize("bh,n,d,m,cpg", [(2, 130, 70, 67, 1), (1, 200, 5, 130, 2), (1, 257, 33, 9, 3),
                                          (1, 1, 3, 2, 1), (1, 64, 64, 64, 1)])
def test_emulated_tiling_matches_reference(bh, n, d, m, cpg):
    """Groups of chunks, the state scan, partial chunks and tiles, several key-dim passes and
    value tiles, reverse time and the normaliser, as the kernels walk them."""
    rng = np.random.default_rng(n * d + m)
    q, k, v = _np(bh, n, d, rng=rng), _np(bh, n, d, rng=rng), _np(bh, n, m, rng=rng)
    t = lambda a: torch.from_numpy(a.copy())  # copy: numpy flips have negative strides
    ref = causal_dot_product_naive(t(q), t(k), t(v)).numpy()
    out, _ = emulate.causal_dot_product(q, k, v, cpg)
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-10)
    # reverse time: out_i = sum_{j>=i} (q_i . k_j) v_j
    flip = lambda a: a[:, ::-1]
    ref_rev = flip(causal_dot_product_naive(t(flip(q)), t(flip(k)), t(flip(v))).numpy())
    out, _ = emulate.causal_dot_product(q, k, v, cpg, rev=True)
    np.testing.assert_allclose(out, ref_rev, rtol=1e-10, atol=1e-10)
    # the fused normaliser on positive features
    qp, kp = np.exp(0.3 * q), np.exp(0.3 * k)
    num = causal_dot_product_naive(t(qp), t(kp), t(v)).numpy()
    den = np.einsum("bnf,bnf->bn", qp, np.cumsum(kp, 1))
    out, den_out = emulate.causal_dot_product(qp, kp, v, cpg, norm=True, eps=1e-6)
    np.testing.assert_allclose(den_out, den, rtol=1e-10)
    np.testing.assert_allclose(out, num / (den[..., None] + 1e-6), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("blocks,n_chunks,sms", [(64, 256, 132), (1, 1, 132), (512, 10, 108), (3, 1000, 132)])
def test_chunks_per_group_covers_every_chunk(blocks, n_chunks, sms):
    cpg = cuda_grid.chunks_per_group(blocks, n_chunks, sms)
    n_groups = -(-n_chunks // cpg)
    assert 1 <= cpg <= cuda_grid.MAX_CPG and (n_groups - 1) * cpg < n_chunks <= n_groups * cpg


def test_chunks_per_group_as_measured_on_the_h100():
    """The H100's sweep (results/gpu/.../profile/chunks_per_group.csv): at N = 16k, 8 chunks per
    group, not the 29 that ~4 blocks per SM alone gave; at N = 4k, 8 either way; short
    sequences keep their ~4 blocks per SM."""
    assert cuda_grid.grid(64, 16384, 64, 132)[:2] == (8, 32)
    assert cuda_grid.grid(64, 4096, 64, 132)[:2] == (8, 8)
    assert cuda_grid.grid(64, 1024, 64, 132)[:2] == (2, 8)
    assert cuda_grid.grid(64, 65536, 64, 132)[:2] == (8, 128)


def test_backend_declines_cpu_tensors_with_a_reason(monkeypatch):
    q = torch.randn(1, 2, 5, 3)
    monkeypatch.delenv("REPRO_KERNEL", raising=False)
    with switched(gpu_verified=False):
        assert "not yet verified on a GPU" in product_cuda.unsupported_reason(q, q, q)
    monkeypatch.setenv("REPRO_KERNEL", "cupy")
    assert "CUDA tensors only" in product_cuda.unsupported_reason(q, q, q)
    with pytest.raises(RuntimeError, match="REPRO_KERNEL=cupy"):
        select_backend(q, q, q)
    monkeypatch.setenv("REPRO_KERNEL", "torch")
    assert "REPRO_KERNEL=torch" in product_cuda.unsupported_reason(q, q, q)


def test_unforced_the_kernels_run_only_where_the_h100_measured_them_faster(monkeypatch):
    """Verified on the H100, the CuPy kernels are the default only where its benchmark found them
    faster than the torch path: the bf16 product; the fused normalised kernel in bf16 without
    gradients. fp32 and fp16, the fused kernel's backward and the recurrent step stay on the
    torch path unless REPRO_KERNEL=cupy forces them (then only the device decides). The CPU
    tensors pass the gate and are then declined for their device: that is the gate's verdict."""
    monkeypatch.delenv("REPRO_KERNEL", raising=False)
    assert switches.current().gpu_verified  # the default: verified on the H100
    gated = "not measured faster"
    mk = lambda dtype, grad=False: torch.ones(1, 2, 5, 3, dtype=dtype, requires_grad=grad)
    assert gated in product_cuda.unsupported_reason(mk(torch.float32), mk(torch.float32), mk(torch.float32))
    assert gated in product_cuda.unsupported_reason(*(mk(torch.float16),) * 3)
    assert "CUDA tensors only" in product_cuda.unsupported_reason(*(mk(torch.bfloat16),) * 3)
    # float64 is no kernel dtype: the device check names that, not the speed table
    assert "CUDA tensors only" in product_cuda.unsupported_reason(*(mk(torch.float64),) * 3)
    assert "CUDA tensors only" in normalised_cuda.unsupported_reason(*(mk(torch.bfloat16),) * 3)
    grads = (mk(torch.bfloat16, True), mk(torch.bfloat16), mk(torch.bfloat16))
    assert "backward is slower" in normalised_cuda.unsupported_reason(*grads)
    with torch.no_grad():
        assert "CUDA tensors only" in normalised_cuda.unsupported_reason(*grads)
    q = torch.ones(1, 2, 3)
    S, Z = torch.zeros(1, 2, 3, 3), torch.zeros(1, 2, 3)
    assert gated in step_cuda.unsupported_reason(q, q, q, S, Z)
    monkeypatch.setenv("REPRO_KERNEL", "cupy")
    for args in [(mk(torch.float32),) * 3, (mk(torch.float16),) * 3]:
        assert "CUDA tensors only" in product_cuda.unsupported_reason(*args)
    assert "CUDA tensors only" in normalised_cuda.unsupported_reason(*grads)
    assert "CUDA tensors only" in step_cuda.unsupported_reason(q, q, q, S, Z)


def test_linear_attention_step_on_cpu_still_matches_parallel():
    """attend_step's state set-up moved for the fused step; the CPU path must not change."""
    from repro.attention.linear import LinearAttention
    layer = LinearAttention(d_model=24, n_heads=3).double().eval()
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    par, state, steps = layer(x, causal=True), None, []
    for i in range(x.shape[1]):
        y, state = layer.step(x[:, i], state)
        steps.append(y)
    torch.testing.assert_close(torch.stack(steps, 1), par, rtol=1e-10, atol=1e-10)


def test_second_derivatives_of_the_ops_backward_functions_on_cpu(monkeypatch):
    """_cdp_grad and _cla_grad (what the CuPy ops' autograd runs) under create_graph, with the
    CUDA ops stood in by the torch path: the forward op by a Function that saves what the real
    one saves and runs _cdp_grad as its backward (so the gradients recurse through it, as they
    do through _cdp), the first-order backward ops by the same gradients in torch. gradcheck and
    gradgradcheck in float64; the kernels themselves are the GPU tests' part."""
    from repro.kernels.causal_product.chunked import causal_product_grads

    class Cdp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            product_cuda._cdp_setup(ctx, (q, k, v), None)
            return causal_dot_product_chunked(q, k, v)

        @staticmethod
        def backward(ctx, g):
            return product_cuda._cdp_grad(ctx, g)

    class Cla(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, eps):
            out = causal_dot_product_chunked(q, k, torch.cat([v, v.new_ones(*v.shape[:-1], 1)], -1))
            y, den = out[..., :-1] / (out[..., -1:] + eps), out[..., -1]
            normalised_cuda._cla_setup(ctx, (q, k, v, eps), (y, den))
            return y, den

        @staticmethod
        def backward(ctx, g, g_den):
            return normalised_cuda._cla_grad(ctx, g, g_den)

    def no_derivative(fn):  # the backward ops have none: their results leave the graph
        return lambda *a: torch.no_grad()(fn)(causal_dot_product_chunked, *a)

    monkeypatch.setattr(product_cuda, "_cdp", Cdp.apply)
    monkeypatch.setattr(product_cuda, "cdp_backward", no_derivative(causal_product_grads))
    monkeypatch.setattr(normalised_cuda, "_cla_backward", no_derivative(normalised_cuda.cla_grads))
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.rand(1, 2, 11, 3, dtype=torch.float64, generator=gen).add(0.3).requires_grad_() for _ in range(2))
    v = torch.randn(1, 2, 11, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    for fn in (Cdp.apply, lambda q, k, v: Cla.apply(q, k, v, 1e-6)[0], lambda q, k, v: Cla.apply(q, k, v, 1e-6)[1]):
        assert torch.autograd.gradcheck(fn, (q, k, v)) and torch.autograd.gradgradcheck(fn, (q, k, v))


# --------------------------------------------------------------------------- GPU: the kernels

@pytest.fixture
def on_cupy(monkeypatch):
    monkeypatch.setenv("REPRO_KERNEL", "cupy")
    with switched(prefill_nan=True):  # any output element a kernel fails to write shows up
        yield


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
SHAPES = [(1, 1, 1, 1, 1), (2, 3, 65, 17, 33), (1, 2, 200, 64, 64), (2, 1, 333, 130, 70), (1, 1, 129, 256, 256),
          (1, 1, 97, 300, 5)]  # D beyond 256: correct, where shared memory allows it


def _inputs(b, h, n, d, m, dtype, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(n * 1000 + d * 10 + m)
    mk = lambda *s: (torch.randn(*s, device="cuda", generator=g) * scale).to(dtype).requires_grad_()
    return mk(b, h, n, d), mk(b, h, n, d), mk(b, h, n, m)


def _check_against_naive(fn, ref_fn, inputs, tol):
    out = fn(*inputs)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad)
    ref_in = [x.detach().double().requires_grad_() for x in inputs]
    ref = ref_fn(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, grad.double())
    assert out.dtype == inputs[0].dtype and out.shape == ref.shape
    assert rel_err(out, ref) <= tol
    for name, gr, rg in zip("qkv", grads, ref_grads):
        assert rel_err(gr, rg) <= tol, f"grad {name}"


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_causal_dot_product_matches_naive(on_cupy, shape, dtype):
    inputs = _inputs(*shape, dtype, scale=0.5)
    assert select_backend(*inputs)[0] == "cupy"
    _check_against_naive(causal_dot_product, causal_dot_product_naive, inputs, TOL[dtype])


@needs_gpu
@pytest.mark.parametrize("cpg", [1, 2, 5])
@pytest.mark.parametrize("rev", [False, True])
@pytest.mark.parametrize("dtype,tensor_cores", [(torch.float32, False), (torch.bfloat16, False),
                                                (torch.bfloat16, True)])
def test_launch_group_sizes_and_reverse(on_cupy, cpg, rev, dtype, tensor_cores):
    q, k, v = (x.detach()[0] for x in _inputs(1, 3, 390, 37, 80, dtype))  # (BH, N, X)
    out, _ = product_cuda.launch(q, k, v, rev=rev, cpg=cpg, tensor_cores=tensor_cores)
    f = (lambda x: x.flip(1)) if rev else (lambda x: x)
    ref = f(causal_dot_product_naive(f(q), f(k), f(v)))
    assert rel_err(out, ref) <= TOL[dtype]


@needs_gpu
@pytest.mark.parametrize("shape", [(1, 2, 200, 64, 64), (2, 1, 333, 130, 70), (1, 3, 390, 37, 80),
                                   (2, 2, 150, 8, 24), (1, 1, 100, 136, 16), (1, 2, 300, 32, 72)])
def test_tensor_core_variants_are_the_same(on_cupy, shape):
    """BARE_SMEM (the bare product asks only the shared memory it uses), VEC_LOADS (Q and K
    tiles by 16-byte loads, where D % 8 == 0 and the rows are aligned; a misaligned tensor and
    odd D keep 2-byte loads) and STAGED (the pipelined kernel, where D <= 64, D and M are
    multiples of 8 and the rows aligned): the same sums, so outputs and gradients (the backward's
    reversed launches too) bit for bit those of the plain kernel, and the float64 reference's."""
    inputs = _inputs(*shape, torch.bfloat16, scale=0.5)
    q, k, v = (x.detach().flatten(0, 1) for x in inputs)
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)
    q_off = buf[1:].view(q.shape).copy_(q)  # 2 bytes past alignment: the launcher must not vectorise it
    d, m = shape[3:]
    takes = lambda x, y: x <= 64 and x % 8 == y % 8 == 0  # the staged kernel's (D, M)
    runs = {}
    for bare, vec, staged in ((False, False, False), (True, False, False), (False, True, False), (True, True, False),
                              (False, False, True)):
        with switched(bare_smem=bare, vec_loads=vec, staged=staged):
            before = CALLS["staged"]
            out = causal_dot_product(*inputs)
            runs[bare, vec, staged] = (out, *torch.autograd.grad(out, inputs, torch.ones_like(out)),
                                       product_cuda.launch(q, k, v, cpg=2, tensor_cores=True)[0],  # several groups
                                       product_cuda.launch(q_off, k, v, rev=True, tensor_cores=True)[0])
            # the launches on (D, M): forward, grad v, the grouped one; on (M, D): grad q, grad k; never the
            # misaligned one
            assert CALLS["staged"] - before == staged * (3 * takes(d, m) + 2 * takes(m, d))
            _check_against_naive(causal_dot_product, causal_dot_product_naive, inputs, TOL[torch.bfloat16])
    for variant, got in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(runs[False, False, False], got)), variant


@needs_gpu
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_bf16_normaliser_both_kernels(on_cupy, tensor_cores):
    q, k, v = (x.detach()[0] for x in _inputs(1, 2, 300, 70, 90, torch.bfloat16, scale=0.5))
    q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    out, den = product_cuda.launch(q, k, v, norm=True, eps=1e-6, cpg=2, tensor_cores=tensor_cores)
    ref = _linear_reference(q[None].double(), k[None].double(), v[None].double())[0]
    assert rel_err(out, ref) <= 1e-2
    assert rel_err(den, torch.einsum("bnf,bnf->bn", q.double(), k.double().cumsum(1))) <= 1e-5


@needs_gpu
def test_non_contiguous_inputs(on_cupy):
    q, k, v = (x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
               for x in _inputs(2, 3, 77, 16, 24, torch.float32))
    assert not q.is_contiguous()
    _check_against_naive(causal_dot_product, causal_dot_product_naive, (q, k, v), 1e-5)


def _linear_reference(q, k, v, eps=1e-6):
    num = causal_dot_product_naive(q, k, v)
    den = torch.einsum("bhnf,bhnf->bhn", q, k.cumsum(2))
    return num / (den[..., None] + eps)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 65, 17, 33), (1, 2, 300, 64, 64), (1, 1, 150, 70, 130)])
def test_fused_normaliser_matches_naive(on_cupy, shape, dtype):
    q, k, v = _inputs(*shape, dtype, scale=0.5)
    with torch.no_grad():  # positive features, as phi gives
        q.copy_(torch.nn.functional.elu(q) + 1)
        k.copy_(torch.nn.functional.elu(k) + 1)
    assert normalised_cuda.unsupported_reason(q, k, v) is None
    fused = lambda q, k, v: normalised_cuda.causal_linear_attention(q, k, v, 1e-6)
    _check_against_naive(fused, _linear_reference, (q, k, v), TOL[dtype])


@needs_gpu
def test_second_derivatives_through_the_ops(on_cupy):
    """Under create_graph the ops' gradients come from the differentiable forward op (they were
    the backward ops, which have no derivative of their own): a gradient penalty through
    causal_dot_product and the fused normalised attention against the float64 formulas'."""
    q, k, v = _inputs(2, 3, 130, 17, 33, torch.float32, scale=0.5)
    with torch.no_grad():  # positive features, as phi gives
        q.copy_(torch.nn.functional.elu(q) + 1)
        k.copy_(torch.nn.functional.elu(k) + 1)
    fused = lambda q, k, v: normalised_cuda.causal_linear_attention(q, k, v, 1e-6)
    for fn, ref_fn in ((causal_dot_product, causal_dot_product_naive), (fused, _linear_reference)):
        g = torch.randn(2, 3, 130, 33, device="cuda")
        penalties = []
        for f, ins in ((fn, (q, k, v)), (ref_fn, [x.detach().double().requires_grad_() for x in (q, k, v)])):
            grads = torch.autograd.grad(f(*ins), ins, g.to(ins[0].dtype), create_graph=True)
            penalties.append(torch.autograd.grad(sum(gr.square().sum() for gr in grads), ins))
        for name, a, b in zip("qkv", *penalties):
            assert rel_err(a, b) <= 1e-4, f"second derivative, {name}"


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_recurrent_step_matches_parallel(on_cupy, dtype):
    b, h, n, d, m = 3, 4, 37, 33, 70
    q, k, v = (x.detach() for x in _inputs(b, h, n, d, m, dtype, scale=0.5))
    q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    ref = _linear_reference(q.double(), k.double(), v.double())
    S = torch.zeros(b, h, d, m, device="cuda")
    Z = torch.zeros(b, h, d, device="cuda")
    assert step_cuda.unsupported_reason(q[:, :, 0], k[:, :, 0], v[:, :, 0], S, Z) is None
    steps = [step_cuda.linear_attention_step(q[:, :, i], k[:, :, i], v[:, :, i], S, Z, 1e-6) for i in range(n)]
    assert rel_err(torch.stack(steps, 2), ref) <= TOL[dtype]
    assert rel_err(Z, k.double().sum(2)) <= 1e-5


def _layer_reference(layer, x):
    """The linear attention layer written out in float64 on the CPU, with the naive product:
    no dispatcher, no layer code (REPRO_KERNEL=cupy would send a CPU layer to the CuPy path)."""
    F = torch.nn.functional
    p = {name: t.detach().cpu().double() for name, t in layer.named_parameters()}
    x = x.detach().cpu().double()

    def heads(name, d):  # (B, N, d_model) -> (B, H, N, d)
        return F.linear(x, p[f"{name}.weight"], p[f"{name}.bias"]).unflatten(-1, (layer.n_heads, d)).transpose(1, 2)
    q, k = (F.elu(heads(n, layer.d_keys)) + 1 for n in ("q_proj", "k_proj"))
    y = _linear_reference(q, k, heads("v_proj", layer.d_values), layer.eps)  # (B, H, N, M)
    return F.linear(y.transpose(1, 2).flatten(-2), p["out_proj.weight"], p["out_proj.bias"])


@needs_gpu
def test_linear_attention_layer_uses_fused_ops_and_generates(on_cupy):
    """The layer on CUDA: parallel form (fused normaliser) against the float64 formula, and
    step-wise generation (fused step) against the parallel form; both on the CuPy ops."""
    from repro.attention.linear import LinearAttention
    layer = LinearAttention(d_model=64, n_heads=4).cuda().eval()
    x = torch.randn(2, 45, 64, device="cuda")
    before = dict(CALLS)
    par = layer(x, causal=True)
    assert CALLS["causal_linear_attention"] == before.get("causal_linear_attention", 0) + 1
    assert rel_err(par.cpu(), _layer_reference(layer, x)) <= 1e-5
    state, steps = None, []
    with torch.no_grad():
        for i in range(x.shape[1]):
            y, state = layer.step(x[:, i], state)
            steps.append(y)
    assert CALLS["linear_attention_step"] == before.get("linear_attention_step", 0) + x.shape[1]
    assert rel_err(torch.stack(steps, 1), par) <= 1e-5


@needs_gpu
def test_torch_compile_matches_eager_and_autocast(on_cupy):
    """A compiled layer's output and gradients (input and every parameter) equal eager's, and
    the compiled graph calls the CuPy ops forward and backward (inductor checks the fakes'
    strides against the real outputs there)."""
    from repro.attention.linear import LinearAttention
    layer = LinearAttention(d_model=64, n_heads=4).cuda()
    x = torch.randn(2, 100, 64, device="cuda", requires_grad=True)
    g = torch.randn(2, 100, 64, device="cuda")
    params = [x, *layer.parameters()]
    eager = layer(x, causal=True)
    eager_grads = torch.autograd.grad(eager, params, g)
    compiled = torch.compile(lambda x: layer(x, causal=True))
    before = dict(CALLS)
    out = compiled(x)
    grads = torch.autograd.grad(out, params, g)
    for op in ("causal_linear_attention", "causal_linear_attention_backward"):
        assert CALLS[op] > before.get(op, 0), f"the compiled graph did not run {op}"
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(["x", *(n for n, _ in layer.named_parameters())], grads, eager_grads):
        assert rel_err(a, b) <= 1e-5, f"grad {name}"
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x, causal=True)
    assert y.dtype == torch.bfloat16 and rel_err(y.float(), eager) <= 2e-2


@needs_gpu
@pytest.mark.parametrize("shape", [(0, 2, 50, 8, 8), (2, 2, 50, 8, 0), (2, 2, 50, 0, 8)])
def test_zero_sized_inputs_launch_nothing(on_cupy, shape):
    q, k, v = _inputs(*shape, torch.float32)
    before = CALLS["launch"]
    out = causal_dot_product(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert out.shape == (*shape[:3], shape[4]) and not out.any() and all(not gr.any() for gr in grads)
    assert CALLS["causal_dot_product"] > 0 and CALLS["launch"] == before


# The realistic grid: B = H = 8 (B*H = 64 blocks per group), D = M = 64, N = 16k; the
# reference is the chunked torch path in float64, called directly (not through the dispatcher).
BIG = (8, 8, 16384, 64, 64)


def _big_inputs(dtype):
    g = torch.Generator(device="cuda").manual_seed(16)
    return [(torch.randn(*BIG[:3], x, device="cuda", generator=g) * 0.5).to(dtype) for x in BIG[3:4] * 2 + BIG[4:]]


@needs_gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_n16k_against_chunked_float64(on_cupy, dtype, tol):
    q, k, v = (x.requires_grad_() for x in _big_inputs(dtype))
    assert select_backend(q, k, v)[0] == "cupy"
    out = causal_dot_product(q, k, v)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = causal_dot_product_chunked(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, g.double())
    assert rel_err(out, ref) <= tol
    for name, a, b in zip("qkv", grads, ref_grads):
        assert rel_err(a, b) <= tol, f"grad {name}"
    if dtype == torch.bfloat16:  # the worst element too, against the output's scale
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() <= 1e-2


@needs_gpu
@pytest.mark.parametrize("rev", [False, True])
def test_tensor_cores_against_fma_on_the_same_bf16_inputs(on_cupy, rev):
    """The tensor-core kernel and the FMA kernel take the same bf16 inputs at the realistic grid:
    both within bf16 tolerance of float64, and of each other; they differ (the tensor-core one
    rounds its intermediate products to bf16), so both really ran."""
    q, k, v = (x.flatten(0, 1)[:, :4096].contiguous() for x in _big_inputs(torch.bfloat16))  # (BH, N, X)
    tc, _ = product_cuda.launch(q, k, v, rev=rev, tensor_cores=True)
    fma, _ = product_cuda.launch(q, k, v, rev=rev, tensor_cores=False)
    f = (lambda x: x.flip(1)) if rev else (lambda x: x)
    ref = f(causal_dot_product_chunked(*(f(x).double() for x in (q, k, v))))
    assert rel_err(tc, ref) <= 1e-2 and rel_err(fma, ref) <= 1e-2
    assert rel_err(tc, fma.double()) <= 1e-2 and not torch.equal(tc, fma)


@pytest.mark.parametrize("cuda_visible", [False, True], ids=["no-cuda", "cuda-visible"])
def test_bench_runs_on_cpu_with_missing_peers_and_resumes(tmp_path, monkeypatch, cuda_visible):
    """The benchmark on a CPU: the chunked path and SDPA are timed, every CUDA-only method is a
    'missing' row with its reason, rows reach bench.jsonl as they are measured, the CSV carries
    the ratios, and a rerun measures nothing twice. Also where a CUDA device is visible (faked
    here): the peers follow --device, not torch.cuda.is_available() (a GPU machine's step 1 ran
    this test and the peers tried to build for CUDA)."""
    from repro.reproduction import bench
    if cuda_visible and not CUDA:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = ["--device", "cpu", "--lengths", "70", "--dtypes", "fp32", "--batch", "1", "--heads", "2",
            "--dim", "8", "--warmup", "0", "--repeats", "1", "--calls", "1", "--out-dir", str(tmp_path)]
    rows = bench.main(args)
    by = {(r["method"], r["pass"]): r for r in rows}
    assert len(by) == 24 and {p for _, p in by} == {"fwd", "fwd_bwd"}
    for method in ("torch", "sdpa", "retention", "gla", "delta"):  # the successors' ops beside the causal product
        assert by[(method, "fwd_bwd")]["status"] == "ok" and by[(method, "fwd_bwd")]["ms"] > 0
    assert by[("gla", "fwd")]["vs_torch"] == by[("torch", "fwd")]["ms"] / by[("gla", "fwd")]["ms"]
    for method in ("cupy", "cupy_norm", "fast_transformers", "fla_chunk", "fla_retention", "fla_gla", "fla_delta"):
        status = by[(method, "fwd")]["status"]
        assert status.startswith("missing: ") and "CUDA only" in status, status
        assert "no CUDA device is visible" not in status or not cuda_visible, status
    assert by[("torch", "fwd")]["vs_sdpa"] == by[("sdpa", "fwd")]["ms"] / by[("torch", "fwd")]["ms"]
    lines = (tmp_path / "bench.jsonl").read_text().splitlines()
    assert len(lines) == 24 and (tmp_path / "bench.csv").exists()
    bench.main(args)  # the ok rows are kept; only the missing ones are tried again
    assert len((tmp_path / "bench.jsonl").read_text().splitlines()) == 24 + 14
    # --again after a change (a new commit): the method's points measured anew, its new rows in
    # bench.csv, both in bench.jsonl; the same command again at that commit measures nothing
    from repro.common import results
    monkeypatch.setenv("REPRO_GIT_SHA", "0123abcd4567")
    results.git_sha.cache_clear()
    try:
        again = bench.main(args + ["--methods", "torch", "sdpa", "--again", "torch"])
        assert len((tmp_path / "bench.jsonl").read_text().splitlines()) == 24 + 14 + 2
        fresh = [r for r in results.read_jsonl(tmp_path / "bench.jsonl") if r["method"] == "torch"][-2:]
        assert {r["git_sha"] for r in fresh} == {"0123abcd4567"}
        assert [(r["pass"], r["ms"]) for r in again if r["method"] == "torch"] == [(r["pass"], r["ms"]) for r in fresh]
        bench.main(args + ["--methods", "torch", "sdpa", "--again", "torch"])
        assert len((tmp_path / "bench.jsonl").read_text().splitlines()) == 24 + 14 + 2
    finally:
        results.git_sha.cache_clear()


def test_bench_skips_a_method_whose_one_call_is_too_slow(tmp_path):
    """A point whose first call passes --max-call-s is 'skipped', and the longer N of that
    method and pass with it, also after a rerun (so a slow fp32 SDPA cannot eat the step)."""
    from repro.reproduction import bench
    args = ["--device", "cpu", "--lengths", "16", "32", "--dtypes", "fp32", "--batch", "1", "--heads", "1",
            "--dim", "4", "--warmup", "1", "--repeats", "1", "--calls", "1", "--methods", "torch",
            "--max-call-s", "1e-9", "--out-dir", str(tmp_path)]
    rows = {(r["n"], r["pass"]): r["status"] for r in bench.main(args)}
    assert rows[(16, "fwd")].startswith("skipped: a warm call takes") and rows[(32, "fwd")] == \
        "skipped: N=16 was over --max-call-s"
    rows = {(r["n"], r["pass"]): r["status"] for r in bench.main(args)}
    assert rows[(32, "fwd_bwd")] == "skipped: N=16 was over --max-call-s"
    # rows skipped by a first call (before the warm retry: fla's compile on the H100) run again
    path = tmp_path / "bench.jsonl"
    old = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "status": r["status"].replace("a warm call", "one call")}) + "\n"
                            for r in old))
    fast = args[:args.index("--max-call-s")] + ["--max-call-s", "60", "--out-dir", str(tmp_path)]
    assert {r["status"] for r in bench.main(fast)} == {"ok"}


def test_bench_timer_judges_a_point_by_its_warm_call_not_a_first_call_that_compiles():
    """On the H100, fla's first call took 28 s (Triton compiling and autotuning), the Timer judged
    --max-call-s by it and skipped every fla point. A slow first call is retried once: only a
    second call over the limit skips the point."""
    import time

    from repro.reproduction import bench
    timer = bench.Timer(torch.device("cpu"), calls=1, max_call_s=0.05)
    calls = []

    def compiles_once():
        calls.append(1)
        time.sleep(0.2 if len(calls) == 1 else 0.0)

    ms, _, _ = timer(compiles_once, warmup=3, repeats=2)
    assert ms < 50 and len(calls) == 3 + 2  # the retry is one of the three warm-up calls
    with pytest.raises(bench.TooSlow, match="a warm call takes 0.1"):
        timer(lambda: time.sleep(0.1), warmup=3, repeats=2)


def test_bench_fast_transformers_source_from_the_sdist(tmp_path):
    """The authors' kernel is built from one file of their sdist: extracting it from an sdist
    laid out like pip's download, and saying what is missing when there is none."""
    import io
    import tarfile

    from repro.reproduction import peers
    sdist = tmp_path / peers.FT_SDIST_NAMES[0]
    with tarfile.open(sdist, "w:gz") as tar:
        data = b"// the authors' kernel\n"
        info = tarfile.TarInfo("pytorch-fast-transformers-0.4.0/" + peers.FT_MEMBER)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert peers.find_ft_sdist(sdist) == sdist
    assert peers.extract_ft_source(sdist, tmp_path / "build").read_bytes() == data
    with pytest.raises(SystemExit, match=r"no fast_transformers/causal_product/causal_product_cpu\.cpp inside"):
        peers.build_ft_cpu(sdist)  # the CPU peer's file is not in this one
    assert "CUDA" in peers.fast_transformers("cpu", sdist).why  # the device asked for, GPU or not
    if not CUDA:
        assert "CUDA" in peers.fast_transformers("cuda", sdist).why


@pytest.mark.slow  # pytest in a fresh process
def test_kernels_and_their_tests_need_no_hydra():
    """A GPU machine may have only torch, CuPy, numpy and pytest: with hydra and omegaconf made
    unimportable, the kernels and the benchmark import and this file's CPU tests run."""
    blocker = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("hydra", "omegaconf"):
                    raise ImportError(f"{name} is blocked for this test")
        sys.meta_path.insert(0, Block())
        import repro.kernels, repro.reproduction.bench, repro.kernels.causal_product.cuda, repro.reproduction.peers
        import pytest
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:hydra_pytest",
                              "tests/kernels/test_cupy_kernels.py", "-k", "step_on_cpu or fakes or bench_runs"]))
    """)
    res = subprocess.run([sys.executable, "-c", blocker], cwd=REPO, capture_output=True, text=True,
                         env={**__import__("os").environ, "REPRO_KERNEL": "cupy", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "4 passed" in res.stdout


def test_fakes_return_contiguous_tensors_like_the_real_ops():
    """The real ops return fresh contiguous tensors; v reaches the backward ops as a transposed
    view, and a fake that kept its strides broke inductor's assert_size_stride in every
    compiled backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k = (torch.empty(2, 37, 3, 5, device="cuda").transpose(1, 2) for _ in range(2))  # (B, H, N, D) views
        v = torch.empty(2, 37, 3, 7, device="cuda").transpose(1, 2)
        assert not v.is_contiguous()
        g = torch.empty(2, 3, 37, 7, device="cuda")
        outs = [*torch.ops.repro.causal_dot_product_backward(q, k, v, g),
                *torch.ops.repro.causal_linear_attention_backward(q, k, v, g, g[..., 0], g, None, 1e-6),
                torch.ops.repro.causal_dot_product(q, k, v), *torch.ops.repro.causal_linear_attention(q, k, v, 1e-6)]
        S, Z = torch.empty(2, 3, 5, 7, device="cuda"), torch.empty(2, 3, 5, device="cuda")
        outs.append(torch.ops.repro.linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], S, Z, 1e-6))
        for out in outs:
            assert out.is_contiguous(), f"a fake returned strides {out.stride()} for shape {tuple(out.shape)}"


def test_launch_grid_fits_cuda_limits():
    """gridDim.y (groups) stays within 65535 even when a caller asks for one chunk per group."""
    n = 64 * 65535 * 3 + 5  # three times the chunks gridDim.y can hold at one chunk per group
    for cpg in (1, 2, None):
        cpg_used, n_groups, n_mt = cuda_grid.grid(1, n, 64, 132, cpg)
        assert n_groups <= 65535 and cpg_used * n_groups * 64 >= n > (n_groups - 1) * cpg_used * 64
        assert n_mt == 1
    assert cuda_grid.grid(4, 6400, 130, 132, 3) == (3, 34, 3)  # a given cpg within the limit stays


def test_zero_sized_launch_returns_without_a_grid():
    """B*H = 0, M = 0 or D = 0 would be a zero grid (an invalid launch): the sums are empty or
    zero, and launch returns them without touching the GPU (so this runs on CPU tensors)."""
    q, k = torch.randn(0, 5, 3), torch.randn(0, 5, 3)
    out, den = product_cuda.launch(q, k, torch.randn(0, 5, 4), norm=True)
    assert out.shape == (0, 5, 4) and den.shape == (0, 5)
    q, k = torch.rand(2, 5, 3, dtype=torch.float64), torch.rand(2, 5, 3, dtype=torch.float64)
    out, den = product_cuda.launch(q, k, torch.randn(2, 5, 0, dtype=torch.float64), norm=True)
    assert out.shape == (2, 5, 0)
    torch.testing.assert_close(den, torch.einsum("bnd,bnd->bn", q, k.cumsum(1)).float())
    out, _ = product_cuda.launch(torch.randn(2, 5, 0), torch.randn(2, 5, 0), torch.randn(2, 5, 4))
    assert out.shape == (2, 5, 4) and not out.any()


def test_streams_go_through_the_cuda_stream_protocol():
    """CuPy 14 deprecates ExternalStream: torch's stream reaches CuPy by Stream.from_external
    (no GPU needed to build one over the legacy default stream, handle 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stream = cupy_stream(0)
    assert stream.ptr == 0


def test_emulated_tensor_core_fragments_give_the_four_products():
    """causal_dot_tc.cu's operand layouts: with each lane loading at the kernel's addresses and
    the m16n8k16 fragment layout, the 8 warps compute Q K^T, Q S, A V and K^T V."""
    rng = np.random.default_rng(3)
    p = emulate.TC_P
    q, k, v, a = (rng.standard_normal((64, 64)) for _ in range(4))
    dp, d0 = 128, 64
    s = rng.standard_normal((dp, 64))  # the state [d][m]; the kernel keeps S^T [m][d], pitch Dp + 8
    st = emulate.store(s.T, dp + 8)
    np.testing.assert_allclose(emulate.block_product(emulate.store(q, p), p, emulate.store(k, p), p, 64), q @ k.T)
    np.testing.assert_allclose(emulate.block_product(emulate.store(q, p), p, st[d0:], dp + 8, 64),
                               q @ s[d0:d0 + 64])
    np.testing.assert_allclose(emulate.block_product(emulate.store(a, p), p, emulate.store(v.T, p), p, 64), a @ v)
    np.testing.assert_allclose(emulate.block_product(emulate.store(k.T, p), p, emulate.store(v.T, p), p, 64),
                               k.T @ v)


def test_emulated_ldmatrix_fragments_give_the_staged_kernels_products():
    """causal_dot_tc_staged.cu's transposed operands: V and K kept [token][x], the B fragments of
    A V and K^T V and the A fragment of K^T taken by ldmatrix.trans at the kernel's addresses."""
    rng = np.random.default_rng(4)
    p = emulate.TC_P
    a, k, v = (rng.standard_normal((64, 64)) for _ in range(3))
    for name, x, want in (("A V", emulate.store(a, p), a @ v), ("K^T V", emulate.store(k, p), k.T @ v)):
        got = np.full((64, 64), np.nan)
        for warp in range(8):
            r0, c0 = (warp % 4) * 16, (warp // 4) * 32
            acc = np.zeros((32, 4, 4))
            for k0 in range(0, 64, 16):
                frag = emulate.frag_a_rows(x, p, r0, k0) if name == "A V" else emulate.frag_a_cols(x, r0, k0)
                emulate.mma_bt(acc, frag, emulate.frag_b_rows(emulate.store(v, p), c0, k0))
            for lane, nt, e, row, col in emulate._lane_cells(r0, c0):
                got[row, col] = acc[lane, nt, e]
        np.testing.assert_allclose(got, want, err_msg=name)


@pytest.mark.parametrize("rev", [False, True])
@pytest.mark.parametrize("n, d, m, m0", [(150, 40, 80, 64), (150, 64, 64, 0), (100, 8, 16, 0)])
def test_emulated_staged_kernel_matches_reference(rev, n, d, m, m0):
    """One block of cdp_chunks_tc_staged (two stages, S in the warps' accumulators, zero-filled
    16-byte pieces, paired output stores) for the group of chunks 1.. after chunk 0's state: its
    rows and value tile are the causal product's, and it writes nothing else."""
    rng = np.random.default_rng(n + d + m + rev)
    q, k, v = rng.standard_normal((n, d)), rng.standard_normal((n, d)), rng.standard_normal((n, m))
    f = (lambda x: x[::-1]) if rev else (lambda x: x)
    qt, kt, vt = f(q), f(k), f(v)  # in the kernel's time order
    state = kt[:64].T @ vt[:64]  # the state before chunk 1
    chunks = list(range(1, -(-n // 64)))
    out = emulate.staged_chunks(q, k, v, state, chunks, rev=rev, m0=m0)
    ref = f(np.tril(qt @ kt.T) @ vt)
    cols = slice(m0, min(m, m0 + 64))
    rows = f(np.arange(n) >= 64)
    np.testing.assert_allclose(out[rows, cols], ref[rows, cols], atol=1e-9)
    written = np.zeros((n, m), bool)
    written[np.ix_(rows, np.arange(m)[cols])] = True
    assert np.isnan(out[~written]).all()


@pytest.mark.parametrize("rev", [False, True])
@pytest.mark.parametrize("n, d, m, m0, chunks", [(300, 40, 80, 64, [1, 2, 3]), (150, 64, 64, 0, [0, 1]),
                                                 (100, 8, 16, 0, [1])])
def test_emulated_staged_group_states_match_reference(rev, n, d, m, m0, chunks):
    """One block of cdp_group_states_tc_staged: its group's sum_j k_j v_j^T over its chunks (the
    last partial), for its value tile, and nothing else."""
    rng = np.random.default_rng(n + d + m + rev)
    k, v = rng.standard_normal((n, d)), rng.standard_normal((n, m))
    f = (lambda x: x[::-1]) if rev else (lambda x: x)
    span = slice(chunks[0] * 64, min(n, (chunks[-1] + 1) * 64))
    ref = f(k)[span].T @ f(v)[span]
    out = emulate.staged_group_states(k, v, chunks, rev=rev, m0=m0)
    cols = slice(m0, min(m, m0 + 64))
    np.testing.assert_allclose(out[:, cols], ref[:, cols], atol=1e-9)
    assert np.isnan(np.delete(out, np.arange(m)[cols], axis=1)).all()


def test_ops_trace_with_fake_cuda_tensors():
    """What torch.compile sees of the custom ops: shapes and dtypes of outputs and of the
    backward ops' gradients, on fake CUDA tensors (no GPU needed; the autograd engine itself
    needs a device, so the backward ops are called directly)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k = (torch.empty(2, 3, 37, 5, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.empty(2, 3, 37, 7, device="cuda", dtype=torch.bfloat16)
        out = product_cuda.causal_dot_product(q, k, v)
        assert out.shape == (2, 3, 37, 7) and out.dtype == torch.bfloat16
        grads = torch.ops.repro.causal_dot_product_backward(q, k, v, out)
        assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (q, k, v)]
        y, den = torch.ops.repro.causal_linear_attention(q, k, v, 1e-6)
        assert y.shape == out.shape and y.dtype == torch.bfloat16
        assert den.shape == (2, 3, 37) and den.dtype == torch.float32
        grads = torch.ops.repro.causal_linear_attention_backward(q, k, v, y, den, y, None, 1e-6)
        assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (q, k, v)]
        S, Z = torch.empty(2, 3, 5, 7, device="cuda"), torch.empty(2, 3, 5, device="cuda")
        step = step_cuda.linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], S, Z, 1e-6)
        assert step.shape == (2, 3, 7) and step.dtype == torch.bfloat16


def test_bench_fla_successor_peers_call_fla_as_documented(monkeypatch):
    """Without a GPU here: fla's chunk kernels for the successors are called with the inputs in
    its (B, N, H, D) layout, scale 1, the decays or betas as its fourth argument (chunk_retention:
    none, its decays are built in), and fla's delta rule is not asked for fp32, which it refuses."""
    import types

    from repro.reproduction import peers
    calls = {}
    for name, (module, fn_name, _) in peers.FLA_SUCCESSORS.items():
        fake = types.ModuleType(module)
        setattr(fake, fn_name, lambda *a, name=name, **kw: (calls.__setitem__(name, (a, kw)) or (a[2] * 2, None)))
        monkeypatch.setitem(sys.modules, module, fake)
    monkeypatch.setattr(peers, "_not_cuda", lambda device, what: None)
    q = torch.randn(1, 5, 2, 3)
    x = torch.randn(1, 5, 2)
    for name in peers.FLA_SUCCESSORS:
        peer = peers.fla_successor(name, "cuda")
        assert peer.fn is not None and peer.layout == "bnhd"
        torch.testing.assert_close(peer.fn(q, q, q, x), q * 2)
        args, kw = calls[name]
        assert kw == {"scale": 1.0} and len(args) == (3 if name == "fla_retention" else 4)
    assert torch.float32 not in peers.fla_successor("fla_delta", "cuda").dtypes
