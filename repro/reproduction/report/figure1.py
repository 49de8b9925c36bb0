"""Figure 1: time and memory of one attention layer against sequence length (task=benchmark's
benchmark.csv and summary.json)."""

from repro.common import paper
from repro.reproduction.report.format import code, command, hardware, md_table
from repro.reproduction.report.schema import Table, named, read_json

TABLES = [Table("benchmark.csv",
                {"attention": str, "n": float, "time_per_sample_ms": float, "mem_per_sample_mb": float},
                {"status": str, "device": str})]


def figure1(ctx) -> str:
    root, rel, csvs = ctx.root, ctx.rel, ctx.csvs
    out = ["## Figure 1: time and memory against sequence length",
           f"Paper: forward + backward of one attention layer per sample on a {paper.FIGURE1_HARDWARE} "
           "(values read off the log-log plot, ±15%). Ours: the same measurement (repro.tasks.benchmark)."]
    found = named(csvs, "benchmark.csv")
    ctx.used |= {folder for folder, _ in found}
    if not found:
        return "\n\n".join(out + ["not yet run"])
    for folder, df in found:
        ok = df[df.status == "ok"] if "status" in df else df
        causal = "non-causal" if "causal" in df and not df.causal.astype(str).str.lower().eq("true").all() else "causal"
        out.append(f"### {folder.relative_to(root)} ({causal})\n\nHardware: {hardware(df)}  \n"
                   f"Command: {code(command(folder, root))}")
        rows = []
        for att, points in paper.FIGURE1.items():
            for ours in paper.FIGURE1_OURS.get(att, [att]):
                if ours not in set(df.attention):
                    continue  # not in this run at all
                for n, (t, m) in points.items():
                    mine = ok[(ok.attention == ours) & (ok.n == n)]
                    rows.append([att, ours, n, t, mine.time_per_sample_ms.iloc[0] if len(mine) else "not measured",
                                 m, mine.mem_per_sample_mb.iloc[0] if len(mine) else "not measured"])
        if rows:
            out.append(md_table(["paper's attention", "ours", "N", "paper ms/sample", "our ms/sample",
                                 "paper MB/sample", "our MB/sample"], rows))
        summary = read_json(folder / "summary.json", root) if (folder / "summary.json").is_file() else {}
        slopes = []
        for att, s in summary.get("attentions", {}).items():
            theirs = paper.FIGURE1_PAPER_NAME.get(att, att)
            slopes.append([att, paper.FIGURE1_SLOPES.get(theirs), s.get("time_slope_all"), s.get("mem_slope_all"),
                           paper.FIGURE1_LARGEST_N.get(theirs), s.get("largest_n"), s.get("first_failure", "")])
        if slopes:
            out.append("Slopes of log time and log memory against log N (paper: 1 for linear, 2 for softmax):\n\n" +
                       md_table(["attention", "paper slope", "our time slope", "our memory slope",
                                 "paper largest N", "our largest N", "first failure"], slopes))
        if (folder / "benchmark.png").is_file():
            out.append(f"![Figure 1, {folder.name}]({rel(folder / 'benchmark.png')})")
    return "\n\n".join(out)


SECTIONS = [(10, "figure1", figure1)]
