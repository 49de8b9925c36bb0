"""The copy task's length sweep for linear attention's successors (the folders results/claims.yaml
names under report.successors.copy: N = 32, 64 from copy/lengths_successors_cpu, N = 128 from
copy/successors_n128_cpu, the same model and schedule), and the section's one judged question: at
each N where linear's held-out loss is above softmax's by more than the seeds' spread (its additive
memory has run out), does each successor reach a lower held-out loss than linear?"""
import pandas as pd

from repro.reproduction import verdicts
from repro.reproduction.manifest import ManifestError
from repro.reproduction.report import marks
from repro.reproduction.report.figure2 import COPY_ROWS
from repro.reproduction.report.format import hardware, md_table, num
from repro.reproduction.report.schema import failed, read_rows
from repro.reproduction.report.successors.runs import not_yet_run, source, with_mark

ATTENTIONS = ("softmax", "linear", "retention", "gla", "delta")
SUCCESSORS = ATTENTIONS[2:]
PRESETS = ("copy/lengths_successors_cpu", "copy/successors_n128_cpu")  # where the copy presets publish
# copy_successors_cpu runs no softmax at N = 128: the ceiling comes from the run the manifest names
# (report.successors.softmax_128: Figure 2's), used only while its model and schedule are the successors' run's
SAME_SETUP = ("n_layers", "d_model", "n_heads", "d_ff", "batch_size", "min_copy", "max_copy", "max_steps",
              "score_separator")
ANSWER = {verdicts.REPRODUCED: "yes", verdicts.CONTRADICTED: "no: worse than linear",
          verdicts.UNDECIDED: "a tie: undecided at this scale", verdicts.MEASURED: "measured, not judged"}


def answer(successor: verdicts.Seeds, linear: verdicts.Seeds) -> str:
    """Lower held-out loss is better: `successor` below `linear` by more than the spread is a yes."""
    verdict, why = verdicts.below(successor, linear)
    return f"{ANSWER[verdict]} ({why})"


def runs_out(softmax, linear) -> tuple[str, str]:
    """(verdict, text) of "linear's held-out loss is above softmax's beyond the spread" at one N:
    only there is the successors' question asked."""
    if softmax is None or linear is None:
        return verdicts.NOT_TESTABLE, f"no {'softmax' if softmax is None else 'linear'} result at this N: not judged"
    verdict, why = verdicts.below(softmax, linear)
    if verdict == verdicts.REPRODUCED:
        return verdict, f"runs out: above softmax ({why})"
    if verdict == verdicts.MEASURED:
        return verdict, f"measured, not judged ({why})"
    return verdict, f"matches softmax ({why}): not judged at this N"


def _setup(rows) -> set:
    return {tuple(r.get(k) for k in SAME_SETUP) for r in rows}


def _finals(ctx) -> tuple[list, list, list]:
    """(final rows, folders read, notes): the final rows of the folders the manifest names, and the
    softmax at N = 128 of the one it names for that (Figure 2's) when the successors' N = 128 run
    has none and the setups agree."""
    rows, read, notes = [], [], []
    for folder in ctx.manifest.paths("successors", "copy"):
        path = folder / "copy_rows.jsonl"
        if not path.is_file():
            raise ManifestError(f"report.successors.copy: {folder.relative_to(ctx.root)} holds no copy_rows.jsonl")
        rows += [r for r in read_rows(path, ctx.root, COPY_ROWS) if r["kind"] == "final"]
        read.append(folder)
    notes += [not_yet_run(folder) for folder in PRESETS if ctx.root / folder not in read]
    at_128 = [r for r in rows if r["max_len"] == 128]
    softmax_128 = ctx.manifest.folder("successors", "softmax_128")
    borrowed = softmax_128 / "copy_rows.jsonl" if softmax_128 else None
    if at_128 and not any(r["attention"] == "softmax" for r in at_128) and borrowed and borrowed.is_file():
        theirs = [r for r in read_rows(borrowed, ctx.root, COPY_ROWS)
                  if r["kind"] == "final" and r["attention"] == "softmax" and r["max_len"] == 128]
        if theirs and _setup(theirs) == _setup(at_128):
            rows += theirs
            read.append(borrowed.parent)
            notes.append(f"Softmax at N = 128 comes from `{softmax_128.relative_to(ctx.root)}` (Figure 2's run: the "
                         "same model and schedule; the successors' preset runs no softmax).")
        elif theirs:
            notes.append(f"No softmax at N = 128: `{softmax_128.relative_to(ctx.root)}` ran another model or "
                         "schedule.")
    return rows, read, notes


