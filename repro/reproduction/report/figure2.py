"""Figure 2: the copy task (task=copy's copy_final.csv, its curves and its run rows)."""
import pandas as pd

from repro.common import paper
from repro.reproduction.report.format import code, command, hardware, md_table
from repro.reproduction.report.schema import Table, named, read_rows

TABLES = [Table("copy_final.csv", {"max_len": float, "attention": str},
                {"n_seeds": float, "steps": float, "eval_loss": float, "eval_accuracy": float,
                 "time_per_step_ms": float, "device": str})]


def figure2(ctx) -> str:
    root, rel, csvs = ctx.root, ctx.rel, ctx.csvs
    out = ["## Figure 2: the copy task", f"Paper ({paper.FIGURE2_SETUP}): {paper.FIGURE2_CLAIM}."]
    found = named(csvs, "copy_final.csv")
    ctx.used |= {folder for folder, _ in found}
    if not found:
        return "\n\n".join(out + ["not yet run"])
    for folder, df in found:
        rows_file = folder / "copy_rows.jsonl"
        hw = hardware(pd.DataFrame(read_rows(rows_file, root))) if rows_file.is_file() else hardware(df)
        out.append(f"### {folder.relative_to(root)}\n\nHardware: {hw}  \nCommand: {code(command(folder, root))}")
        rows = [[r.max_len, r.attention, r.get("n_seeds"), r.get("steps"), r.get("eval_loss"), r.get("eval_accuracy"),
                 r.get("time_per_step_ms"), "curves only"] for _, r in df.iterrows()]
        out.append(md_table(["N", "attention", "seeds", "steps", "our held-out loss", "our held-out accuracy",
                             "our ms/step", "paper"], rows))
        for png in ("copy_curves.png", "copy_lengths.png"):
            if (folder / png).is_file():
                out.append(f"![{png}]({rel(folder / png)})")
    return "\n\n".join(out)


SECTIONS = [(20, "figure2", figure2)]
