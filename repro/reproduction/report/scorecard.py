"""The scorecard of one attention: `python -m repro.report --scorecard <sweep dir> [--out DIR]`,
from the part summaries (scorecard_<part>.json) that `python run.py -m experiment=scorecard
attention=<name>` writes into its sweep dir (repro/tasks/scorecard.py); the sweep builds it at its
end too (CardCallback, named in conf/experiment/scorecard.yaml).

Writes scorecard.md (one page: what ran where, the conformance table, each measure beside
linear's and softmax's with its verdict), scorecard.png (Figure 1's time and memory against N,
and the judged measures seed by seed) and scorecard.csv (the measures and verdicts, one row a
measure and attention; with logger=wandb the sweep logs it as a table and the figure as an image).

Verdicts come from verdicts.welch (Welch's 95 % interval of the gap between the means; lower is
better): "better than X" when the interval lies wholly below 0, "as good as X" when it lies wholly
below the part's tolerance (task.tolerance), "worse than X" when wholly above it, else undecided
with the interval and the smallest gap the runs could detect. Fewer than 2 seeds a side is a
measurement, not judged. The card says how few seeds it rests on: 3 seeds give a wide interval."""
import json
from pathlib import Path

import pandas as pd

from repro.common.results import atomic_write, json_text, rows_to_csv, save_figure
from repro.reproduction import verdicts
from repro.reproduction.report import marks
from repro.reproduction.report.format import code, command, md_table, num
from repro.reproduction.report.schema import Table
from repro.tasks.scorecard import PARTS, SUBJECT, TORCH_PATH  # the parts and the runs' roles, as the task names them

TITLES = {"conformance": "Conformance", "figure1": "Figure 1: time and memory of one layer against N",
          "copy": "The copy task", "mnist": "MNIST bits/dim", "speech": "Speech recognition (the attention as "
          "the encoder's)", "generation": "Generation (the recurrent form)"}
CARD, FIGURE, TABLE = "scorecard.md", "scorecard.png", "scorecard.csv"


class CardError(ValueError):
    """No card can be built from this folder: one line saying why."""


def load(card_dir) -> dict:
    """{part: summary} of the parts a sweep dir holds, in the card's order."""
    card_dir = Path(card_dir)
    if not card_dir.is_dir():
        raise CardError(f"no folder {card_dir}")
    found = {}
    for part in PARTS:
        p = card_dir / f"scorecard_{part}.json"
        if p.is_file():
            try:
                found[part] = json.loads(p.read_text())
            except ValueError as err:
                raise CardError(f"{p}: not valid JSON ({err})") from None
    if not found:
        raise CardError(f"{card_dir} holds no part summary (scorecard_<part>.json): run "
                        "python run.py -m experiment=scorecard attention=<name> (its sweep dir is the card's folder)")
    return found


def judge(a: verdicts.Seeds, ref: verdicts.Seeds, name: str, tol: float) -> tuple[str, str]:
    """(verdict, the interval) of `a` against reference `name` (lower is better)."""
    if min(a.n, ref.n) < 2:
        return verdicts.MEASURED, f"{min(a.n, ref.n)} seed a side: an interval needs 2"
    g = verdicts.welch(a, ref)
    text = g.text("{:.3g}", name=f"gap to {name}") + f", tolerance {tol:g}"
    if g.hi < 0:
        return f"better than {name}", text
    if g.hi <= tol:
        return f"as good as {name}", text
    if g.lo > tol:
        return f"worse than {name}", text
    return "undecided", f"{text}; these runs could detect a gap of {g.detectable:.2g}"


LOADED = ("(loaded): the machine's 1-minute load average passed its cores while that run ran; its times are "
          "inflated.")


def _cell_of(m) -> str | None:
    return m.get("cell") or (f"N = {m['n']:,}" if m.get("n") is not None else None)  # Figure 1: a point per N


def _loaded(summary, m) -> bool:
    """A time measured while the machine had more runnable processes than cores (report.marks)."""
    return m.get("load") is not None and marks.loaded({"loadavg_1min_start": m["load"],
                                                       "device": summary.get("machine", "")})


def _group(summary) -> dict:
    """{(measure, cell, unit, lower_is_better, judged): {role: [values in seed order]}}."""
    out = {}
    for m in sorted(summary.get("measures", []), key=lambda m: (m.get("seed") is None, m.get("seed") or 0)):
        cell = _cell_of(m)
        key = (m["measure"], cell, m["unit"], m["lower_is_better"], m["judged"])
        out.setdefault(key, {}).setdefault(m["role"], []).append(m["value"])
    return out


