"""The CPU speed of the core: the cpu_speed_<T>t_<time>.csv runs results/claims.yaml names
(report.cpu_speed: one per CPU and thread count; repro.reproduction.cpu_speed)."""
import json
import re
from pathlib import Path

import pandas as pd

from repro.reproduction.manifest import ManifestError
from repro.reproduction.report.format import code, md_table
from repro.reproduction.report.schema import Table, read_json

TABLES = [Table("cpu_speed_*.csv", {"measure": str, "method": str, "threads": float, "device": str, "dtype": str},
                {"n": float, "ms": float, "status": str})]


CPU_SPEED = re.compile(r"cpu_speed_(\d+)t_(\d{8}T\d{6})\.csv")  # a run of every row (one of some rows: _<rows>)


def named_runs(ctx) -> list[tuple[Path, pd.DataFrame]]:
    """(path, table) of the cpu_speed runs the manifest names, in its order; a run of some rows only
    (`--rows`, named after them) is a ManifestError: its table would lack the other rows."""
    runs = ctx.tables("cpu_speed")
    for i, (path, _) in enumerate(runs):
        if not CPU_SPEED.fullmatch(path.name):
            raise ManifestError(f"report.cpu_speed[{i}]: {path.relative_to(ctx.root)} is not a run of every row "
                                "(cpu_speed_<T>t_<time>.csv): name a full run")
    return runs


def _cpu_speed_rows(df) -> list[list]:
    """One row per measure of the CPU-speed targets: ours, what it is set against, the ratio, the target."""
    ok = df[df.status == "ok"] if "status" in df else df
    rows = []

    def get(measure, method, **where):
        m = ok[(ok.measure == measure) & (ok.method == method)]
        for key, value in where.items():
            m = m[m[key] == value]
        return m.iloc[0] if len(m) else None

    def met(r):
        return "yes" if bool(r.met) else "no"

    def sig(v):  # three significant digits, trailing zeros kept (15.0, 1.00)
        return f"{v:,.0f}" if v >= 100 else f"{v:#.3g}".rstrip(".")

    def ms(v):
        return f"{sig(v)} ms"

    def faster(x):
        return f"{x:.2f}× faster" if x >= 1 else f"{1 / x:.2f}× slower"

    for n in sorted(df[df.measure == "kernel_vs_peer"].n.unique()):
        ours, peer = get("kernel_vs_peer", "ours", n=n), get("kernel_vs_peer", "fast_transformers", n=n)
        if peer is None:
            missing = df[(df.measure == "kernel_vs_peer") & (df.n == n) & (df.method == "fast_transformers")]
            why = missing.status.iloc[0] if len(missing) else "missing"
            rows.append([f"`causal_dot_product` fwd + bwd, N = {n:,}", ms(ours.ms) if ours is not None else "—",
                         f"fast-transformers: {why}", "—", "≥ 2×", "—"])
            continue
        backend = f" ({ours.backend} backend)" if "backend" in ours and isinstance(ours.backend, str) else ""
        rows.append([f"`causal_dot_product` fwd + bwd, N = {n:,}{backend}", ms(ours.ms),
                     f"fast-transformers {ms(peer.ms)}", faster(ours.speedup_vs_peer), "≥ 2×", met(ours)])
        if (plain := get("kernel_vs_peer", "ours_torch", n=n)) is not None:
            rows.append([f"the same, chunked PyTorch pieces (`REPRO_KERNEL=torch`), N = {n:,}", ms(plain.ms),
                         f"fast-transformers {ms(peer.ms)}", faster(plain.speedup_vs_peer), "—", "—"])
    if (f := get("forward", "ours")) is not None:
        if "needed_gflops" in f and f.needed_gflops == f.needed_gflops:  # counted on the needed work (not NaN)
            rows.append([f"forward, N = {f.n:,}", ms(f.ms), f"GEMM {f.gemm_gflops:.0f} GFLOP/s (1024³)",
                         f"{f.needed_gflops:.0f} GFLOP/s of needed work ({f.pct_of_gemm_needed:.0f} % of GEMM)",
                         "≥ 50 % of GEMM", met(f)])
        else:  # runs before 2026-11-27 counted the chunked path's matmuls, full (C, C) blocks included
            rows.append([f"forward, N = {f.n:,}", ms(f.ms), f"GEMM {f.gemm_gflops:.0f} GFLOP/s (1024³)",
                         f"{f.matmul_gflops:.0f} GFLOP/s of matmuls", "keep", "—"])
    if (b := get("backward_dense", "ours")) is not None and f is not None:
        rows.append(["backward, dense gradient", ms(b.ms), f"forward {ms(f.ms)}", f"{b.x_forward:.2f}×",
                     "≤ 2.5×", met(b)])
    if (z := get("backward_sum", "ours")) is not None and b is not None:
        rows.append(["backward after `out.sum()` (stride-0 gradient)", ms(z.ms), f"dense gradient {ms(b.ms)}",
                     f"{z.x_dense:.2f}×", "same (≤ 1.1×)", met(z)])
    for n in sorted(ok[ok.measure == "layer"].n.unique()):
        lin, sm = get("layer", "linear", n=n), get("layer", "softmax", n=n)
        if lin is not None and sm is not None:
            rows.append([f"layer fwd + bwd, 16,384 tokens, N = {n:,}", ms(lin.ms), f"softmax (SDPA) {ms(sm.ms)}",
                         faster(lin.speedup_vs_softmax), "> 1×", met(lin)])
    for n in sorted(ok[ok.measure == "generation"].n.unique()):
        gen, floor = get("generation", "linear-compiled", n=n), get("generation", "matvec-floor", n=n)
        if gen is not None and floor is not None:
            size = {784: "MNIST", 3072: "CIFAR-10"}.get(n, f"{n} values")
            rows.append([f"batch-1 generation, {size}, compiled linear step", f"{sig(gen.ms / 1e3)} s per image",
                         f"matvec floor {sig(floor.ms / 1e3)} s", f"{gen.x_floor:.2f}× the floor", "≤ 1.4×", met(gen)])
    return rows


