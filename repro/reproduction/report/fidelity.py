"""Fidelity: this suite beside the authors' own scripts at matched settings
(repro.reproduction.fidelity's fidelity_runs.csv, one folder per comparison). Each folder is one
declared run and is shown on its own; one that holds two rows for the same run, or sides trained
for different numbers of updates, is refused with a line saying why, never averaged."""
import math

import pandas as pd

from repro.reproduction.report.format import code, command, md_table
from repro.reproduction.report.schema import SchemaError, Table
from repro.reproduction.verdicts import Seeds, matches

TABLE = "fidelity_runs.csv"
TABLES = [Table(TABLE, {"task": str, "attention": str, "side": str, "variant": str, "seed": float, "metric": float,
                        "metric_name": str, "status": str},
                {"updates": float, "wall_s": float, "loadavg_start": float, "loadavg_end": float, "git_sha": str,
                 "authors_commit": str, "library_commit": str, "host_cpu": str, "their_scoring": float})]
SIDES = ("authors", "ours")
HEADER = ["ours", "ours: mean ± sd (runs)", "authors' script: mean ± sd (runs)", "gap (ours − theirs)", "verdict",
          "wall s a run, ours", "wall s a run, theirs"]


def _seeds(df) -> Seeds:
    return Seeds(tuple(float(v) for v in df.metric))


def _cell(s: Seeds) -> str:
    return f"{s.mean:.4g} ± {s.sd:.2g} ({s.n})"


def _mean(df, col) -> float:
    return float(df[col].mean()) if col in df and df[col].notna().any() else math.nan


def check_runs(df: pd.DataFrame, where: str):
    """One row per run, both sides known; a SchemaError naming the file otherwise."""
    bad = sorted(set(df.side) - set(SIDES))
    if bad:
        raise SchemaError(f"{where}: side {bad[0]!r}; valid: {', '.join(SIDES)}")
    dup = df[df.duplicated(["task", "attention", "side", "variant", "seed"], keep=False)]
    if len(dup):
        r = dup.iloc[0]
        raise SchemaError(f"{where}: {len(dup)} rows for one run ({r.task}, {r.attention}, {r.side}, {r.variant}, "
                          f"seed {int(r.seed)}): a file written by two comparisons; rerun it into its own folder")


def comparison(df: pd.DataFrame) -> tuple[list, list]:
    """Table rows (variant, ours, authors', gap, verdict, seconds a run ours / theirs) of one task and
    attention, and notes (runs left out, settings that differ)."""
    ok = df[df.status == "ok"]
    notes = []
    failed = df[df.status != "ok"]
    if len(failed):
        notes.append(f"{len(failed)} run(s) left out (not ok): "
                     + "; ".join(f"{r.side} {r.variant} seed {int(r.seed)}: {r.status}" for _, r in failed.iterrows()))
    nonfinite = ok[~ok.metric.map(lambda v: math.isfinite(float(v)))]
    if len(nonfinite):
        notes.append(f"{len(nonfinite)} run(s) ended at a non-finite value, left out: "
                     + ", ".join(f"{r.side} seed {int(r.seed)}" for _, r in nonfinite.iterrows()))
        ok = ok.drop(nonfinite.index)
    theirs = ok[ok.side == "authors"]
    if "updates" in ok and ok.updates.nunique() > 1:
        counts = ", ".join(f"{s}: {sorted(set(ok[ok.side == s].updates.astype(int)))}" for s in SIDES)
        return [], notes + [f"not compared: the runs trained for different numbers of updates ({counts})"]
    rows = []
    for variant, ours in ok[ok.side == "ours"].groupby("variant", sort=True):
        if not len(theirs):
            rows.append([variant, _cell(_seeds(ours)), "not run", None, "not compared", None, None])
            continue
        a, b = _seeds(ours), _seeds(theirs)
        verdict, why = matches(a, b)
        rows.append([variant, _cell(a), _cell(b), f"{a.mean - b.mean:+.3g}", f"{verdict} ({why})",
                     _mean(ours, "wall_s"), _mean(theirs, "wall_s")])
    if "their_scoring" in theirs and theirs.their_scoring.notna().all() and len(theirs):
        notes.append("The authors' script's own held-out loss, which also scores the separator's target "
                     f"(position n - 1): {_cell(Seeds(tuple(theirs.their_scoring)))}; the "
                     "comparison above uses the copy positions only, on their script's own evaluation batches.")
    return rows, notes


def provenance(df) -> str:
    def one(col):
        vals = sorted(set(map(str, df[col].dropna()))) if col in df else []
        return ", ".join(vals) or "not recorded"
    load = [df[c] for c in ("loadavg_start", "loadavg_end") if c in df]
    loads = pd.concat(load) if load else pd.Series(dtype=float)
    text = (f"Host: {one('host_cpu')}, 1 torch thread a run  \nOur commit: {one('git_sha')}; the authors' scripts: "
            f"{one('authors_commit')}; their library (fast-transformers): {one('library_commit')}")
    if len(loads):
        text += (f"  \n1-minute load during the runs: {loads.min():.1f} to {loads.max():.1f} (the host's "
                 "cores shared with other work): wall seconds a run are not a speed comparison")
    return text


def fidelity(ctx) -> str:
    found = ctx.named("fidelity", TABLE)
    if not found:
        return ""
    out = ["## Fidelity: this suite beside the authors' own scripts",
           "The same CPU-sized settings given to this suite (`run.py`) and to the authors' own scripts "
           "(idiap/linear-transformer-experiments on their fast-transformers library), run alternately on one "
           "machine by `python -m repro.reproduction.fidelity` (docs/fidelity.md). Each side: mean ± sd (runs); "
           "where Welch's 95 % interval of the gap includes 0 they match (\"matches the authors' script\", with "
           "the smallest gap the runs could have detected) "
           "(`repro/reproduction/verdicts.py`). Settings that could not be matched exactly: each folder's README."]
    for folder, df in found:
        where = folder.relative_to(ctx.root)
        check_runs(df, f"{where / TABLE}")
        readme = folder / "README.md"
        link = f"  \nSettings and what differs: [{where}/README.md]({ctx.rel(readme)})" if readme.is_file() else ""
        out.append(f"### {where}\n\n{provenance(df)}  \nCommand: {code(command(folder, ctx.root))}{link}")
        for (task, attention), part in df.groupby(["task", "attention"], sort=True):
            rows, notes = comparison(part)
            metric = part.metric_name.iloc[0]
            text = [f"**{task}, {attention} attention**: {metric}"]
            if rows:
                text.append(md_table(HEADER, rows))
            text += notes
            out.append("\n\n".join(text))
        if (folder / "fidelity_curves.png").is_file():
            out.append(f"![held-out curves]({ctx.rel(folder / 'fidelity_curves.png')})")
    return "\n\n".join(out)


SECTIONS = [(25, "fidelity", fidelity)]
