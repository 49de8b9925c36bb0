"""The kernel benchmark (repro.reproduction.bench's bench.csv): the CUDA kernel's targets and each
run's table; and the CPU kernel task's table (task=kernels' kernels.csv)."""
import pandas as pd

from repro.reproduction.manifest import ManifestError
from repro.reproduction.report.format import code, command, hardware, hw_class, md_table, num
from repro.reproduction.report.schema import Table

TABLES = [Table("bench.csv", {"method": str, "pass": str, "dtype": str, "n": float, "batch": float, "heads": float,
                              "d": float, "status": str, "device": str}, {"ms": float, "pct_of_floor": float}),
          Table("kernels.csv", {"implementation": str, "n": float, "forward_ms": float},
                {"forward_backward_ms": float})]


# The CUDA kernel's targets (docs/kernels.md), at one shape: H100, B = H = 8, D = M = 64, N = 16k. (label, method,
# dtype, pass, peer, bound): with no peer, ms <= bound; with a peer, peer ms / our ms >= bound
# (faster than a peer: > 1, written as bound None).
TARGET_SHAPE = {"batch": 8, "heads": 8, "d": 64, "n": 16384}


TARGET_GPU = "H100"


KERNEL_TARGETS = [
    ("forward <= 0.32 ms, bf16", "cupy", "bf16", "fwd", None, 0.32),
    ("forward + backward <= 1.25 ms, bf16", "cupy", "bf16", "fwd_bwd", None, 1.25),
    (">= 10x the authors' kernel, fp32, forward", "cupy", "fp32", "fwd", "fast_transformers", 10.0),
    (">= 10x the authors' kernel, fp32, forward + backward", "cupy", "fp32", "fwd_bwd", "fast_transformers", 10.0),
    ("faster than fla's chunk kernel, bf16, forward", "cupy", "bf16", "fwd", "fla_chunk", None),
    ("faster than fla's chunk kernel, bf16, forward + backward", "cupy", "bf16", "fwd_bwd", "fla_chunk", None),
]


BENCH_METHODS = ("cupy", "cupy_norm", "torch", "fast_transformers", "fla_chunk", "sdpa")


def _bench(csvs):
    """(folder, rows) of every kernel benchmark table (repro.reproduction.bench's bench.csv)."""
    need = {"method", "pass", "dtype", "n", "batch", "heads", "d", "status", "device"}
    return [(path.parent, df) for path, df in csvs if path.name == "bench.csv" and need <= set(df)]


def _ms_cell(r) -> str:
    """A measured time with its % of the bandwidth floor when the row carries it, else the
    status's first word (missing, oom, skipped, error)."""
    if r is None:
        return "not measured yet"
    if r.status != "ok":
        return str(r.status).split(":")[0]
    pct = r.get("pct_of_floor")
    return f"{num(float(r.ms))} ms" + (f" ({float(pct):.0f}% of floor)" if pd.notna(pct) else "")


def _target_rows(rows):
    """[label, measured, standing] for each of KERNEL_TARGETS from the bench rows of one GPU
    (None: no rows at all)."""
    at = {}
    if rows is not None:
        shape = (rows.batch == TARGET_SHAPE["batch"]) & (rows.heads == TARGET_SHAPE["heads"]) & \
                (rows.d == TARGET_SHAPE["d"]) & (rows.n == TARGET_SHAPE["n"])
        ordered = rows[shape].sort_values("time", kind="stable") if "time" in rows else rows[shape]
        at = {(r.method, r["dtype"], r["pass"]): r for _, r in ordered.iterrows()}  # the latest row of a point
    out = []
    for label, method, dtype, pass_, peer, bound in KERNEL_TARGETS:
        mine, theirs = at.get((method, dtype, pass_)), at.get((peer, dtype, pass_)) if peer else None
        if mine is None or (peer and theirs is None):
            out.append([label, "not measured yet" if mine is None else f"{peer}: not measured yet", "not measured yet"])
            continue
        if mine.status != "ok" or (peer and theirs.status != "ok"):
            why = mine if mine.status != "ok" else theirs
            out.append([label, f"{why.method}: {why.status}", "not measured"])
            continue
        if peer is None:
            out.append([label, _ms_cell(mine), "met" if float(mine.ms) <= bound else "not met"])
        else:
            ratio = float(theirs.ms) / float(mine.ms)  # above 1: ours is faster
            ok = ratio >= bound if bound is not None else ratio > 1
            out.append([label, f"{ratio:.3g}x ({method} {num(float(mine.ms))} ms, {peer} {num(float(theirs.ms))} ms)",
                        "met" if ok else "not met"])
    return out