def _cell(values) -> str | None:
    if not values:
        return None
    s = verdicts.Seeds(tuple(values))
    return num(s.mean) if s.n == 1 else f"{num(s.mean)} ± {s.sd:.2g} ({s.n} seeds)"


def measure_rows(part: str, summary: dict) -> list[dict]:
    """One row a measure (a cell of it: N of the copy task, a point of Figure 1): each attention's values
    and, where judged, the verdicts against the references."""
    refs, rows = summary.get("references", []), []
    tol = (summary.get("tolerance") or {}).get(part)
    for (measure, cell, unit, lower, judged), by in _group(summary).items():
        row = {"part": part, "measure": measure + (f", {cell}" if cell else ""), "unit": unit,
               "lower_is_better": lower, "values": {r: by.get(r, []) for r in [SUBJECT, *refs]},
               "extrapolated": {m["role"] for m in summary.get("measures", [])
                                if m.get("extrapolated") and (m["measure"], _cell_of(m)) == (measure, cell)},
               "loaded": {m["role"] for m in summary.get("measures", [])
                          if _loaded(summary, m) and (m["measure"], _cell_of(m)) == (measure, cell)}}
        for ref in refs:
            if judged and tol is not None and by.get(SUBJECT) and by.get(ref):
                row[f"vs {ref}"] = judge(verdicts.Seeds(tuple(by[SUBJECT])), verdicts.Seeds(tuple(by[ref])), ref, tol)
        rows.append(row)
    return rows


def _conformance(summary) -> str:
    table = summary.get("conformance") or []
    if not table:
        return ""
    return md_table(["property", "result", "detail"], [[r["property"], r["result"], r["detail"]] for r in table])


def _figure1(summary) -> str:
    refs = summary.get("references", [])
    roles = [SUBJECT, *refs]
    at, loaded = {}, set()
    for m in summary.get("measures", []):
        at.setdefault(m["n"], {})[(m["measure"], m["role"])] = m["value"]
        if _loaded(summary, m):
            loaded.add((m["n"], m["measure"], m["role"]))
    if not at:
        return ""
    names = ("time per sample", "peak memory per sample", "kept for backward per sample")
    header = ["N"] + [f"{w}, {'ms' if w.startswith('time') else 'MB'} ({' · '.join(roles)})" for w in names]

    def cell(n, w):
        return " · ".join("—" if at[n].get((w, r)) is None
                          else marks.with_marks(num(at[n][(w, r)]), False, (n, w, r) in loaded) for r in roles)
    rows = [[f"{n:,}"] + [cell(n, w) for w in names] for n in sorted(at)]
    largest = {r: max((n for n in at if (names[0], r) in at[n]), default=None) for r in roles}
    reach = "; ".join(f"{r}: {largest[r]:,}" for r in roles if largest[r]) or "none"
    note = f"\n\n{LOADED}" if loaded else ""
    return md_table(header, rows) + f"\n\nThe largest N measured (a point past its time or memory budget stops a " \
                                    f"curve): {reach}." + note


def _measures(part, summary) -> str:
    rows = measure_rows(part, summary)
    if not rows:
        return ""
    refs = summary.get("references", [])
    header = ["measure", SUBJECT, *refs] + [f"vs {r}" for r in refs]

    def verdict(row, ref):
        v = row.get(f"vs {ref}")
        if v is None:
            return None
        return v[0] if v[0] == verdicts.MEASURED else f"**{v[0]}** ({v[1]})"
    def ratio(row, ref):
        a, b = row["values"][SUBJECT], row["values"].get(ref)
        if not a or not b or row.get(f"vs {ref}") or not sum(b):
            return None
        return f"{(sum(a) / len(a)) / (sum(b) / len(b)):.3g}x {ref}'s"

    def cell(row, role):
        return marks.with_marks(_cell(row["values"][role]), role in row.get("extrapolated", ()),
                                role in row.get("loaded", ()))
    body = [[f"{r['measure']} ({r['unit']}{'' if r['lower_is_better'] else ', higher is better'})"]
            + [cell(r, x) for x in [SUBJECT, *refs]] + [verdict(r, ref) or ratio(r, ref) for ref in refs]
            for r in rows]
    extra = ["vs X: the verdict where the measure is judged, else the ratio of the means."]
    if part == "generation" and any(m.get("extrapolated") for m in summary.get("measures", [])):
        extra.append("(extrapolated): the generation passed its time budget; its total is extrapolated from the "
                     "positions measured (task=throughput).")
    if any(r.get("loaded") for r in rows):
        extra.append(LOADED)
    steps = sorted({m.get("steps") for m in summary.get("measures", []) if m.get("steps") is not None})
    if steps:
        extra.append(f"Updates trained: {', '.join(f'{s:,}' for s in steps)}.")
    return "\n\n".join([md_table(header, body), *extra])


