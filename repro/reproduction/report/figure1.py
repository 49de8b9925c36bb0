"""Figure 1: time and memory of one attention layer against sequence length (task=benchmark's
benchmark.csv and summary.json of the runs results/claims.yaml names under report.figure1, in its
order). Each run is shown with what sets its numbers apart (code
version, tokens per point, repeats, memory method, and beside each time the kernel it ran on,
where the run recorded it), and a point measured by several runs is set out side by side, so that
two values for one point never stand unexplained."""
import pandas as pd

from repro.common import paper
from repro.reproduction.report.format import code, command, hardware, hw_class, md_table, num
from repro.reproduction.report.schema import Table, read_json

TABLES = [Table("benchmark.csv",
                {"attention": str, "n": float, "time_per_sample_ms": float, "mem_per_sample_mb": float, "status": str},
                {"device": str, "batch": float, "repeats": float, "mem_method": str,
                 "git_sha": str, "time": str, "saved_per_sample_mb": float, "mem_per_sample_min_mb": float,
                 "mem_per_sample_max_mb": float, "kernel_backend": str, "kernel_backend_why": str,
                 "kernel_fallback": str})]


def _mem(r) -> float | str:
    """Peak memory per sample, with its spread over the measured passes where recorded."""
    lo, hi = r.get("mem_per_sample_min_mb"), r.get("mem_per_sample_max_mb")
    if lo is None or hi is None or pd.isna(lo) or pd.isna(hi):
        return r.mem_per_sample_mb
    return f"{num(float(r.mem_per_sample_mb))} ({num(float(lo))}-{num(float(hi))})"


def _recorded(df) -> bool:
    """Whether the run's rows name their kernel (runs from before the record do not)."""
    return "kernel_backend" in df and df.kernel_backend.notna().any()


def kernel(r) -> str:
    """The kernel a row ran on: its name, and why where it fell back to the PyTorch path."""
    name = r.get("kernel_backend")
    if name is None or pd.isna(name):
        return "not recorded"
    why = r.get("kernel_backend_why")
    fell_back = str(r.get("kernel_fallback")).lower() == "true"
    return f"{name} (fell back: {why})" if fell_back and isinstance(why, str) else str(name)


def _causal(df) -> str:
    return "non-causal" if "causal" in df and not df.causal.astype(str).str.lower().eq("true").all() else "causal"


def _values(df, col) -> str:
    vals = [str(v) for v in dict.fromkeys(df[col].dropna())] if col in df else []
    return ", ".join(vals) or "not recorded"


def run_line(df) -> str:
    """What sets this run's numbers apart from another's of the same points."""
    tokens = (df.batch * df.n).dropna().astype(int).unique() if "batch" in df else []
    repeats = df.repeats.dropna().astype(int).unique() if "repeats" in df else []
    dates = _values(df.assign(day=df.time.astype(str).str[:10]), "day") if "time" in df else "not recorded"
    return (f"Run: git {', '.join(s[:7] for s in _values(df, 'git_sha').split(', '))}; {dates}; "
            f"{'/'.join(f'{t:,}' for t in tokens) or 'not recorded'} tokens per point (batch x N); "
            f"{'/'.join(map(str, repeats)) or 'not recorded'} timed repeats; memory: {_values(df, 'mem_method')}")


def _point_rows(df):
    """Rows of the paper's points for the attentions and lengths this run tried: a point it tried
    and lost shows why (oom, timeout); a length it never tried is not shown. With the bytes kept
    for backward where the run counted them."""
    ok = df[df.status == "ok"]
    saved = "saved_per_sample_mb" in df and df.saved_per_sample_mb.notna().any()
    kernels = _recorded(df)
    rows = []
    for att, points in paper.FIGURE1.items():
        for ours in paper.FIGURE1_OURS.get(att, [att]):
            tried = df[df.attention == ours]
            for n, (t, m) in points.items():
                here = tried[tried.n == n]
                if not len(here):
                    continue
                mine = ok[(ok.attention == ours) & (ok.n == n)]
                lost = str(here.status.iloc[0])
                rows.append([att, ours, n, t, mine.time_per_sample_ms.iloc[0] if len(mine) else lost,
                             *([kernel(mine.iloc[0]) if len(mine) else lost] if kernels else []),
                             m, _mem(mine.iloc[0]) if len(mine) else lost,
                             *([mine.saved_per_sample_mb.iloc[0] if len(mine) else lost] if saved else [])])
    return rows, saved, kernels