def cpu_speed(ctx) -> str:
    """The CPU speed of the core: the cpu_speed runs the manifest names."""
    runs, rel = named_runs(ctx), ctx.rel
    if not runs:
        return ""
    out = ["## CPU speed of the core",
           "From `python -m repro.reproduction.cpu_speed` (its targets: docs/kernels.md; each pair timed interleaved, "
           "medians of its "
           "rounds; the load average is the machine's 1-minute load while the run measured). One run per CPU "
           "and thread count, the one `results/claims.yaml` names:"]
    for path, df in runs:
        meta = path.with_suffix(".json")
        command = read_json(meta, ctx.root).get("command") if meta.is_file() else None
        loads = [json.loads(v)[0] for v in df.load_avg_1_5_15.dropna()] if "load_avg_1_5_15" in df else []
        sha = df.git_sha.dropna().iloc[0] if "git_sha" in df and df.git_sha.notna().any() else "?"
        threads = int(df.threads.iloc[0])
        out.append(f"**{threads} thread{'s' if threads > 1 else ''}** ([{path.name}]({rel(path)}); "
                   f"{df.device.iloc[0]}, {df.dtype.iloc[0]}, git {sha}"
                   + (f", load {min(loads):.1f}–{max(loads):.1f}" if loads else "")
                   + (f", {int(df.settle.iloc[0])} untimed call before each timed one"
                      if "settle" in df and df.settle.notna().any() and df.settle.iloc[0] > 0 else "") + ")"
                   + (f": {code(command)}" if command else ""))
        out.append(md_table(["measure", "ours", "against", "ratio", "target", "met"], _cpu_speed_rows(df)))
    return "\n\n".join(out)


SECTIONS = [(90, "cpu_speed", cpu_speed)]