def _status(summary) -> str:
    s = summary["status"]
    return s if not summary.get("reason") else f"{s}: {summary['reason']}"


def _first(parts, key):
    return next((s.get(key) for s in parts.values() if s.get(key)), None)


def commits(parts) -> str:
    """The card's commit; where parts were run again at another, each commit with its parts (a
    part's attention and references always share one)."""
    by = {}
    for p, s in parts.items():
        by.setdefault(s.get("commit") or "not recorded", []).append(p)
    if len(by) == 1:
        return f"`{next(iter(by))}`"
    return "; ".join(f"`{c}` ({', '.join(ps)})" for c, ps in by.items())


def seeds_note(parts) -> str:
    n = max((len(s.get("seeds", [])) for s in parts.values()), default=0)
    if n < 2:
        return ("One seed a side: every trained measure is a measurement, not judged (an interval needs 2 seeds; "
                "experiment=scorecard runs 3).")
    return (f"{n} seeds a side: Welch's 95 % interval of a gap is wide at so few (t = "
            f"{verdicts.stats.t.ppf(0.975, n - 1):.2g} at {n - 1} degrees of freedom), so a verdict here is an "
            f"indication: \"undecided\" often means too few seeds, not a tie; the paper's claims are judged from "
            f"{verdicts.MIN_SEEDS} (repro/reproduction/verdicts.py). \"as good as X\": the interval of the gap to X "
            "lies below the part's tolerance; \"better than X\": wholly below 0.")


