"""CPU speed of the causal linear attention core: every row of the CPU-speed targets' table
(each row's `target` and `met`) from one run, each pair timed interleaved (A, B, A, B, ...;
medians of --rounds rounds):

    python -m repro.reproduction.cpu_speed                          # 2 threads, 9 rounds
    python -m repro.reproduction.cpu_speed --threads 1 --rounds 7
    python -m repro.reproduction.cpu_speed --peer-sdist pytorch-fast-transformers-0.4.0.tar.gz
    python -m repro.reproduction.cpu_speed --chunk-sweep             # fwd+bwd per chunk size C, per (D, M)

Rows (B = 1, H = 8, D = M = 64, fp32 unless said):
  kernel_vs_peer   causal_dot_product forward + backward, ours against fast-transformers 0.4.0's
                   CPU kernel (an optional peer: the installed package, or its PyPI sdist built
                   here with --peer-sdist; otherwise one 'missing' row saying why), N = 1024, 4096;
                   where the fused CPU kernel runs, the chunked path's PyTorch pieces beside it
                   (ours_torch, REPRO_KERNEL=torch)
  forward          the forward alone at N = 4096, at GFLOP/s of the work the causal product needs
                   (2 N D M multiply-adds per sequence) against this CPU's GEMM rate (a 1024^3
                   fp32 matmul) measured in the same run
  backward_dense   the backward alone (a dense upstream gradient) against the forward
  backward_sum     the backward after out.sum() (an expanded stride-0 gradient) against the dense one
  successors       the successors' ops (gated_causal_dot_product per step and per key dimension,
                   delta_rule_dot_product) against causal_dot_product, fwd + bwd at N = --pass-length,
                   with their targets (repro.reproduction.successors_speed)
  layer            one causal attention layer (d_model 256, 8 heads x 32, projections included),
                   forward + backward on 16,384 tokens (B = 16384 / N), linear against softmax
                   through SDPA, N = 256, 512, 1024, 4096; with them (--layer-attentions) the
                   paper's successors, retention, gla and delta (conf/attention defaults), each
                   also against linear (x_linear)
  generation       batch-1 generation of one image through the compiled linear step (sampling
                   included) against the matvec floor of the same model (its matrix products
                   alone: every weight read once per token), MNIST and CIFAR-10 sizes, one
                   image of each, interleaved, --generation-rounds times
Every row carries the load average when it was measured, the threads, device, versions and git
SHA; rows go to results/cpu_speed/cpu_speed_<threads>t_<time>.{csv,json} (atomic writes), a run of
some rows only (--rows) to cpu_speed_<threads>t_<time>_<row+row>.{csv,json}, which the report's
table of the newest full run per thread count leaves out.
"""
import argparse
import json
import os
import statistics
import sys
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch

from repro.common import timing
from repro.common.results import REPO, atomic_write, provenance, rows_to_csv
from repro.kernels import select_backend
from repro.kernels.causal_product import cpu_native
from repro.kernels.causal_product.chunked import causal_dot_product_chunked, default_chunk_size
from repro.kernels.plumbing.backend import forcing
from repro.reproduction.peers import PEER_DIST
from repro.reproduction.peers import ft_cpu_peer as peer
from repro.reproduction.successors_speed import successor_rows

PEER = "fast_transformers"
ROWS = ["kernel", "pass", "successors", "layer", "generation"]
LAYER_ATTENTIONS = ["linear", "softmax", "retention", "gla", "delta"]


def _load():
    return list(os.getloadavg())


def _qkv(b, h, n, d, m, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, h, n, x, generator=g) * 0.5).requires_grad_(grad) for x in (d, d, m)]


def _interleaved(args):
    """A timer for timing.time_product: its calls interleaved, --rounds rounds, --settle calls."""
    return lambda calls: timing.interleaved(calls, args.rounds, settle=args.settle)


