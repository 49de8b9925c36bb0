"""GPU benchmark of the causal dot product against its peers, all in one run:

    python -m repro.kernels.bench                       # B=H=8, D=M=64, N=1k..64k, fp32 and bf16
    python -m repro.kernels.bench --lengths 1024 16384 --dtypes bf16 --repeats 20

Methods (a peer that is not installed gets one 'missing' row, never an import error):
  cupy          this suite's CUDA kernels (repro.kernels.cupy_backend), whatever its GPU_VERIFIED
                switch says (bf16 on tensor cores, fp32 on the FMA kernel)
  cupy_norm     the same with the normaliser fused (the whole causal linear attention)
  torch         the chunked PyTorch path (repro.kernels.chunked)
  fast_transformers   the authors' CUDA kernel (PyPI pytorch-fast-transformers)
  fla_chunk     flash-linear-attention's chunk_linear_attn (Triton), unnormalised, scale 1
  sdpa          causal softmax attention, torch.nn.functional.scaled_dot_product_attention
for the forward pass ('fwd') and forward + backward ('fwd_bwd'). Times are CUDA-event medians.

The bandwidth floor: the bytes a pass must move at least (fwd: read q, k, v and write out;
fwd_bwd: that plus read q, k, v, g and write the three gradients) over the device-to-device
copy bandwidth measured in this run; pct_of_floor = 100 * floor_ms / ms. Each row also carries
`vs_<peer>` = peer_ms / ms at the same point (above 1: faster than that peer). Rows go to
results/kernels/bench_<device>_<time>.jsonl with the device, versions and git SHA.
"""
import argparse
import importlib.metadata
import inspect
import statistics
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..results import REPO, provenance, write_jsonl
from . import causal_dot_product_chunked, cupy_backend

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PEERS = ("fast_transformers", "fla_chunk", "sdpa")


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _methods():
    """name -> (fn(q, k, v) on (B, H, N, D) tensors, or None, and why not)."""
    out = {
        "cupy": (cupy_backend.causal_dot_product, None),
        "cupy_norm": (lambda q, k, v: cupy_backend.causal_linear_attention(q, k, v, 1e-6), None),
        "torch": (causal_dot_product_chunked, None),
        "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), None),
    }
    try:
        from fast_transformers.causal_product import causal_dot_product as ft
        out["fast_transformers"] = (ft, None)
    except Exception as err:  # ImportError, or a build that fails to load its extension
        out["fast_transformers"] = (None, f"missing: pytorch-fast-transformers not importable ({err})")
    try:
        from fla.ops.linear_attn import chunk_linear_attn
        params = inspect.signature(chunk_linear_attn).parameters
        extra = {"head_first": False} if "head_first" in params else {}

        def fla(q, k, v):  # fla takes (B, N, H, D); the transposes are part of its cost here
            o, _ = chunk_linear_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     scale=1.0, normalize=False, **extra)
            return o.transpose(1, 2)
        out["fla_chunk"] = (fla, None)
    except Exception as err:
        out["fla_chunk"] = (None, f"missing: flash-linear-attention not importable ({err})")
    return out


def _time(fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(device, nbytes=1 << 30, repeats=20):
    """Device-to-device copy bandwidth in bytes/s (each copy reads and writes nbytes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), 3, repeats)
    del src, dst
    return 2 * nbytes / (ms / 1e3)


def _measure(fn, b, h, n, d, m, dtype, backward, warmup, repeats):
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(b, h, n, x, device="cuda", generator=g, dtype=dtype) * 0.5 for x in (d, d, m))
    if backward:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        grad = torch.randn(b, h, n, m, device="cuda", dtype=dtype)

        def run():
            torch.autograd.grad(fn(q, k, v), (q, k, v), grad)
    else:
        def run():
            with torch.no_grad():
                fn(q, k, v)
    return _time(run, warmup, repeats)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m repro.kernels.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2 ** i for i in range(10, 17)])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64, help="D = M")
    ap.add_argument("--methods", nargs="+", default=["cupy", "cupy_norm", "torch", *PEERS])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None, help="JSONL path (default results/kernels/bench_<device>_<time>.jsonl)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("repro.kernels.bench: no CUDA device; this benchmark times GPU kernels only")
    methods = _methods()
    unknown = sorted(set(args.methods) - set(methods))
    if unknown:
        raise ConfigError(f"--methods: unknown {unknown}; valid: {', '.join(methods)}")

    device = torch.device("cuda", torch.cuda.current_device())
    base = provenance(device)
    base["versions"] = {**base["versions"], "cupy": _version("cupy-cuda13x") or _version("cupy-cuda12x"),
                        "pytorch-fast-transformers": _version("pytorch-fast-transformers"),
                        "flash-linear-attention": _version("flash-linear-attention"),
                        "fla-core": _version("fla-core"), "triton": _version("triton")}
    bandwidth = copy_bandwidth(device)
    print(f"device-to-device copy bandwidth: {bandwidth / 1e9:.0f} GB/s on {base['device']}")
    b, h, d = args.batch, args.heads, args.dim
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for n in args.lengths:
            elem = torch.finfo(dtype).bits // 8
            tensor_bytes = b * h * n * d * elem
            for pass_name, backward, n_tensors in (("fwd", False, 4), ("fwd_bwd", True, 11)):
                floor_ms = n_tensors * tensor_bytes / bandwidth * 1e3
                for name in args.methods:
                    fn, why = methods[name]
                    row = {**base, "task": "kernels.bench", "method": name, "pass": pass_name,
                           "dtype": dtype_name, "batch": b, "heads": h, "n": n, "d": d, "m": d, "seed": n,
                           "copy_bandwidth_gbs": bandwidth / 1e9, "floor_ms": floor_ms}
                    if fn is None:
                        rows.append({**row, "status": why})
                        continue
                    try:
                        ms = _measure(fn, b, h, n, d, d, dtype, backward, args.warmup, args.repeats)
                        row.update(status="ok", ms=ms, pct_of_floor=100 * floor_ms / ms)
                    except torch.OutOfMemoryError:
                        row["status"] = "oom"
                    except Exception as err:  # a peer that cannot take this dtype or size
                        row["status"] = f"error: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                    torch.cuda.empty_cache()
                    rows.append(row)
                    print(f"{dtype_name} N={n:6d} {pass_name:7s} {name:18s} "
                          + (f"{row['ms']:9.3f} ms  {row['pct_of_floor']:5.1f}% of floor" if row["status"] == "ok"
                             else row["status"]))
    # ratios to each peer at the same point
    ok = {(r["method"], r["dtype"], r["n"], r["pass"]): r["ms"] for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] == "ok":
            for peer in ("torch", *PEERS):
                other = ok.get((peer, r["dtype"], r["n"], r["pass"]))
                if other is not None and peer != r["method"]:
                    r[f"vs_{peer}"] = other / r["ms"]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    gpu = base["device"].replace(" ", "_").replace("/", "_")
    path = args.out or REPO / "results" / "kernels" / f"bench_{gpu}_{stamp}.jsonl"
    write_jsonl(path, rows)
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