def build(card_dir, out_dir=None) -> str:
    """Write the card (scorecard.md, .png, .csv) into out_dir (default: the card's folder) and return
    its Markdown."""
    card_dir = Path(card_dir)
    parts = load(card_dir)
    out_dir = Path(out_dir) if out_dir else card_dir
    folder, ran_in = where_it_ran(parts, card_dir)
    any_part = next(iter(parts.values()))
    name, target = any_part.get("attention"), any_part.get("target")
    quick = any(s.get("quick") for s in parts.values())
    refs = [r for r in any_part.get("references", []) if r != TORCH_PATH]
    timed = [p for p, s in parts.items() if any(r.get("role") == TORCH_PATH for r in s.get("runs", []))]
    runs = [r for s in parts.values() for r in s.get("runs", [])]
    reused = sum(bool(r.get("reused")) for r in runs if r.get("role") != SUBJECT)
    n_refs = sum(r.get("role") != SUBJECT for r in runs)
    out = [f"# Scorecard: {name}" + (f" (`{target}`)" if target else "") + (" — smoke test" if quick else "")]
    if quick:
        out.append("**A smoke test** (experiment=scorecard_quick): one seed, short runs, small sizes. Its numbers "
                   "show that every part runs, not how good the attention is; `experiment=scorecard` makes the card.")
    out.append(f"Machine: {_first(parts, 'machine') or 'not recorded'}  \n"
               f"Commit: {commits(parts)}  \n"
               f"Command: `{_first(parts, 'command') or 'not recorded'}`  \n"
               f"Beside it: {' and '.join(refs)} at the same commit and settings"
               + (f" ({reused} of their {n_refs} runs reused from earlier cards)" if n_refs else "")
               + (f"; in {' and '.join(timed)} also {TORCH_PATH}, linear on its PyTorch path (REPRO_KERNEL=torch), "
                  "the same kind of code as most attentions' ops, where linear itself takes a fused kernel"
                  if timed else "") + ".  \n"
               f"Folder: `{folder}`")
    out.append(seeds_note(parts))
    out.append(md_table(["part", "status" + (" (smoke test)" if quick else "")],
                        [[p, _status(parts[p]) if p in parts else "not run yet"] for p in PARTS]))
    csv = []
    for part, s in parts.items():
        section = [f"## {TITLES[part]}" + (" (smoke test)" if quick else ""), _status(s) if s["status"] != "ok"
                   else ""]
        body = _conformance(s) if part == "conformance" else _figure1(s) if part == "figure1" else \
            _measures(part, s)
        if part == "figure1" and body:  # the figure is always written beside the page
            body += f"\n\n![time and memory against N; the judged measures]({FIGURE})"
        section.append(body)
        failed = [r for r in s.get("runs", []) if r.get("status") != "ok"]
        if failed:
            section.append("Runs that failed: " + "; ".join(f"{_label(r)}: {r.get('reason')}" for r in failed)
                           + ".")
        commands = [r["command"] for r in s.get("runs", []) if r.get("role") == SUBJECT and r.get("command")]
        if commands:
            section.append("The attention's runs: " + "; ".join(f"`{c}`" for c in commands[:3])
                           + (f"; and {len(commands) - 3} more" if len(commands) > 3 else ""))
        out.append("\n\n".join(x for x in section if x))
        csv += [{"attention": name, "part": r["part"], "measure": r["measure"], "unit": r["unit"], "role": role,
                 "n": len(v), "mean": verdicts.Seeds(tuple(v)).mean if v else None,
                 "sd": verdicts.Seeds(tuple(v)).sd if v else None, "values": json.dumps(v),
                 "lower_is_better": r["lower_is_better"], "extrapolated": role in r.get("extrapolated", ()),
                 "loaded": role in r.get("loaded", ()),
                 **{k: v for ref in refs for k, v in zip((f"vs_{ref}", f"vs_{ref}_interval"), r.get(f"vs {ref}")
                                                         or (None, None))},
                 "smoke_test": quick, "commit": s.get("commit")}
                for r in measure_rows(part, s) for role, v in r["values"].items()]
        csv += [{"attention": name, "part": part, "measure": "status", "role": None, "values": _status(s),
                 "smoke_test": quick, "commit": s.get("commit")}]
    text = "\n\n".join(out) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    if out_dir.resolve() != card_dir.resolve():  # a published card keeps what it was built from: rebuildable there
        for stale in set(PARTS) - set(parts):  # a part an earlier card had and this one has not
            (out_dir / f"scorecard_{stale}.json").unlink(missing_ok=True)
        for part, summary in parts.items():
            atomic_write(out_dir / f"scorecard_{part}.json", json_text(portable(summary, ran_in), indent=1) + "\n")
        if _first(parts, "command"):
            atomic_write(out_dir / "command.txt", _first(parts, "command") + "\n")
    save_figure(figure(parts, quick), out_dir / FIGURE)
    atomic_write(out_dir / TABLE, rows_to_csv(csv))
    atomic_write(out_dir / CARD, text)
    return text


def where_it_ran(parts: dict, card_dir: Path) -> tuple[str, Path | None]:
    """(the sweep folder as the command named it, the directory the command ran in, when
    `card_dir` is still that folder there): read off the attention's own runs, which sit beside
    the folder as <folder>.runs/<part>/."""
    here = card_dir.resolve().parts
    for r in (r for s in parts.values() for r in s.get("runs", []) if r.get("role") == SUBJECT):
        beside = next((p for p in Path(r.get("dir") or "/").parents if p.name.endswith(".runs")), None)
        if beside is not None:
            folder = beside.with_name(beside.name.removesuffix(".runs"))
            n = len(folder.parts)
            return str(folder), Path(*here[:-n]) if here[-n:] == folder.parts and len(here) > n else None
    return card_dir.name, None


def portable(summary: dict, ran_in: Path | None) -> dict:
    """A part summary to publish: each run's log relative to the directory its command ran in."""
    def log(path):
        if ran_in is None or not path or not Path(path).is_absolute():
            return path
        try:
            return str(Path(path).relative_to(ran_in))
        except ValueError:
            return path
    return {**summary, "runs": [{**r, "log": log(r.get("log"))} for r in summary.get("runs", [])]}


def _label(r) -> str:
    return " ".join(str(x) for x in (r.get("role"), r.get("cell"),
                                     None if r.get("seed") is None else f"seed {r['seed']}") if x)


