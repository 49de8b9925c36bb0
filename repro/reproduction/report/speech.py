"""Table 3: speech recognition, phoneme error rate and seconds per epoch (the CSVs with a PER
column per model, the speech task's asr_table.csv, of the folders results/claims.yaml names)."""
import re

import pandas as pd

from repro.common import paper
from repro.reproduction.manifest import ManifestError
from repro.reproduction.report.format import code, command, hardware, md_table, num, run_rows
from repro.reproduction.report.schema import Table, failed

PER_COLUMNS = ("valid_per_%", "per_%", "per", "eval_per", "valid_per", "test_per_%", "test_per")
TABLES = [Table("*.csv", {col: float}, {"seconds_per_epoch": float, "s_per_epoch": float, "cpu_s_per_epoch": float,
                                        "steps": float}, when=col)
          for col in PER_COLUMNS]
# the speech task's own table, by name: one that lost its seconds or its status fails, never shows "—" for them
TABLES.append(Table("asr_table.csv", {"model": str, "steps": float, "s_per_epoch": float, "status": str},
                    {"cpu_s_per_epoch": float}))
NOT_RECORDED = "not recorded"  # a column an older or another table never had (no CPU time, no seconds)


def _asr_device(df, folder) -> str:
    """The device named by the table, else by the run rows beside it."""
    return hardware(df if "device" in df else pd.DataFrame(run_rows(folder)))


def is_timing_run(df, folder) -> bool:
    """A run made to time epochs, not to train (its label, in the table or in the run rows beside
    it, says "timing run"): its error rates are those of an untrained model, not results."""
    labels = list(df["label"].dropna()) if "label" in df else [r.get("label") for r in run_rows(folder)]
    return any(re.search(r"\btiming run\b", str(label), re.I) for label in labels if label)


def asr_tables_of(csvs):
    """(path, table, PER column, name column, seconds column) of every CSV with a PER per model."""
    out = []
    for path, df in csvs:
        # a column named ..._% holds percentages; otherwise a fraction when <= 1
        col = next((c for c in ("valid_per_%", "per_%", "per", "eval_per", "valid_per", "test_per_%", "test_per")
                    if c in df), None)
        name_col = next((c for c in ("attention", "model") if c in df), None)
        secs = next((c for c in ("seconds_per_epoch", "s_per_epoch") if c in df), None)
        if col is not None and name_col is not None:
            out.append((path, df, col, name_col, secs))
    return out


def seconds_per_epoch_text(r, col, steps) -> str | None:
    """Seconds per epoch, marked with the updates it comes from: the task times the median update
    and multiplies it by the updates of one epoch, so a short timing run is an extrapolation."""
    if col is None or col not in r:
        return NOT_RECORDED
    value = r[col]
    if pd.isna(value):
        return None
    return num(float(value)) + (f" (from {int(steps)} updates)" if steps is not None and pd.notna(steps) else "")


def table_3(ctx) -> str:
    root = ctx.root
    asr_tables = asr_tables_of(ctx.tables("table_3"))
    lacking = [f for f in ctx.manifest.paths("table_3") if f not in {path.parent for path, *_ in asr_tables}]
    if lacking:
        raise ManifestError(f"report.table_3: {lacking[0].relative_to(root)} holds no table of PER per model")
    out = ["## Table 3: speech recognition (WSJ), phoneme error rate and seconds per epoch",
           f"Paper: WSJ 80 h, CTC over phonemes, {paper.ASR_HARDWARE}. Ours: the ASR task on the corpus its "
           "folder names (see its command); validation PER, as the paper reports. A timing run (a few updates "
           "of an untrained model, its label says so) gives seconds per epoch only: its PER is no result. "
           "Our seconds per epoch are the median time of one update times the updates of one epoch, marked with "
           "the number of updates timed; wall-clock and, where recorded, this process's CPU time (the measure "
           "that a shared machine's load moves least). The paper's softmax materialised the N x N matrix: our "
           "softmax-math does the same, our softmax is torch's SDPA (what a user runs today)."]
    headers = ["paper's model", "ours", "paper PER %", "our PER %", "paper s/epoch", "our s/epoch, wall",
               "our s/epoch, CPU time"]
    tables = []
    for path, df, col, name_col, secs in asr_tables:
        folder = path.parent
        timing = is_timing_run(df, folder)
        found = {}
        for _, r in df.iterrows():
            lost = "status" in r and failed(r.status)  # a diverged run: its numbers are no result
            if pd.isna(r[col]) and not lost:
                continue
            per = f"failed ({r.status})" if lost else float(r[col]) * (
                1 if col.endswith("%") or float(r[col]) > 1 else 100)
            steps = r.get("steps")
            found[str(r[name_col]).lower().replace("-lstm", "lstm").replace("_", "")] = (
                "timing run" if timing and not lost else per, seconds_per_epoch_text(r, secs, steps),
                seconds_per_epoch_text(r, "cpu_s_per_epoch", steps))
        rows = []
        for name, (p_per, p_s) in paper.ASR.items():
            ours = [o for o in paper.FIGURE1_OURS.get(name, [name]) if o in found] or [name]
            rows += [[name, o, p_per, *(found[o][:1] if o in found else ["not run here"]), p_s,
                      *(found[o][1:] if o in found else [None, None])] for o in ours]
        tables.append(f"### {folder.relative_to(root)}{' (timing run)' if timing else ''}\n\n"
                      f"Hardware: {_asr_device(df, folder)}  \n"
                      f"Command: {code(command(folder, root))}\n\n" + md_table(headers, rows))
    if not tables:
        tables = [md_table(headers, [[name, name, p_per, "not yet run", p_s, None, None]
                                     for name, (p_per, p_s) in paper.ASR.items()])]
    return "\n\n".join(out + tables)


SECTIONS = [(60, "table_3", table_3)]