def _ok(g):
    return g[~g.status.map(failed)] if g is not None else None


def _seeds(g) -> verdicts.Seeds | None:
    """The held-out losses of the seeds that did not fail (a failed seed is never a value)."""
    ok = _ok(g)
    return verdicts.Seeds(tuple(float(v) for v in ok.sort_values("seed").eval_loss)) if ok is not None and len(ok) \
        else None


def _cells(g) -> list:
    """Updates, held-out loss (mean ± sd over the seeds), symbols right, ms/step (wall-clock, marked
    where any seed ran on a loaded machine)."""
    ok, seeds = _ok(g), _seeds(g)
    if seeds is None:
        return [None, f"failed ({'; '.join(sorted(set(g.status)))})", None, None]
    ms = ok.time_per_step_ms.mean() if "time_per_step_ms" in ok and ok.time_per_step_ms.notna().any() else None
    return [f"{int(ok.steps.max()):,}", seeds.text("{:#.3g}"), f"{100 * ok.eval_accuracy.mean():.1f} %",
            with_mark(num(float(ms)), bool(ok.apply(marks.loaded, axis=1).any())) if ms is not None else None]


def copy_lengths(ctx) -> str:
    rows, read, notes = _finals(ctx)
    out = ["### The copy task against N: where does linear's memory run out?"]
    if not rows:
        return "\n\n".join(out + notes)
    df = pd.DataFrame(rows)
    table, failures = [], []
    for n, at_n in df.groupby("max_len"):
        by = dict(list(at_n.groupby("attention")))  # (a GroupBy is not a mapping)
        seeds = {a: _seeds(by.get(a)) for a in ATTENTIONS}
        verdict, linear_text = runs_out(seeds["softmax"], seeds["linear"])
        for att in ATTENTIONS:
            if att not in by:
                table.append([int(n), att, None, "not run", None, None, None])
                continue
            g = by[att]
            cells = _cells(g)
            if att == "softmax":
                judged = "the ceiling"
            elif att == "linear":
                judged = linear_text
            elif seeds[att] is None or seeds["linear"] is None:
                judged = None
            elif verdict in (verdicts.REPRODUCED, verdicts.MEASURED):
                judged = answer(seeds[att], seeds["linear"])
            else:
                judged = "not judged: " + ("linear matches softmax at this N" if verdict != verdicts.NOT_TESTABLE
                                           else "no softmax result at this N")
            table.append([int(n), att, *cells, judged])
            failures += [f"N = {int(n)}, {att} seed {int(r.seed)}: {r.status}" for _, r in g.iterrows()
                         if failed(r.status)]
    copies = ", ".join(f"{int(g.min_copy.min())}-{int(g.max_copy.max())} symbols at N = {int(n)}"
                       for n, g in df.groupby("max_len"))
    model = "; ".join(sorted({f"{int(r.n_layers)} layers, d_model {int(r.d_model)}" for _, r in df.iterrows()}))
    out.append("Hardware: " + hardware(df) + "  \nCommands: " + "; ".join(source(f, ctx.root) for f in read)
               + f"  \nSetup: {model}; copies of {copies}; held-out loss in nats per copied symbol; "
               "ms/step is wall-clock, mean over the seeds")
    out += notes
    out.append(md_table(["N", "attention", "updates", "held-out loss, mean ± sd", "symbols right", "ms/step",
                         "linear ran out? / copies better than linear?"], table))
    if failures:
        out.append("Failed, left out: " + "; ".join(failures) + ".")
    return "\n\n".join(out)