def figure(parts, quick: bool):
    """Figure 1's time and memory against N (dashed: kept for backward), and each judged measure
    seed by seed, relative to linear's mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    f1 = parts.get("figure1", {})
    roles = list(dict.fromkeys([SUBJECT, *(r for s in parts.values() for r in s.get("references", []))]))
    for ax, (measures, ylabel) in zip(axes[:2], [(("time per sample",), "time per sample (ms)"),
                                                 (("peak memory per sample", "kept for backward per sample"),
                                                  "memory per sample (MB); dashed: kept for backward")]):
        for i, role in enumerate(roles):
            labelled = False  # one legend entry a role, on its first curve
            for measure, style in zip(measures, ("-", "--")):
                pts = sorted((m["n"], m["value"]) for m in f1.get("measures", [])
                             if m["role"] == role and m["measure"] == measure)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", ms=3, color=f"C{i}", label=None if labelled else role)
                    labelled = True
        ax.set(xscale="log", yscale="log", xlabel="N", ylabel=ylabel)
        if ax.lines:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes)
    ax = axes[2]
    judged = [r for p, s in parts.items() if p in ("copy", "mnist", "speech") for r in measure_rows(p, s)
              if any(k.startswith("vs ") for k in r) or r["measure"].startswith(("held-out", "validation"))]
    for x, row in enumerate(judged):
        base = verdicts.Seeds(tuple(row["values"].get("linear") or [])) if row["values"].get("linear") else None
        for i, role in enumerate(roles):
            v = row["values"].get(role) or []
            if v and base and base.mean:
                ax.plot([x + (i - 1) * 0.2] * len(v), [y / base.mean for y in v], "o", color=f"C{i}",
                        label=role if x == 0 else None)
    ax.set_xticks(range(len(judged)), [r["measure"] for r in judged], rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="relative to linear's mean (lower is better)")
    if judged:
        ax.axhline(1, color="grey", lw=0.5)
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no trained measure", ha="center", transform=ax.transAxes)
    first = next(iter(parts.values()))
    name = f"{first.get('attention')} ({str(first.get('target')).rsplit('.', 1)[-1]})"
    fig.suptitle(f"scorecard: {name}" + (" (smoke test)" if quick else ""))
    fig.tight_layout()
    return fig


def main(card_dir, out=None) -> int:
    """--scorecard: build the card; a folder it cannot read is one line."""
    try:
        build(card_dir, out)
    except CardError as err:
        raise SystemExit(f"error: {err}") from None
    target = Path(out) if out else Path(card_dir)
    print(f"wrote {target / CARD}, {target / FIGURE}, {target / TABLE}")
    return 0


# ----------------------------------------------------------------------------- the report's section
# "Beyond the paper": the cards results/claims.yaml names under report.scorecards, each a folder a
# card was published to (python -m repro.report --scorecard <sweep dir> --out results/scorecards/<name>).

TABLES = [Table(TABLE, {"attention": str, "part": str, "measure": str, "role": str, "n": float},
                {"mean": float, "sd": float})]
BEYOND = (
    "The paper's linear attention adds to its state, S_i = S_{i-1} + phi(k_i) v_i^T. Its successors change only "
    "that update: retention decays S by a fixed gamma per head, gated linear attention by a learned decay per key "
    "dimension, and the delta rule overwrites what a key held (docs/attention.md). Each went through the scorecard "
    "(`python run.py -m experiment=scorecard attention=<name>`, docs/extending.md) beside linear and softmax at the "
    "same commit and settings; no table of the paper has them. Below, each card's measures: a judged one with its "
    "verdict and Welch's 95 % interval, the others as the ratio of the means; the card's own page has the rest "
    "(conformance, every Figure 1 point, the runs' commands). Figure 1's rows are its largest N that every "
    "attention of the card reached. Where a card has linear-torch, linear ran its timed parts on its PyTorch path "
    "too (REPRO_KERNEL=torch), the same kind of code as the successors' ops: linear's own column is its fused "
    "kernel.")


def _largest_common_point(m):
    """Figure 1's rows at the largest N every role reached (time and bytes kept for backward)."""
    f1 = m[(m.part == "figure1") & (m.n > 0) & ~m.measure.str.startswith("peak memory")]  # (past a budget: none)
    if f1.empty:
        return f1
    complete = f1.groupby("measure").role.nunique() == m.role.dropna().nunique()  # every role of the card
    at = {name: int(name.rsplit("N = ", 1)[1].replace(",", "")) for name in complete[complete].index}
    if not at:
        return f1.iloc[:0]
    n = max(at.values())
    return f1[f1.measure.isin([name for name, v in at.items() if v == n])]


