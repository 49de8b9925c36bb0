"""One small launch of every CuPy kernel, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck --error-exitcode 1 python -m repro.reproduction.sanitize

Each launch uses shapes that reach the kernels' edge cases (a partial chunk, a partial value
tile, several groups so the group-state and scan kernels run, a key width past one tile) and
is checked against the float64 reference, so a launch the tool lets through is also right.
"""
import sys

import torch

from repro.kernels.causal_product import cuda
from repro.kernels.causal_product.reference import causal_dot_product_naive
from repro.kernels.plumbing.cupy_launch import CALLS
from repro.kernels.plumbing.switches import switched
from repro.kernels.recurrent.cuda import linear_attention_step


def _check(failures, label, tol, q, k, v, rev, tensor_cores):
    """One launch (2 groups) against the float64 reference, reversed in time when rev: its
    relative error printed, and kept in failures past tol."""
    out, _ = cuda.launch(q, k, v, rev=rev, cpg=2, tensor_cores=tensor_cores)
    f = (lambda x: x.flip(1)) if rev else (lambda x: x)
    ref = f(causal_dot_product_naive(*(f(x).double() for x in (q, k, v))))
    err = ((out.double() - ref).norm() / ref.norm()).item()
    print(f"{label} rev={rev}: relative error {err:.2e}")
    if not err <= tol:
        failures.append((label, rev, err))


def main() -> int:
    if not torch.cuda.is_available():
        print("repro.reproduction.sanitize: no CUDA device", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    bh, n, d, m = 2, 200, 70, 40  # 4 chunks (the last partial), 2 key-dim passes, a partial value tile
    failures = []
    for dtype, tensor_cores in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True),
                                (torch.float16, False)):
        q, k, v = ((torch.randn(bh, n, x, device="cuda", generator=g) * 0.5).to(dtype) for x in (d, d, m))
        for rev in (False, True):
            _check(failures, f"cdp {dtype} tensor_cores={tensor_cores}", 1e-5 if dtype == torch.float32 else 1e-2,
                   q, k, v, rev, tensor_cores)
        qp, kp = (torch.nn.functional.elu(q.float()).add(1).to(dtype),
                  torch.nn.functional.elu(k.float()).add(1).to(dtype))
        out, den = cuda.launch(qp, kp, v, norm=True, eps=1e-6, cpg=2, tensor_cores=tensor_cores)
        print(f"cdp norm {dtype} tensor_cores={tensor_cores}: finite {bool(torch.isfinite(out).all())}")
    # the tensor-core variants (bare_smem: only the shared memory the bare product uses;
    # vec_loads: 16-byte loads; staged: the pipelined kernel; D = 64 and M = 40 so they all
    # apply): the tools see any access out of bounds, and racecheck the staged kernel's barriers
    q64, k64, v64 = ((torch.randn(bh, n, x, device="cuda", generator=g) * 0.5).bfloat16() for x in (64, 64, m))
    # staged again at D = 32 (zero-filled key columns) and M = 72 (a second, partial value tile)
    q32, k32, v72 = ((torch.randn(bh, n, x, device="cuda", generator=g) * 0.5).bfloat16() for x in (32, 32, 72))
    for bare_vec, staged, inputs in ((True, False, (q64, k64, v64)), (False, True, (q64, k64, v64)),
                                     (False, True, (q32, k32, v72))):
        with switched(bare_smem=bare_vec, vec_loads=bare_vec, staged=staged):
            launched = CALLS["staged"]
            for rev in (False, True):
                _check(failures, f"cdp bf16 tensor_cores=True BARE_SMEM=VEC_LOADS={bare_vec} STAGED={staged} "
                       f"D={inputs[0].shape[-1]} M={inputs[2].shape[-1]}", 1e-2, *inputs, rev, True)
            if staged and CALLS["staged"] - launched != 2:  # the tools must see the staged kernels
                failures.append(("STAGED did not launch the staged kernels", None, None))
    S, Z = torch.zeros(bh, d, m, device="cuda"), torch.zeros(bh, d, device="cuda")
    step = linear_attention_step(qp[:, 0].float(), kp[:, 0].float(), v[:, 0].float(), S, Z, 1e-6)
    torch.cuda.synchronize()
    print(f"linear_attention_step: finite {bool(torch.isfinite(step).all())}")
    if failures:
        print(f"FAILED: {failures}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