def agreement(found, root) -> str | None:
    """The paper's points that several runs (same hardware class and causality) measured: each
    run's value with what differs between the runs."""
    rows, kernels = [], any(_recorded(df) for _, df in found)
    for att, points in paper.FIGURE1.items():
        for ours in paper.FIGURE1_OURS.get(att, [att]):
            for n in points:
                seen = []
                for folder, df in found:
                    ok = df[(df.attention == ours) & (df.n == n) & (df.status == "ok")]
                    if len(ok):
                        r = ok.iloc[0]
                        seen.append((hw_class(str(r.get("device", ""))), _causal(df), folder, r))
                for key in dict.fromkeys((cls, causal) for cls, causal, _, _ in seen):
                    same = [s for s in seen if (s[0], s[1]) == key]
                    if len(same) > 1:
                        rows += [[ours, n, f"{key[0]}, {key[1]}", f"`{folder.relative_to(root)}`",
                                  r.time_per_sample_ms, r.mem_per_sample_mb,
                                  str(r.get("git_sha", ""))[:7] or "—",
                                  f"{int(r.batch * n):,}" if pd.notna(r.get("batch")) else "—",
                                  str(r.get("device", "")), str(r.get("mem_method", "")) or "—",
                                  *([kernel(r)] if kernels else [])]
                                 for _, _, folder, r in same]
    if not rows:
        return None
    return ("### The same point in several runs\n\nTwo runs of one point on the same kind of hardware differ by "
            "what they ran with: the code version, tokens per point (a larger batch works on more memory at "
            "once), the machine's load (these CPUs were shared with other jobs; `time` in each row), and how "
            "memory was measured. Each run's section below names these; compare slopes within one run, not "
            "values across runs.\n\n"
            + md_table(["attention", "N", "hardware", "run", "ms/sample", "MB/sample", "git", "tokens per point",
                        "device", "memory method", *(["kernel"] if kernels else [])], rows))


def figure1(ctx) -> str:
    root, rel = ctx.root, ctx.rel
    out = ["## Figure 1: time and memory against sequence length",
           f"Paper: forward + backward of one attention layer per sample on a {paper.FIGURE1_HARDWARE} "
           "(values read off the log-log plot, ±15%). Ours: the same measurement (repro.tasks.benchmark). "
           "A run's table shows the paper's points at the lengths that run tried; a point it tried and lost says "
           "why (oom, timeout). Peak memory is the allocator's or the process's high-water mark (noisy on a CPU); "
           "newer runs also count exactly what the layer keeps for backward (saved tensors' "
           "storages, parameters included)."]
    found = ctx.named("figure1", "benchmark.csv")
    if not found:
        return "\n\n".join(out + ["not yet run"])
    note = agreement(found, root)
    if note:
        out.append(note)
    for folder, df in found:
        out.append(f"### {folder.relative_to(root)} ({_causal(df)})\n\nHardware: {hardware(df)}  \n"
                   f"{run_line(df)}  \nCommand: {code(command(folder, root))}")
        rows, saved, kernels = _point_rows(df)
        if rows:
            out.append(md_table(["paper's attention", "ours", "N", "paper ms/sample", "our ms/sample",
                                 *(["our kernel"] if kernels else []), "paper MB/sample",
                                 "our MB/sample (peak; min-max over passes)",
                                 *(["our MB/sample kept for backward"] if saved else [])], rows))
        else:
            lengths = sorted({int(n) for n in df.n.dropna()})
            out.append(f"This run's lengths ({', '.join(num(float(n)) for n in lengths)}) hold none of the paper's "
                       "read-off points: its slopes and limits are below.")
        summary = read_json(folder / "summary.json", root) if (folder / "summary.json").is_file() else {}
        slopes, kept = [], any(s.get("saved_slope_all") is not None for s in summary.get("attentions", {}).values())
        for att, s in summary.get("attentions", {}).items():
            theirs = paper.FIGURE1_PAPER_NAME.get(att, att)
            slopes.append([att, paper.FIGURE1_SLOPES.get(theirs), s.get("time_slope_all"), s.get("mem_slope_all"),
                           *([s.get("saved_slope_all")] if kept else []), paper.FIGURE1_LARGEST_N.get(theirs),
                           s.get("largest_n"), s.get("first_failure", "")])
        if slopes:
            out.append("Slopes of log time and log memory against log N (paper: 1 for linear, 2 for softmax):\n\n" +
                       md_table(["attention", "paper slope", "our time slope", "our memory slope",
                                 *(["our kept-for-backward slope"] if kept else []), "paper largest N",
                                 "our largest N", "first failure"], slopes))
        if (folder / "benchmark.png").is_file():
            out.append(f"![Figure 1, {folder.name}]({rel(folder / 'benchmark.png')})")
    return "\n\n".join(out)


SECTIONS = [(10, "figure1", figure1)]