def _card_table(ctx, folder: Path, df) -> str:
    name = df.attention.dropna().iloc[0]
    smoke = bool(df.get("smoke_test", False).astype(str).eq("True").any())
    status = df[df.measure == "status"]
    m = df[df.measure != "status"]
    m = pd.concat([m[m.part != "figure1"], _largest_common_point(m)])
    refs = [r for r in ("linear", "softmax", TORCH_PATH) if r in set(m.role)]
    body = []
    for (part, measure), rows in m.groupby(["part", "measure"], sort=False):
        by = rows.set_index("role")
        if SUBJECT not in by.index:
            continue
        unit = by.unit.iloc[0] + ("" if str(by.lower_is_better.iloc[0]) != "False" else ", higher is better")
        cells = [_mean_cell(by, r) for r in [SUBJECT, *refs]]
        verdict = []
        for ref in refs:
            v, why = by.loc[SUBJECT].get(f"vs_{ref}"), by.loc[SUBJECT].get(f"vs_{ref}_interval")
            if isinstance(v, str) and v != verdicts.MEASURED:
                verdict.append(f"**{v}** ({why})")
            elif ref in by.index and pd.notna(by.loc[ref, "mean"]) and by.loc[ref, "mean"] \
                    and pd.notna(by.loc[SUBJECT, "mean"]):
                verdict.append(f"{by.loc[SUBJECT, 'mean'] / by.loc[ref, 'mean']:.3g}x {ref}'s")
            else:
                verdict.append(None)
        body.append([f"{part}: {measure} ({unit})", *cells, *verdict])
    parts = ", ".join(f"{r.part} {r['values']}" for _, r in status.iterrows())
    commit = commits({r.part: {"commit": r.get("commit") if pd.notna(r.get("commit")) else None}
                      for _, r in status.iterrows()})
    head = f"### {name}" + (" (smoke test: one seed, short runs)" if smoke else "")
    line = (f"The card: [{folder.relative_to(ctx.root).as_posix()}/{CARD}]({ctx.rel(folder / CARD)}), "
            f"commit {commit}, command {code(command(folder, ctx.root))}. Parts: {parts}.")
    table = md_table(["measure", name, *refs, *[f"vs {r}" for r in refs]], body)
    fig = f"![{name}: time and memory against N, and the judged measures]({ctx.rel(folder / FIGURE)})"
    shown = m[m.role.isin([SUBJECT, *refs])] if "loaded" in m else m.iloc[:0]
    note = LOADED if shown.get("loaded", pd.Series(dtype=str)).astype(str).eq("True").any() else ""
    return "\n\n".join(x for x in [head, line, table, note, fig] if x)


def _mean_cell(by, role) -> str | None:
    if role not in by.index or pd.isna(by.loc[role, "n"]) or not by.loc[role, "n"]:
        return None
    r = by.loc[role]
    text = num(r["mean"]) if r["n"] == 1 else f"{num(r['mean'])} ± {r['sd']:.2g} ({int(r['n'])} seeds)"
    return marks.with_marks(text, str(r.get("extrapolated")) == "True", str(r.get("loaded")) == "True")


def beyond(ctx) -> str:
    cards = ctx.named("scorecards", TABLE)
    if not cards:
        return ""
    return "\n\n".join(["## Beyond the paper: linear attention's successors, by scorecard", BEYOND,
                         *[_card_table(ctx, folder, df) for folder, df in cards]])


SECTIONS = [(71, "scorecards", beyond)]


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover (Hydra is a dependency of the suite)
    Callback = object


class CardCallback(Callback):
    """At the end of a scorecard sweep: the card in the sweep dir. Hydra ends callbacks in reverse
    order, so this runs before the sweep's summary (repro.cli.callbacks.AggregateSweep), which then
    logs the card's table and figure with every CSV and PNG of the sweep dir (logger=wandb)."""

    def on_multirun_end(self, config, **kwargs):
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            build(sweep_dir)
        except CardError as err:
            print(f"\nerror: no scorecard: {err}")
            return
        print(f"\nthe card: {sweep_dir / CARD} (rebuild: python -m repro.report --scorecard {sweep_dir})")
