"""Figure 2: the copy task (task=copy's copy_final.csv, its curves and its run rows)."""
import pandas as pd

from repro.common import paper
from repro.reproduction.report.format import code, command, hardware, md_table, num
from repro.reproduction.report.schema import Rows, Table, failed, read_rows

# what task=copy's aggregate writes; a spread needs two seeds (a single seed's is empty, not missing)
NEEDED = {"max_len": float, "attention": str, "n_seeds": float, "steps": float, "eval_loss": float,
          "eval_accuracy": float, "time_per_step_ms": float, "status": str}
# the run rows task=copy publishes beside it, as the claims and the successors' section read them
COPY_ROWS = Rows("copy_rows.jsonl", {
    "*": {"kind": str, "attention": str, "max_len": float, "min_copy": float, "max_copy": float, "n_layers": float,
          "d_model": float},
    "eval": {"seed": float, "step": float, "loss": float},
    "final": {"seed": float, "steps": float, "eval_loss": float, "eval_accuracy": float, "status": str}})
TABLES = [Table("copy_final.csv", NEEDED,
                {"eval_loss_std": float, "eval_accuracy_std": float, "device": str})]


def _scored(rows) -> str:
    """What the run's loss scores: the copy alone (ours), or the separator's prediction too (the
    authors' copy script, task.score_separator); runs from before the option scored the copy."""
    flags = {bool(r.get("score_separator", False)) for r in rows}
    return " / ".join("copy + separator" if f else "copy" for f in sorted(flags)) or "copy"


def _mean_sd(r, key) -> str | None:
    if failed(r.status):  # a diverged or stopped run: its numbers are no result
        return f"failed ({r.status})"
    mean, sd = r.get(key), r.get(f"{key}_std")
    if mean is None or pd.isna(mean):
        return None
    return f"{num(float(mean))} ± {num(float(sd))}" if sd is not None and pd.notna(sd) else num(float(mean))


def figure2(ctx) -> str:
    root, rel = ctx.root, ctx.rel
    out = ["## Figure 2: the copy task", f"Paper ({paper.FIGURE2_SETUP}): {paper.FIGURE2_CLAIM}. Ours: each run's "
           "loss scores the copy alone (a perfect copier reaches 0) unless it says it also scores the prediction "
           "of the separator, as the authors' copy script does (task.score_separator); the two are not comparable."]
    found = ctx.named("figure2", "copy_final.csv")
    if not found:
        return "\n\n".join(out + ["not yet run"])
    for folder, df in found:
        rows_file = folder / "copy_rows.jsonl"
        run_rows = read_rows(rows_file, root) if rows_file.is_file() else []
        hw = hardware(pd.DataFrame(run_rows)) if run_rows else hardware(df)
        out.append(f"### {folder.relative_to(root)}\n\nHardware: {hw}  \nCommand: {code(command(folder, root))}  \n"
                   f"Scored: {_scored(run_rows)}")
        rows = [[r.max_len, r.attention, r.get("n_seeds"), r.get("steps"), _mean_sd(r, "eval_loss"),
                 _mean_sd(r, "eval_accuracy"), r.get("time_per_step_ms"), "curves only"] for _, r in df.iterrows()]
        out.append(md_table(["N", "attention", "seeds", "steps", "our held-out loss (mean ± sd over seeds)",
                             "our held-out accuracy", "our ms/step", "paper"], rows))
        for png in ("copy_curves.png", "copy_lengths.png"):
            if (folder / png).is_file():
                out.append(f"![{png}]({rel(folder / png)})")
    return "\n\n".join(out)


SECTIONS = [(20, "figure2", figure2)]