def gemm_gflops(rounds, settle=0):
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    sec = timing.interleaved({"gemm": lambda: a @ b}, rounds, settle=settle)["gemm"].median
    return 2 * 1024 ** 3 / sec / 1e9


def _row(base, **kw):
    return {**base, **kw, "load_avg_1_5_15": _load()}


def plain_pytorch(fn):
    """fn run with REPRO_KERNEL=torch: the chunked path's PyTorch pieces, without the fused CPU
    kernel (the A/B of that kernel)."""
    def run(*a):
        with forcing("torch"):
            return fn(*a)
    return run


def _backend(q):
    return select_backend(q, q, q)[0]


def kernel_rows(base, args, peer_fn, peer_note):
    """ours (the dispatcher's CPU backend: the fused kernel where it builds), the chunked path's
    PyTorch pieces (ours_torch, where the fused kernel runs: its A/B) and the peer, interleaved."""
    b, h, d = 1, 8, 64
    rows = []
    for n in args.kernel_lengths:
        q, k, v = _qkv(b, h, n, d, d, seed=n)
        g = torch.randn(b, h, n, d)
        backend = _backend(q)
        common = dict(measure="kernel_vs_peer", pass_="fwd_bwd", n=n, batch=b, heads=h, d=d, m=d)
        ops = {"ours": causal_dot_product_chunked}
        if backend != "torch":
            ops["ours_torch"] = plain_pytorch(causal_dot_product_chunked)
        if peer_fn is None:
            rows.append(_row(base, **common, method=PEER, status=peer_note))
        else:
            ops[PEER] = peer_fn
            with torch.no_grad():  # the peer must compute the same thing
                err = (peer_fn(q, k, v) - causal_dot_product_chunked(q, k, v)).abs().max().item()
        t = timing.time_product(ops, lambda *_, x=(q, k, v), g=g: (x, g), ["fwd_bwd"], _interleaved(args))["fwd_bwd"]
        for name in ops:
            extra = {}
            if peer_fn is not None:
                extra = dict(max_abs_diff=err, peer_version=peer_note)
                if name != PEER:
                    ratio = t[PEER][0] / t[name][0]
                    extra["speedup_vs_peer"] = ratio
                    if name == "ours":
                        extra.update(target=">= 2", met=ratio >= 2)
            if name == "ours_torch":
                extra["x_fused"] = t[name][0] / t["ours"][0]
            rows.append(_row(base, **common, method=name, status="ok", ms=1e3 * t[name][0],
                             backend={"ours": backend, "ours_torch": "torch"}.get(name, PEER),
                             times_ms=[1e3 * x for x in t[name][1]], **extra))
    return rows


def pass_rows(base, args, gemm):
    """forward, backward (dense gradient), backward (stride-0 gradient from out.sum()). The
    forward's rate counts only the work the causal product needs, 2 N D M multiply-adds per
    sequence (k_j v_j^T into the state, q_i^T S out of it), against this CPU's GEMM rate."""
    b, h, n, d = 1, 8, args.pass_length, 64
    q, k, v = _qkv(b, h, n, d, d, seed=1)
    g = torch.randn(b, h, n, d)
    out = causal_dot_product_chunked(q, k, v)
    total = out.sum()  # its backward hands the kernel an expanded, stride-0 gradient

    def fwd():
        with torch.no_grad():
            causal_dot_product_chunked(q, k, v)

    t = timing.interleaved({"forward": fwd,
                            "backward_dense": lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True),
                            "backward_sum": lambda: torch.autograd.grad(total, (q, k, v), retain_graph=True)},
                           args.rounds, settle=args.settle)
    backend = _backend(q)
    c = cpu_native.CHUNK if backend == "cpu" else default_chunk_size(d, d, cpu=True)
    f_ms, bd_ms, bs_ms = (1e3 * t[x][0] for x in ("forward", "backward_dense", "backward_sum"))
    common = dict(pass_=None, n=n, batch=b, heads=h, d=d, m=d, chunk=c, method="ours", status="ok", backend=backend)
    needed = 4 * b * h * n * d * d / (f_ms / 1e3) / 1e9
    return [
        _row(base, **{**common, "pass_": "fwd"}, measure="forward", ms=f_ms,
             times_ms=[1e3 * x for x in t["forward"][1]], needed_gflops=needed, gemm_gflops=gemm,
             pct_of_gemm_needed=100 * needed / gemm, target=">= 50% of GEMM (needed work)",
             met=needed >= 0.5 * gemm),
        _row(base, **{**common, "pass_": "bwd"}, measure="backward_dense", ms=bd_ms,
             times_ms=[1e3 * x for x in t["backward_dense"][1]], x_forward=bd_ms / f_ms, target="<= 2.5x forward",
             met=bd_ms / f_ms <= 2.5),
        _row(base, **{**common, "pass_": "bwd"}, measure="backward_sum", ms=bs_ms,
             times_ms=[1e3 * x for x in t["backward_sum"][1]], x_dense=bs_ms / bd_ms, x_forward=bs_ms / f_ms,
             target="same as dense", met=bs_ms / bd_ms <= 1.1),
    ]


