"""Does the suite reproduce the paper's claims? One markdown table, claim by claim, rendered from
the committed runs results/claims.yaml names for them (repro.reproduction.manifest: its `claims`):
what the paper says, what the runs here measured, and a verdict. The learning claims (copy,
MNIST) are judged over the seeds of one declared run each (at least verdicts.MIN_SEEDS a side,
finals unsmoothed) by the interval rules of repro.reproduction.verdicts (reproduced / contradicted /
undecided at this scale); the speed claims are single measurements against the paper's ratios.

    python -m repro.reproduction.report.claims     # print the section (README "Does it reproduce the paper's claims?")

The paper's numbers come from repro.common.paper, the one place that holds them.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from repro.common import paper
from repro.common.results import REPO
from repro.reproduction import manifest as manifests
from repro.reproduction.manifest import Manifest, ManifestError
from repro.reproduction.report.figure2 import COPY_ROWS
from repro.reproduction.report.marks import extrapolated
from repro.reproduction.report.schema import Rows, Table, failed, read_json, read_rows, read_table
from repro.reproduction.verdicts import (
    CONTRADICTED,
    LEVEL,
    MEASURED,
    MIN_SEEDS,
    REPRODUCED,
    UNDECIDED,
    Seeds,
    below,
    reaches,
    seed_slope,
    slopes,
    still_falling,
    welch,
)

NOT_REPRODUCED, NOT_TESTABLE = "not reproduced", "not testable here"  # the single-run speed claims

# The paper's numbers this section quotes, taken from repro.common.paper (each names its table).
# Table 1 (MNIST bits/dim), best first
PAPER_MNIST_BPD = dict(sorted(((a, bpd) for a, (bpd, _) in paper.BITS_PER_DIM["mnist"].items()),
                              key=lambda item: item[1]))
PAPER_ASR_S_PER_EPOCH = {a: paper.ASR[a][1] for a in ("softmax", "linear")}  # Table 3 (WSJ, one GPU)
# images/s on MNIST (GPU): Table 4 (linear's equals Table 1's); seconds per image at batch 1 on
# the GPU: Table 5
PAPER_MNIST_IMAGES_PER_S = {a: paper.IMAGES_PER_S["mnist"][a] for a in ("stateful-softmax", "linear")}
PAPER_MNIST_GPU_S_BATCH1 = {a: paper.SECONDS_PER_IMAGE["mnist"][a][1] for a in ("stateful-softmax", "linear")}

COPY_LOSS_TOL = 0.01   # nats per copied symbol: closer than this counts as "the same loss" (both ~100 % accurate)
SPEEDUP_FACTOR = 1.5   # a speed-up within this factor of the paper's (or above it) counts as reproduced
GROWTH_MARGIN = 1.25   # "the lead grows with the batch": at the largest batch at least this times batch 1's


@dataclass
class Claim:
    claim: str        # what the paper says, in a few words
    paper: str        # the paper's numbers
    here: str         # what the committed run measured (and where)
    verdict: str      # REPRODUCED | NOT_REPRODUCED | NOT_TESTABLE (+ a reason after a colon)


# ----------------------------------------------------------------------------- the rules

def speedup_verdict(ratio: float, paper: float, factor: float = SPEEDUP_FACTOR) -> str:
    if ratio >= paper / factor:
        return REPRODUCED
    if ratio > 1:
        return f"{NOT_REPRODUCED}: faster, but {ratio:.2f}x against {paper:.1f}x"
    return f"{NOT_REPRODUCED}: not faster"


def growth_verdict(leads: dict[int, float], margin: float = GROWTH_MARGIN) -> str:
    """leads: batch -> how many times faster linear is than the key/value cache."""
    small, large = leads[min(leads)], leads[max(leads)]
    if large >= margin * small:
        return REPRODUCED
    if large > small:
        return f"{NOT_REPRODUCED}: grows only {large / small:.2f}x"
    return f"{NOT_REPRODUCED}: the lead does not grow"


# ----------------------------------------------------------------------------- the runs

def _missing(claim, paper, folder):
    """A claim with no run: the manifest names none for it (folder None), or its folder lacks the file."""
    here = f"no run in `{folder}`" if folder else f"no run named for it in `results/{manifests.NAME}`"
    return Claim(claim, paper, here, f"{NOT_TESTABLE}: not run")


# What each claim reads, declared as the report's sections declare theirs (repro.reproduction.report.schema):
# a file that lost a field or a column is one error naming it, never a KeyError or a silent NaN
MNIST_ROWS = Rows("image_rows.jsonl", {"*": {"kind": str, "attention": str},
                                       "eval": {"seed": float, "step": float, "bits_per_dim": float},
                                       "final": {"seed": float, "cpu_time_per_step_ms": float, "status": str}})
ASR_ROWS = Rows("asr_rows.jsonl", {"*": {"batch_size": float, "model_n_layers": float, "model_n_heads": float,
                                         "model_d_model": float}})
ASR_TABLE = Table("asr_table.csv", {"model": str, "steps": float, "epochs": float, "s_per_epoch": float,
                                    "mean_frames": float, "status": str}, {"cpu_s_per_epoch": float, "seeds": float})
BATCH_TABLE = Table("throughput.csv", {"method": str, "batch": float, "status": str, "extrapolated": str},
                    {"seconds_per_image": float, "cpu_seconds_per_image": float})


def _failed(rows: pd.DataFrame, name: str = "attention") -> str | None:
    """The runs among `rows` (final rows, or a table's) whose status says they failed
    (schema.failed), with their status; None when none did. No verdict is computed from a failed run."""
    bad = rows[rows.status.map(failed)]
    if not len(bad):
        return None
    seed = (lambda r: f" seed {r['seed']}") if "seed" in bad else (lambda r: "")
    return "; ".join(f"{r[name]}{seed(r)} failed ({r['status']})" for _, r in bad.iterrows())


def _not_judged(claims, folder, lost) -> list[Claim]:
    return [Claim(c, p, f"`{folder}`: {lost}", f"{NOT_TESTABLE}: a run failed ({lost})") for c, p in claims]


COPY_CLAIMS = ("Figure 2: linear converges to softmax's loss on the copy task (N = 128, copies of 32-62 symbols)",
               "Figure 2: LSH-4 ends above both")
MNIST_CLAIMS = ("Table 1: MNIST bits/dim, softmax < linear < LSH-4 < LSH-1 (equal epochs; here equal steps)",
                "Table 2: at equal training time linear ends below softmax (here on MNIST, equal CPU time)")


def _seeds(final: pd.DataFrame, column: str) -> dict[str, Seeds]:
    """{attention: its seeds' final `column`} from a run's final rows (one per seed)."""
    return {a: Seeds(tuple(float(v) for v in g.sort_values("seed")[column])) for a, g in final.groupby("attention")}


def _held_out_digits(rows: pd.DataFrame) -> str:
    """", on N held-out digits" when the rows record how many each evaluation read (n_eval)."""
    n = rows[rows.kind == "eval"].get("n_eval", pd.Series(dtype=float)).dropna()
    return f" on {int(n.min()):,} held-out digits" if len(n) else ""


def copy_claims(results: Path, folder: str | None) -> list[Claim]:
    c1, c2 = COPY_CLAIMS
    p1 = f"curves only (no numbers); {paper.FIGURE2_SETUP}"
    path = results / str(folder) / "copy_rows.jsonl"
    if folder is None or not path.exists():
        return [_missing(c1, p1, folder), _missing(c2, "curves only", folder)]
    rows = pd.DataFrame(read_rows(path, results, COPY_ROWS))
    lost = _failed(rows[(rows.kind == "final") & rows.attention.isin(["softmax", "linear", "lsh-4"])])
    if lost:
        return _not_judged([(c1, p1), (c2, "curves only")], folder, lost)
    final = _seeds(rows[rows.kind == "final"], "eval_loss")
    evals = rows[rows.kind == "eval"]
    first = rows.iloc[0]
    setup = (f"N = {first.max_len}, copies of {first.min_copy}-{first.max_copy} symbols, {first.n_layers} layers, "
             f"d_model {first.d_model}, {int(rows[rows.kind == 'final'].steps.max()):,} updates (a smaller model "
             "and budget than the paper's)")

    def fmt(a):
        acc = rows[(rows.kind == "final") & (rows.attention == a)].eval_accuracy.mean()
        return f"{a} {final[a].text('{:#.2g}')}, {100 * acc:.1f} % of symbols right"

    if not {"softmax", "linear"} <= set(final):
        return [Claim(c1, p1, f"`{folder}` lacks softmax or linear", f"{NOT_TESTABLE}: not run"),
                _missing(c2, "curves only", folder)]
    # still falling: judged seed by seed from each one's own last evaluations
    lin = evals[evals.attention == "linear"]
    per_seed = [(g.step, g.loss) for _, g in lin.sort_values("step").groupby("seed")] if len(lin) else []
    falling = still_falling(per_seed) if per_seed and min(len(s) for s, _ in per_seed) >= 3 else None
    if falling is None:  # no held-out curve (no eval rows): nothing says it stopped
        verdict, why = MEASURED, "no held-out curve to tell whether linear still falls"
    else:
        verdict, why = reaches(final["linear"], final["softmax"], COPY_LOSS_TOL, falling)
    here = (f"held-out loss (nats/symbol) after training, {setup}: {fmt('softmax')}; {fmt('linear')} "
            f"({falling.text if falling else 'no held-out curve'}) (`{folder}`)")
    out = [Claim(c1, p1, here, f"{verdict}: {why}")]
    if "lsh-4" in final:
        worse = max(("softmax", "linear"), key=lambda a: final[a].mean)
        verdict, why = below(final[worse], final["lsh-4"])
        out.append(Claim(c2, "curves only", f"{fmt('lsh-4')}, against {worse}, the higher of the two (`{folder}`)",
                         f"{verdict}: {why}"))
    else:
        out.append(_missing(c2, "curves only", folder))
    return out


FIDELITY_RUNS = Table("fidelity_runs.csv", {"task": str, "attention": str, "side": str, "variant": str,
                                             "metric": float, "status": str, "copy_n": float, "n_layers": float,
                                             "n_heads": float, "d_query": float, "steps": float},
                      {"not_matched": str})
OURS_VARIANT = "embedding dropout 0"  # ours as the authors' scripts have it (docs/presets.md)
SWEEP_CLAIM = "Figure 2 at N = 128: what closes linear's gap to softmax, width, per-head state or budget?"
SWEEP_CELL = ("d_model", "n_heads", "n_layers", "d_ff", "max_steps")


def _cell(rows: pd.DataFrame) -> dict:
    first = rows.iloc[0]
    return {k: int(first[k]) for k in SWEEP_CELL if k in rows}


def _cell_text(c: dict) -> str:
    return (f"d_model {c['d_model']}, {c['n_heads']} x {c['d_model'] // c['n_heads']}, {c.get('n_layers', '?')} "
            f"layers, {c.get('max_steps', 0):,} updates")


def authors_copy(results: Path, folder: str | None) -> tuple[str, str]:
    """(what the runs show, what it says of the claim): the authors' copy script at the judged run's
    settings beside ours on their architecture (fidelity_runs.csv of repro.reproduction.fidelity):
    does their linear stay above their softmax as ours does? ("", "") where the manifest names none."""
    if folder is None:
        return "", ""
    path = results / folder / FIDELITY_RUNS.name
    if not path.is_file():
        return f"the authors' script: no {path.name} in `{folder}`", ""
    df = read_table(path, results, FIDELITY_RUNS)
    df = df[(df.task == "copy") & (df.status == "ok")]
    first = df.iloc[0] if len(df) else None
    if first is None:
        return f"the authors' script: no finished run in `{folder}`", ""

    def seeds(side, attention):
        rows = df[(df.side == side) & (df.attention == attention)
                  & (df.variant == ("script" if side == "authors" else OURS_VARIANT))]
        return Seeds(tuple(float(v) for v in rows.metric)) if len(rows) else None

    size = (f"N = {int(first.copy_n)}, {int(first.n_layers)} layers, {int(first.n_heads)} x {int(first.d_query)}, "
            f"{int(first.steps):,} updates")
    parts, said = [], ""
    for side, who in (("authors", "their script"), ("ours", f"ours on their architecture ({OURS_VARIANT})")):
        lin, soft = seeds(side, "linear"), seeds(side, "softmax")
        if lin is None or soft is None:
            continue
        text = f"{who}: linear {lin.text('{:#.2g}').replace('seeds', 'runs')}, softmax " \
               f"{soft.text('{:#.2g}').replace('seeds', 'runs')}"
        if min(lin.n, soft.n) >= 2:
            g = welch(lin, soft)
            text += f", linear {g.diff:#.2g} above (95 % CI [{g.lo:#.2g}, {g.hi:#.2g}])"
            if side == "authors":
                said = ("the authors' script shows the same gap: its linear stays above its softmax beyond the "
                        f"tolerance at {size}" if g.lo > COPY_LOSS_TOL else
                        f"the authors' script brings linear to softmax's loss at {size}" if g.hi <= COPY_LOSS_TOL
                        else f"the authors' script leaves the gap undecided at {size}")
        parts.append(text)
    differs = sorted({str(v) for v in df.get("not_matched", pd.Series(dtype=str)).dropna() if str(v) != "none"})
    here = (f"the authors' copy script beside ours at {size}: " + "; ".join(parts)
            + (f" (not matched: {'; '.join(differs)})" if differs else "") + f" (`{folder}`)")
    return here, said


def copy_sweep_claim(results: Path, folder: str | None, baseline: str | None,
                     fidelity: str | None = None) -> Claim:
    """Measurements, not a verdict: linear's held-out copy loss at N = 128 in each cell of the sweep
    (each a subfolder: one change of width, heads or updates from the judged run), beside softmax at
    the same width (the cell's own, else the judged run's) and the judged run's linear, and the
    authors' script at the judged run's settings (authors_copy). The words say what the cells show:
    which change brings linear to softmax's loss, if any."""
    paper_text = f"the paper's model: {paper.FIGURE2_SETUP}"
    if folder is None or not (results / folder).is_dir():
        return _missing(SWEEP_CLAIM, paper_text, folder)
    runs, unfinished = {}, []
    base_path = results / str(baseline) / "copy_rows.jsonl"
    for path in [base_path] * base_path.exists() + sorted((results / folder).glob("*/copy_rows.jsonl")):
        rows = pd.DataFrame(read_rows(path, results, COPY_ROWS))
        final = rows[(rows.kind == "final") & (rows.status == "ok")]
        name = path.parent.relative_to(results).as_posix()
        if final.empty:  # every run of the cell failed or none finished: nothing to show but that
            unfinished.append(f"no finished run in `{name}`")
            continue
        runs[name] = (_cell(final), _seeds(final, "eval_loss"))
    base = runs.get(str(baseline))
    softmax = {c["d_model"]: by["softmax"] for c, by in runs.values() if "softmax" in by}
    parts, reached = [], []
    for name, (c, by) in runs.items():
        if "linear" not in by:
            continue
        ref = by.get("softmax") or softmax.get(c["d_model"])
        line = f"{_cell_text(c)}: linear {by['linear'].text('{:#.2g}')}"
        if ref is not None and min(ref.n, by["linear"].n) >= 2:
            g = welch(by["linear"], ref)
            line += f", {g.diff:#.2g} above softmax's {ref.mean:#.2g} (95 % CI [{g.lo:#.2g}, {g.hi:#.2g}])"
            reached += [_cell_text(c)] if g.hi <= COPY_LOSS_TOL else []
        elif ref is not None:  # too few seeds for an interval: the values alone
            line += f", softmax {ref.text('{:#.2g}')}"
        shown = name[len(folder) + 1:] if name.startswith(f"{folder}/") else name  # a cell: its own name
        parts.append(f"{line} (`{shown}`)")
    parts += unfinished
    if base is None or "linear" not in base[1]:
        return Claim(SWEEP_CLAIM, paper_text, "; ".join(parts) + f"; the cells in (`{folder}`)",
                     f"{MEASURED}: no judged run to compare with")
    b_cell, b_lin = base[0], base[1]["linear"].mean
    changes = {"width": [], "per-head state": [], "budget": []}
    for name, (c, by) in runs.items():
        if name == str(baseline) or "linear" not in by:
            continue
        kind = ("budget" if c.get("max_steps") != b_cell.get("max_steps") else
                "width" if c["d_model"] != b_cell["d_model"] else "per-head state")
        what = {"budget": f"{c.get('max_steps', 0):,} updates",
                "width": f"d_model {c['d_model']} ({c['n_heads']} x {c['d_model'] // c['n_heads']})",
                "per-head state": f"{c['n_heads']} x {c['d_model'] // c['n_heads']}"}[kind]
        changes[kind].append(f"{what} {by['linear'].mean:#.2g}")
    said = "; ".join(f"{k}: {', '.join(v)}" for k, v in changes.items() if v)
    verdict = (f"{MEASURED}: linear reaches softmax's loss (within {COPY_LOSS_TOL:g}) at " + "; ".join(reached)
               if reached else f"{MEASURED}: no cell brings linear to softmax's loss (within {COPY_LOSS_TOL:g})")
    theirs, theirs_said = authors_copy(results, fidelity)
    return Claim(SWEEP_CLAIM, paper_text, "; ".join(parts) + f"; the cells in (`{folder}`)"
                 + (f"; {theirs}" if theirs else ""),
                 f"{verdict}; linear's loss from {b_lin:#.2g} at {_cell_text(b_cell)}, by the change made: {said}"
                 + (f"; {theirs_said}" if theirs_said else ""))


def _order_verdict(seeds: dict[str, Seeds], order: list[str]) -> tuple[str, str]:
    """The paper's order (best first) over seeds: reproduced when every neighbour pair is ordered
    beyond its interval, contradicted when any pair is inverted beyond it, else undecided."""
    judged = [(a, b, *below(seeds[a], seeds[b])) for a, b in zip(order, order[1:])]
    verdicts = [v for *_, v, _ in judged]
    overall = (REPRODUCED if all(v == REPRODUCED for v in verdicts) else
               CONTRADICTED if CONTRADICTED in verdicts else UNDECIDED if UNDECIDED in verdicts else verdicts[0])
    return overall, "; ".join(f"{a} < {b}: {v} ({why})" for a, b, v, why in judged)


def mnist_claims(results: Path, folder: str | None) -> list[Claim]:
    order = list(PAPER_MNIST_BPD)
    p1 = " < ".join(f"{a} {v}" for a, v in PAPER_MNIST_BPD.items()) + " (Table 1: equal epochs, 250 each)"
    c1, c2 = MNIST_CLAIMS
    cifar = {a: paper.BITS_PER_DIM["cifar10"][a][0] for a in ("linear", "softmax")}
    p2 = f"linear {cifar['linear']:.2f} < softmax {cifar['softmax']:.2f} (Table 2: CIFAR-10, 7 GPU-days each)"
    path = results / str(folder) / "image_rows.jsonl"
    if folder is None or not path.exists():
        return [_missing(c1, p1, folder), _missing(c2, p2, folder)]
    rows = pd.DataFrame(read_rows(path, results, MNIST_ROWS))
    lost = _failed(rows[(rows.kind == "final") & rows.attention.isin(order)])
    if lost:
        return _not_judged([(c1, p1), (c2, p2)], folder, lost)
    evals = rows[(rows.kind == "eval") & rows.attention.isin(order)].dropna(subset=["bits_per_dim"])
    missing = [a for a in order if a not in set(evals.attention)]
    if missing:
        return [Claim(c, p, f"`{folder}` lacks {', '.join(missing)}", f"{NOT_TESTABLE}: not run")
                for c, p in ((c1, p1), (c2, p2))]
    # each seed's last evaluation, unsmoothed (verdicts.py: finals are never smoothed)
    evals = evals.sort_values("step")
    last = evals.groupby(["attention", "seed"]).tail(1)
    seeds = _seeds(last, "bits_per_dim")
    steps = int(evals.step.max())
    verdict, why = _order_verdict(seeds, order)
    digits = _held_out_digits(rows)
    here1 = (f"held-out bits/dim after {steps} steps (each seed's last evaluation{digits}): "
             + ", ".join(f"{a} {seeds[a].text('{:.3f}')}" for a in order) + f" (`{folder}`)")
    out = [Claim(c1, p1, here1, f"{verdict}: {why}")]
    # equal time: the budget is the fastest attention's whole run in CPU time (process time: what
    # a dedicated core would take); each attention read off each seed's smoothed curve at the
    # steps it does in that time
    final = rows[rows.kind == "final"]
    ms = final.groupby("attention").cpu_time_per_step_ms.median()
    budget_s = min(steps * ms[a] for a in order) / 1e3
    done = {a: budget_s * 1e3 / ms[a] for a in order}
    at_time = {a: Seeds(tuple(float(np.interp(done[a], g.step, g.bits_per_dim))
                              for _, g in evals[evals.attention == a].groupby("seed"))) for a in ("linear", "softmax")}
    verdict, why = below(at_time["linear"], at_time["softmax"])
    here2 = (f"{budget_s:.0f} s of CPU time each (CPU ms/step: " + ", ".join(f"{a} {ms[a]:.0f}" for a in order)
             + f"): linear {at_time['linear'].text('{:.3f}')} ({done['linear']:.0f} steps), softmax "
             + f"{at_time['softmax'].text('{:.3f}')} ({done['softmax']:.0f} steps) (`{folder}`)")
    out.append(Claim(c2, p2, here2, f"{verdict}: {why}"))
    return out


FIGURE1_POINTS = Table("benchmark.csv", {"attention": str, "n": float, "time_per_sample_ms": float, "status": str})


def _slope_intervals(df) -> dict:
    """{attention: Student's 95 % interval of the slope of log time against log N} over its
    measured points (3 or more)."""
    out = {}
    for a, g in df[df.status == "ok"].dropna(subset=["time_per_sample_ms"]).groupby("attention"):
        if len(g) >= 3:
            slope, se = seed_slope(np.log(g.n.astype(float)), np.log(g.time_per_sample_ms.astype(float)))
            half = stats.t.ppf(0.5 + LEVEL / 2, len(g) - 2) * se
            out[a] = (slope - half, slope + half)
    return out


def figure1_claim(results: Path, folder: str | None) -> Claim:
    claim = "Figure 1: linear attention's time grows linearly with N, softmax's quadratically; linear reaches 65,536"
    paper_text = (f"log-log slopes: linear {paper.FIGURE1_SLOPES['linear']:g}, softmax "
                  f"{paper.FIGURE1_SLOPES['softmax']:g}; softmax stops at {paper.FIGURE1_LARGEST_N['softmax']:,} "
                  f"(memory, {paper.FIGURE1_HARDWARE}), linear reaches {paper.FIGURE1_LARGEST_N['linear']:,}")
    path = results / str(folder) / "summary.json"
    if folder is None or not path.exists():
        return _missing(claim, paper_text, folder)
    s = read_json(path, results)
    att, cross = s["attentions"], s.get("crossovers", {})
    if not {"linear", "softmax-math"} <= set(att):
        return Claim(claim, paper_text, f"`{folder}` lacks linear or softmax-math", f"{NOT_TESTABLE}: not run")
    ours = {"linear": att["linear"]["time_slope_all"], "softmax": att["softmax-math"]["time_slope_all"]}
    verdict, why = slopes(ours, paper.FIGURE1_SLOPES)

    def largest(a):
        failure = att[a].get("first_failure")
        return f"{a} {att[a]['largest_n']:,}" + (f" ({failure})" if failure else "")

    bench = results / str(folder) / "benchmark.csv"
    ci = _slope_intervals(read_table(bench, results, FIGURE1_POINTS)) if bench.is_file() else {}

    def interval(a):
        return f" [{ci[a][0]:.2f}, {ci[a][1]:.2f}]" if a in ci else ""
    here = (f"time slopes (95 % CI of the log-log fit): linear {ours['linear']:.2f}{interval('linear')}, softmax-math "
            f"(the N x N matrix, as the paper's) {ours['softmax']:.2f}{interval('softmax-math')}"
            + (f", SDPA softmax {att['softmax']['time_slope_all']:.2f}{interval('softmax')}" if "softmax" in att
               else "")
            + "; linear faster from N = " + ", ".join(f"{v['linear_faster_from_n']:,} ({k.split(' vs ')[1]})"
                                                       for k, v in cross.items() if v.get("linear_faster_from_n"))
            + "; largest N: " + ", ".join(largest(a) for a in ("linear", "softmax-math", "softmax") if a in att)
            + " (a CPU: a point stops at the run's time budget, or at its memory limit, a share of the "
              f"machine's free memory, where it is refused before it allocates) (`{folder}`)")
    reached = att["linear"]["largest_n"] >= paper.FIGURE1_LARGEST_N["linear"]
    stopped = "" if reached else f"; linear stopped at {att['linear']['largest_n']:,}"
    return Claim(claim, paper_text, here, f"{verdict}: {why}{stopped}")


def _seed_ratios(rows, slow: str, fast: str) -> list[float]:
    """Per seed, the slow attention's CPU time per update over the fast one's (runs of one seed ran
    in turn, so each pair shared the machine's load)."""
    final = pd.DataFrame([r for r in rows if r.get("kind") == "final" and r.get("cpu_time_per_step_ms")])
    if final.empty or not {slow, fast} <= set(final.attention):
        return []
    by = final.pivot_table(index="seed", columns="attention", values="cpu_time_per_step_ms")
    return [float(v) for v in (by[slow] / by[fast]).dropna()]


def _mean_interval(values: list[float]) -> tuple[float, float]:
    """Student's 95 % interval of the mean."""
    s = Seeds(tuple(values))
    half = stats.t.ppf(0.975, s.n - 1) * s.sd / math.sqrt(s.n)
    return s.mean - half, s.mean + half


def asr_claim(results: Path, folder: str | None) -> Claim:
    ref = PAPER_ASR_S_PER_EPOCH
    paper_ratio = ref["softmax"] / ref["linear"]
    claim = "Table 3: linear trains 3.3x faster per epoch than softmax (WSJ, ~800 frames)"
    paper = f"{ref['softmax']} s vs {ref['linear']} s per epoch ({paper_ratio:.1f}x)"
    path = results / str(folder) / "asr_table.csv"
    if folder is None or not path.exists():
        return _missing(claim, paper, folder)
    t = read_table(path, results, ASR_TABLE)
    lost = _failed(t[t.model.isin(["linear", "softmax", "softmax-math"])], "model")
    if lost:
        return Claim(claim, paper, f"`{folder}`: {lost}", f"{NOT_TESTABLE}: a run failed ({lost})")
    t = t.set_index("model")
    col = "cpu_s_per_epoch" if "cpu_s_per_epoch" in t and t.cpu_s_per_epoch.notna().all() else "s_per_epoch"
    ratios = {b: t.loc[b, col] / t.loc["linear", col] for b in ("softmax", "softmax-math") if b in t.index}
    base = "softmax-math" if "softmax-math" in ratios else "softmax"  # the paper's 2020 softmax materialised (N, N)
    rows = pd.Series(read_rows(results / folder / "asr_rows.jsonl", results, ASR_ROWS)[0])
    size = (f"batch {rows.batch_size}, {rows.model_n_layers} layers x {rows.model_n_heads} heads x "
            f"{rows.model_d_model // rows.model_n_heads}")
    per_update = t[col] * t.epochs / t.steps  # the time per update the epoch was extrapolated from
    kind = "CPU" if col.startswith("cpu") else "wall"
    here = (f"{t.mean_frames.iloc[0]:.0f} frames on average, {size}; {kind} s/update: "
            + ", ".join(f"{m} {per_update[m]:.2f}" for m in t.index) + "; linear "
            + ", ".join(f"{r:.2f}x faster than {b}" for b, r in sorted(ratios.items(), key=lambda x: -x[1]))
            + f" ({kind} time per epoch, extrapolated from {int(t.steps.min())} updates; softmax-math "
            + f"materialises the (N, N) matrix as the paper's softmax did) (`{folder}`)")
    verdict = speedup_verdict(ratios[base], paper_ratio)
    seeds = int(t.seeds.min()) if "seeds" in t else 1
    pairs = _seed_ratios(read_rows(results / folder / "asr_rows.jsonl", results, ASR_ROWS), base, "linear")
    if seeds < MIN_SEEDS:  # a speed from fewer seeds is a measurement, as every other claim's
        verdict = f"{MEASURED} ({seeds} seed(s); judged from {MIN_SEEDS})"
    elif len(pairs) >= 2:  # the seeds' interval of the ratio: reproduced only when all of it clears the rule
        lo, hi = _mean_interval(pairs)
        bar = paper_ratio / SPEEDUP_FACTOR
        verdict = (REPRODUCED if lo >= bar else speedup_verdict(hi, paper_ratio) if hi < bar else UNDECIDED) \
            + f" (per-seed ratio, 95 % CI [{lo:.2f}, {hi:.2f}] over {len(pairs)} seeds; the rule: {bar:.2f}x)"
    others = [f"{r:.2f}x against {b}" for b, r in ratios.items() if b != base]
    meaning = {"softmax-math": "the paper's softmax, which materialised the N x N matrix",
               "softmax": "SDPA softmax, what a user runs today"}
    return Claim(claim, paper, here, f"{verdict}: {ratios[base]:.2f}x against {base} ({meaning[base]})"
                 + "".join(f"; {o} ({meaning[o.split(' against ')[1]]})" for o in others))


def batch_claim(results: Path, folder: str | None) -> Claim:
    g = PAPER_MNIST_GPU_S_BATCH1
    ips = PAPER_MNIST_IMAGES_PER_S
    claim = ("Our observation, not the paper's claim (its Tables 1, 4 and 5 give one batch each): linear's lead "
             "over the key/value cache grows with the batch")
    paper = (f"MNIST: {g['stateful-softmax'] / g['linear']:.1f}x at batch 1, "
             f"{ips['linear'] / ips['stateful-softmax']:.0f}x in images/s (batch not stated)")
    path = results / str(folder) / "throughput.csv"
    if folder is None or not path.exists():
        return _missing(claim, paper, folder)
    t = read_table(path, results, BATCH_TABLE)
    t = t[t.status == "ok"].set_index(["method", "batch"])
    batches = sorted({b for m, b in t.index if m == "linear"} & {b for m, b in t.index if m == "stateful-softmax"})

    def mark(m, b):
        return "*" if t.loc[(m, b), "extrapolated"] else ""

    def leads(col):
        return {b: t.loc[("stateful-softmax", b), col] / t.loc[("linear", b), col] for b in batches}

    def listed(col):
        cache = "stateful-softmax"
        return ", ".join(f"batch {b}: {t.loc[('linear', b), col]:.3g}{mark('linear', b)} / "
                         f"{t.loc[(cache, b), col]:.3g}{mark(cache, b)} = {leads(col)[b]:.2f}x" for b in batches)

    kinds = [(c, k) for c, k in (("cpu_seconds_per_image", "CPU time"), ("seconds_per_image", "wall time"))
             if c in t and t[c].notna().all()]
    here = ("CPU, MNIST size, s/image linear / cache: " + "; ".join(f"{k}: {listed(c)}" for c, k in kinds)
            + f" (* extrapolated) (`{folder}`)")
    verdict = "; ".join(f"{growth_verdict(leads(c))} in {k}" for c, k in kinds)
    return Claim(claim, paper, here, f"{MEASURED} (an observation of one run): {verdict}")


GPU_MNIST = Table("bpd_final.csv", {"attention": str, "status": str}, {"steps": float, "time_per_step_ms": float})
GPU_GENERATION = Table("throughput.csv", {"size": str, "method": str, "batch": float, "seconds_per_image": float,
                                          "images_per_s": float, "extrapolated": str, "status": str})


def gpu_claims(results: Path, folder: str | None, mnist: str | None, cpu_batch: str | None = None) -> list[Claim]:
    """The H100 runs beside the CPU verdicts, as measurements (one run each): generation at batch 1
    and at the largest batch against the key/value cache and re-running the prefix (`folder`), and
    one MNIST training step at the paper's model (`mnist`); set beside the CPU's batch-1 lead
    (`cpu_batch`: the batch claim's run). A value marked * is extrapolated from part of an image."""
    out = []
    g, ips = PAPER_MNIST_GPU_S_BATCH1, PAPER_MNIST_IMAGES_PER_S
    c1 = "On a GPU at the paper's sizes: linear generates faster than the key/value cache at batch 1 (Table 5)"
    p1 = (f"MNIST {g['linear']} s against {g['stateful-softmax']} s per image; CIFAR-10 "
          f"{paper.SECONDS_PER_IMAGE['cifar10']['linear'][1]} s against "
          f"{paper.SECONDS_PER_IMAGE['cifar10']['stateful-softmax'][1]} s (one GPU)")
    c2 = "On a GPU at a large batch: linear's lead over the key/value cache (Tables 1/4, images/s)"
    p2 = f"MNIST {ips['linear'] / ips['stateful-softmax']:.0f}x (batch not stated)"
    path = results / str(folder) / "throughput.csv"
    if folder is not None and path.exists():
        t = read_table(path, results, GPU_GENERATION)
        t = t[t.status == "ok"].set_index(["size", "method", "batch"])

        def value(size, method, batch, col="seconds_per_image"):
            r = t.loc[(size, method, batch)]
            return r[col], f"{r[col]:.3g}{'*' if extrapolated(r) else ''}"

        big = int(max((b for *_, b in t.index), default=1))
        sizes = [s for s in ("mnist", "cifar") if (s, "linear", 1) in t.index and (s, "stateful-softmax", 1) in t.index]
        shown1, slower = [], []
        for size in sizes:
            (lin, lin_txt), (kv, kv_txt) = value(size, "linear", 1), value(size, "stateful-softmax", 1)
            prefix = value(size, "softmax", 1)[1] if (size, "softmax", 1) in t.index else "not run"
            shown1.append(f"{size} s/image: linear {lin_txt}, the cache {kv_txt}, re-running the prefix {prefix}")
            slower += [size] if lin > kv else []
        cpu = _cpu_batch1_lead(results, cpu_batch)
        differs = f"; differs from the CPU run, where linear is {cpu:.2f}x faster at batch 1" if slower and cpu else ""
        out.append(Claim(c1, p1, "H100, batch 1, fp32: " + "; ".join(shown1) + f" (* extrapolated) (`{folder}`)",
                         f"{MEASURED} (one run): linear "
                         + (f"slower than the cache on {', '.join(slower)}" if slower else "faster than the cache")
                         + differs))
        shown2 = []
        for size in sizes:
            if (size, "linear", big) in t.index and (size, "stateful-softmax", big) in t.index:
                (lin, lin_txt), (kv, kv_txt) = (value(size, m, big, "images_per_s")
                                                for m in ("linear", "stateful-softmax"))
                shown2.append(f"{size} images/s: linear {lin_txt}, the cache {kv_txt}, {lin / kv:.2f}x")
        out.append(Claim(c2, p2, f"H100, batch {big}, fp32: " + "; ".join(shown2) + f" (* extrapolated) (`{folder}`)",
                         f"{MEASURED} (one run)"))
    else:
        out += [_missing(c1, p1, folder), _missing(c2, p2, folder)]
    c3 = "Not the paper's: one training step of the paper's MNIST model (8 layers, d_model 256, batch 10, fp32)"
    path = results / str(mnist) / "bpd_final.csv"
    if mnist is not None and path.exists():
        t = read_table(path, results, GPU_MNIST).set_index("attention")
        ms = {a: t.loc[a, "time_per_step_ms"] for a in ("linear", "softmax")
              if a in t.index and "time_per_step_ms" in t and pd.notna(t.loc[a, "time_per_step_ms"])}
        here = ("H100: " + (", ".join(f"{a} {v:.0f} ms per step" for a, v in ms.items()) or "no step times")
                + f" (`{mnist}`)")
        verdict = f"{MEASURED} (one run)" + (f": linear {ms['linear'] / ms['softmax']:.2f}x softmax's time"
                                             if len(ms) == 2 else "")
        out.append(Claim(c3, "not stated", here, verdict))
    else:
        out.append(_missing(c3, "not stated", mnist))
    return out


def _cpu_batch1_lead(results: Path, folder: str | None) -> float | None:
    """How many times faster than the cache linear generates at batch 1 in the CPU claim run
    (batch_claim's folder, CPU time), or None."""
    path = results / str(folder) / "throughput.csv"
    if folder is None or not path.exists():
        return None
    t = read_table(path, results, BATCH_TABLE)
    t = t[(t.status == "ok") & (t.batch == 1)].set_index("method")
    col = "cpu_seconds_per_image" if "cpu_seconds_per_image" in t else "seconds_per_image"
    if not {"linear", "stateful-softmax"} <= set(t.index):
        return None
    return float(t.loc["stateful-softmax", col] / t.loc["linear", col])


def untestable() -> list[Claim]:
    return [Claim("Tables 1/2: the absolute bits/dim (MNIST 0.62-0.75, CIFAR-10 3.39-3.51)",
                  "250 epochs (MNIST), 7 GPU-days per model (CIFAR-10)",
                  "the CPU runs see ~1,500x fewer images with a ~75x smaller model; no CIFAR-10 offline",
                  f"{NOT_TESTABLE}: needs a GPU (experiment=paper_mnist, paper_cifar)"),
            Claim("Table 3: the error rates (PER 5.12-10.94 %)", "WSJ, 80 h of licensed speech",
                  "a generated corpus stands in", f"{NOT_TESTABLE}: needs WSJ and a GPU (experiment=paper_wsj)")]


def _unjudged(make, results_dir, folder, names):
    """make(results_dir, folder), or, where a run holds a non-finite value (a diverged seed), its
    claims shown as not judged with the reason: a verdict is never computed from a NaN."""
    try:
        return make(results_dir, folder)
    except ValueError as err:
        if "non-finite" not in str(err):
            raise
        return [Claim(name, "", f"a run holds a non-finite value: {err}", f"{NOT_TESTABLE}: {err}")
                for name in names]


def claims(results_dir: Path, manifest: Manifest | None = None) -> list[Claim]:
    """Every claim, each judged from the folder the manifest (results_dir's claims.yaml unless
    given) names for it."""
    results_dir = Path(results_dir)
    named = (manifest or manifests.load(results_dir)).claim
    return [figure1_claim(results_dir, named("figure1")),
            *_unjudged(copy_claims, results_dir, named("copy"), COPY_CLAIMS),
            copy_sweep_claim(results_dir, named("copy_sweep"), named("copy"), named("copy_authors")),
            *_unjudged(mnist_claims, results_dir, named("mnist"), MNIST_CLAIMS),
            asr_claim(results_dir, named("asr")), batch_claim(results_dir, named("batch")),
            *gpu_claims(results_dir, named("gpu_generation"), named("gpu_mnist"), named("batch")), *untestable()]


def section(results_dir: Path, manifest: Manifest | None = None) -> str:
    """The claims table in markdown (for the report and the README)."""
    rows = claims(results_dir, manifest)
    cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
    lines = ["| Claim | Paper | Here (CPU-sized runs; the GPU rows: one H100 run each) | Verdict |",
             "|---|---|---|---|"]
    lines += [f"| {cell(r.claim)} | {cell(r.paper)} | {cell(r.here)} | **{cell(r.verdict)}** |" for r in rows]
    return "\n".join(lines) + "\n"


def claims_section(ctx) -> str:
    """The paper's claims, one verdict each, from the runs the manifest names (claims below)."""
    return ("## Does it reproduce the paper's claims?\n\nEach claim a CPU can speak to, put to the one CPU-sized run "
            "`results/claims.yaml` names for it (the `*_claims_cpu` presets in `conf/experiment/`; each folder's "
            "README holds its command, git SHA and machine load). The learning claims are judged over at least 5 "
            "seeds a side, each "
            "seed's final value unsmoothed, from Welch's 95 % interval of the gap: reproduced or contradicted "
            "only where the interval excludes 0 on that side, else undecided at this scale with the smallest "
            "gap the runs could have detected; fewer seeds are shown as a measurement with their interval. Rules: "
            "`repro/reproduction/verdicts.py`, their use: "
            "`repro/reproduction/report/claims.py`.\n\n" + section(ctx.root, ctx.manifest).rstrip())


SECTIONS = [(5, "claims", claims_section)]


if __name__ == "__main__":
    from repro.reproduction.report.schema import SchemaError

    try:
        sys.stdout.write(section(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "results"))
    except (SchemaError, ManifestError) as err:  # a damaged results file or manifest: one line naming it
        raise SystemExit(f"error: {err}") from None