def kernels(ctx) -> str:
    root, csvs = ctx.root, ctx.tables("kernels")
    lacking = [f for f in ctx.manifest.paths("kernels")
               if not {f / "bench.csv", f / "kernels.csv"} & {path for path, _ in csvs}]
    if lacking:
        raise ManifestError(f"report.kernels: {lacking[0].relative_to(root)} holds no bench.csv or kernels.csv")
    shape = ", ".join(f"{'B' if k == 'batch' else 'H' if k == 'heads' else 'D = M' if k == 'd' else 'N'} = {v:,}"
                      for k, v in TARGET_SHAPE.items())
    out = ["## Kernel benchmark: the causal dot product against its peers",
           f"The targets for this suite's CUDA kernel (method `cupy`; docs/kernels.md), on an {TARGET_GPU} at {shape}; "
           "from `python -m repro.reproduction.bench` (reproduce_gpu step 2), each target on the latest row of "
           "its point. "
           "% of floor: the least bytes the pass must move over the copy bandwidth measured in the same run."]
    bench = _bench(csvs)
    gpu_rows = {}
    for _, df in bench:
        for cls, g in df.groupby(df.device.astype(str).map(hw_class)):
            if cls != "CPU":
                gpu_rows[cls] = pd.concat([gpu_rows[cls], g]) if cls in gpu_rows else g
    header = ["target", "measured", "standing"]
    if not gpu_rows:
        out.append("### Kernel targets (GPU: not measured yet)\n\n" + md_table(header, _target_rows(None)))
    for cls, rows in sorted(gpu_rows.items()):
        note = "" if TARGET_GPU.lower() in cls.lower() else f" (the targets were set for an {TARGET_GPU})"
        out.append(f"### Kernel targets on {cls}{note}\n\n" + md_table(header, _target_rows(rows)))
    for folder, df in bench:
        out.append(_bench_table(folder, df, root))
    for path, df in csvs:  # the CPU kernel task's table (task=kernels: chunked against loop and naive)
        if path.name == "kernels.csv" and {"implementation", "n", "forward_ms"} <= set(df):
            folder = path.parent
            rows = [[r.implementation, int(r.n), r.get("dtype"), r.forward_ms, r.get("forward_backward_ms"),
                     r.get("forward_backward_ms_vs_chunked")] for _, r in df.iterrows()]
            out.append(f"### {folder.relative_to(root)} (the chunked path, task=kernels)\n\n"
                       f"Hardware: {hardware(df)}  \nCommand: {code(command(folder, root))}\n\n"
                       + md_table(["implementation", "N", "dtype", "forward ms", "forward + backward ms",
                                   "forward + backward vs chunked (x slower)"], rows))
    return "\n\n".join(out)


def _bench_table(folder, df, root) -> str:
    """One benchmark run: a row per (dtype, pass, N, shape), a column per method (ms and % of the
    bandwidth floor), and why a method has no number."""
    df = df.sort_values("time", kind="stable") if "time" in df else df
    methods = [m for m in BENCH_METHODS if m in set(df.method)] + sorted(set(df.method) - set(BENCH_METHODS))
    latest = {(r["dtype"], r["pass"], int(r.batch), int(r.heads), int(r.d), int(r.n), r.method): r
              for _, r in df.iterrows()}
    points = sorted({k[:6] for k in latest}, key=lambda k: (k[0], k[1] != "fwd", k[2:]))
    rows = [[*point[:2], "{} x {} x {}".format(*point[2:5]), point[5],
             *[_ms_cell(latest[(*point, m)]) if (*point, m) in latest else None for m in methods]]
            for point in points]
    whys = sorted({f"{m}: {s}" for m, s in zip(df.method, df.status.astype(str)) if s != "ok"})
    return (f"### {folder.relative_to(root)}\n\nHardware: {hardware(df)}  \nCommand: {code(command(folder, root))}\n\n"
            + md_table(["dtype", "pass", "B x H x D", "N", *methods], rows)
            + ("\n\nNo number: " + "; ".join(whys) if whys else ""))


SECTIONS = [(80, "kernels", kernels)]