def layer_rows(base, args):
    from repro.attention import LinearAttention, SoftmaxAttention
    from repro.attention.delta import DeltaRuleAttention
    from repro.attention.gla import GatedLinearAttention
    from repro.attention.retention import Retention

    torch.manual_seed(0)
    classes = {"linear": LinearAttention, "softmax": SoftmaxAttention, "retention": Retention,
               "gla": GatedLinearAttention, "delta": DeltaRuleAttention}
    layers = {name: classes[name](256, 8) for name in dict.fromkeys(["linear", "softmax", *args.layer_attentions])}
    rows = []
    for n in args.layer_lengths:
        b = max(1, args.layer_tokens // n)
        x = torch.randn(b, n, 256, requires_grad=True)
        g = torch.randn(b, n, 256)
        fns = {name: (lambda layer=layer, x=x, g=g:
                      torch.autograd.grad(layer(x, causal=True), (x, *layer.parameters()), g))
               for name, layer in layers.items()}
        t = timing.interleaved(fns, args.rounds, settle=args.settle)
        ratio = t["softmax"][0] / t["linear"][0]
        for name in layers:
            rows.append(_row(base, measure="layer", pass_="fwd_bwd", method=name, n=n, batch=b, heads=8, d=32, m=32,
                             status="ok", ms=1e3 * t[name][0], times_ms=[1e3 * x for x in t[name][1]],
                             **({"speedup_vs_softmax": ratio, "target": "> 1", "met": ratio > 1}
                                if name == "linear" else {}),
                             **({"speedup_vs_softmax": t["softmax"][0] / t[name][0],
                                 "x_linear": t[name][0] / t["linear"][0]}
                                if name not in ("linear", "softmax") else {})))
    return rows


def generation_rows(base, args):
    """Seconds per image at batch 1: the compiled linear step (repro.tasks.throughput's
    linear-compiled method) against the same model's matvec floor, each round one whole image
    of each, in turn."""
    from functools import partial

    import numpy as np
    import torch._dynamo

    from repro.attention import LinearAttention
    from repro.models import logistic_mixture as dmol
    from repro.models.generate import generate
    from repro.models.pixels import IMAGE_SHAPES, PixelTransformer
    from repro.tasks.throughput import LAYERS, compile_generation, time_floor

    cpu, rows = torch.device("cpu"), []
    for size in args.generation_sizes:
        torch.manual_seed(0)
        model = PixelTransformer(partial(LinearAttention), n_layers=LAYERS[size], d_model=256, n_heads=8,
                                 d_ff=1024, dropout=0.0).eval()
        length = int(np.prod(IMAGE_SHAPES[size]))
        common = dict(measure="generation", pass_="fwd", n=length, batch=1, heads=8, d=32, m=32, size=size,
                      n_layers=LAYERS[size])
        try:
            compile_s = compile_generation(model, args.generation_backend, length, 1, cpu)
        except torch._dynamo.exc.BackendCompilerFailed as err:  # e.g. inductor without a C++ compiler
            rows.append(_row(base, **common, method="linear-compiled",
                             status=f"missing: compile={args.generation_backend} failed ({err})".splitlines()[0]))
            continue
        first = torch.zeros(1, 1, dtype=torch.long)
        times = {"linear-compiled": [], "matvec-floor": []}
        for _ in range(args.generation_rounds):
            with torch.compiler.set_stance("fail_on_recompile"):
                image = partial(generate, model, first, length, dmol.sample)
                times["linear-compiled"].append(timing.time_calls(image).seconds)
            times["matvec-floor"].append(time_floor(model, length, 1, cpu, steps=length - 1)[0])
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = med["linear-compiled"] / med["matvec-floor"]
        for name, ts in times.items():
            rows.append(_row(base, **common, method=name, status="ok", ms=1e3 * med[name],
                             times_ms=[1e3 * x for x in ts], us_per_token=1e6 * med[name] / (length - 1),
                             **({"compile": args.generation_backend, "compile_s": compile_s, "x_floor": ratio,
                                 "target": "<= 1.4x floor", "met": ratio <= 1.4} if name == "linear-compiled" else {})))
    return rows


def chunk_sweep(args):
    """fwd + bwd of the chunked kernel per chunk size, interleaved, for each (D, M): the data
    behind default_chunk_size's table."""
    rows = []
    for d, m in args.sweep_dims:
        q, k, v = _qkv(1, 8, args.pass_length, d, m, seed=d * 1000 + m)
        g = torch.randn(1, 8, args.pass_length, m)
        ops = {c: partial(causal_dot_product_chunked, chunk_size=c) for c in args.sweep_chunks}
        t = timing.time_product(ops, lambda *_, x=(q, k, v), g=g: (x, g), ["fwd_bwd"], _interleaved(args))["fwd_bwd"]
        best = min(t, key=lambda c: t[c][0])
        print(f"D={d:3d} M={m:3d}  " + "  ".join(f"C={c}: {1e3 * t[c][0]:7.1f} ms" for c in t)
              + f"  best C={best} (default {default_chunk_size(d, m, cpu=True)})  load {_load()}")
        rows += [{"measure": "chunk_sweep", "d": d, "m": m, "n": args.pass_length, "chunk": c,
                  "ms": 1e3 * t[c][0], "best": c == best, "load_avg_1_5_15": _load()} for c in t]
    return rows


def _print(r):
    what = f"{r['measure']:15s} {r['method']:17s} N={r['n']:5d}"
    if r.get("status") != "ok":
        print(f"{what}  {r['status']}")
        return
    keys = ("speedup_vs_peer", "speedup_vs_softmax", "x_linear", "x_causal", "x_causal_torch", "x_forward", "x_dense",
            "x_floor", "x_fused", "us_per_token", "needed_gflops", "pct_of_gemm_needed", "gemm_gflops", "target", "met")
    extra = {k: r[k] for k in keys if k in r}
    extra = "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
    print(f"{what}  {r['ms']:9.2f} ms  {extra}  load={r['load_avg_1_5_15'][0]:.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m repro.reproduction.cpu_speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2, the targets' setting)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--kernel-lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--pass-length", type=int, default=4096)
    ap.add_argument("--layer-lengths", type=int, nargs="+", default=[256, 512, 1024, 4096])
    ap.add_argument("--layer-tokens", type=int, default=16384)
    ap.add_argument("--layer-attentions", nargs="+", default=LAYER_ATTENTIONS, choices=LAYER_ATTENTIONS,
                    help="the layers timed in the layer rows (linear and softmax always)")
    ap.add_argument("--settle", type=int, default=None,
                    help="untimed calls of a method right before each timed one (default: 1 at T > 1 threads, else 0)")
    ap.add_argument("--rows", nargs="+", default=ROWS, choices=ROWS, help="which rows to measure (default: all)")
    ap.add_argument("--generation-sizes", nargs="+", default=["mnist", "cifar"], choices=["mnist", "cifar"],
                    help="image sizes for the generation rows")
    ap.add_argument("--generation-rounds", type=int, default=5, help="images of each size, in turn with the floor")
    ap.add_argument("--generation-backend", default="inductor", help="torch.compile backend of the generation step")
    ap.add_argument("--peer-sdist", default=None, help=f"the PyPI sdist of {PEER_DIST} 0.4.0, when it is not installed")
    ap.add_argument("--chunk-sweep", action="store_true", help="only time fwd+bwd per chunk size and (D, M)")
    ap.add_argument("--sweep-dims", type=lambda s: tuple(int(x) for x in s.split(",")), nargs="+",
                    default=[(32, 32), (32, 33), (64, 64), (64, 65), (128, 128)], help="D,M pairs")
    ap.add_argument("--sweep-chunks", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--out-dir", default=str(REPO / "results" / "cpu_speed"))
    args = ap.parse_args(argv)
    for name in ("threads", "rounds", "pass_length", "layer_tokens", "generation_rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    import torch._dynamo
    if ("generation" in args.rows
            and args.generation_backend not in (valid := torch._dynamo.list_backends(exclude_tags=()))):
        raise SystemExit(f"--generation-backend={args.generation_backend!r}; valid: {', '.join(sorted(valid))}")
    if args.settle is not None and args.settle < 0:
        raise SystemExit(f"--settle={args.settle}: must be >= 0")
    args.settle = (1 if args.threads > 1 else 0) if args.settle is None else args.settle
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        _run(args, argv)
    finally:  # main() called in-process (tests) leaves torch's thread count as it found it
        torch.set_num_threads(threads_before)


def _run(args, argv):
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    out_dir = Path(args.out_dir)
    base = {**provenance(torch.device("cpu")), "threads": args.threads, "dtype": "float32", "rounds": args.rounds,
            "settle": args.settle}
    print(f"{base['device']}, torch {base['versions']['torch']}, {args.threads} threads, load {_load()}")
    if args.chunk_sweep:
        rows = [{**base, **r} for r in chunk_sweep(args)]
        name = f"chunk_sweep_{args.threads}t_{stamp}"
    else:
        peer_fn, note = peer(args.peer_sdist)
        base["versions"] = {**base["versions"], PEER_DIST: note if peer_fn else None}
        gemm = gemm_gflops(args.rounds, args.settle)
        print(f"GEMM (1024^3 fp32): {gemm:.0f} GFLOP/s")
        rows, fused = [], _backend(torch.empty(1, 1, 1, 1)) != "torch"
        parts = {"kernel": lambda: kernel_rows(base, args, peer_fn, note), "pass": lambda: pass_rows(base, args, gemm),
                 "successors": lambda: [_row(base, **r) for r in successor_rows(args, torch_pieces=fused)],
                 "layer": lambda: layer_rows(base, args), "generation": lambda: generation_rows(base, args)}
        for part in args.rows:
            for r in parts[part]():
                _print(r)
                rows.append(r)
        # a run of some rows only is named after them: the report's table takes the newest run of every row
        name = f"cpu_speed_{args.threads}t_{stamp}" + ("" if set(args.rows) == set(ROWS) else "_" + "+".join(args.rows))
    rows = [{("pass" if k == "pass_" else k): v for k, v in r.items()} for r in rows]
    atomic_write(out_dir / f"{name}.csv", rows_to_csv(rows))
    atomic_write(out_dir / f"{name}.json", json.dumps({"command": "python -m repro.reproduction.cpu_speed "
                                                       + " ".join(argv if argv is not None else sys.argv[1:]),
                                                       "rows": rows}, indent=1, default=str))
    print(f"wrote {len(rows)} rows to {out_dir / name}.csv and .json")


if __name__ == "__main__":
    main()
