"""Beyond the paper: linear attention's successors (retention, gated linear attention, the delta
rule) on the paper's copy task, one judged question over seeds: does each copy better than
linear where linear's additive memory runs out (the CPU-sized N = 128 run)? Their speed and
memory are in the Figure 1, kernel and CPU-speed sections, as measurements beside softmax and
linear."""
import pandas as pd

from repro.reproduction import verdicts
from repro.reproduction.report.figure2 import COPY_ROWS
from repro.reproduction.report.format import code, command, hardware, md_table
from repro.reproduction.report.schema import failed as lost
from repro.reproduction.report.schema import read_rows

FOLDER = "copy/successors_n128_cpu"  # experiment=copy_successors_cpu publishes here
SUCCESSORS = ("retention", "gla", "delta")
ANSWER = {verdicts.REPRODUCED: "yes", verdicts.CONTRADICTED: "no: worse than linear",
          verdicts.UNDECIDED: "a tie: undecided at this scale", verdicts.MEASURED: "measured, not judged"}


def answer(successor: verdicts.Seeds, linear: verdicts.Seeds) -> str:
    """Lower held-out loss is better: `successor` below `linear` by more than the spread is a yes."""
    verdict, why = verdicts.below(successor, linear)
    return f"{ANSWER[verdict]} ({why})"


def successors(ctx) -> str:
    path = ctx.root / FOLDER / "copy_rows.jsonl"
    if not path.is_file():
        return ""
    ctx.used.add(path.parent)
    rows = pd.DataFrame(read_rows(path, ctx.root, COPY_ROWS))  # a missing field: one error, never a KeyError
    final = rows[rows.kind == "final"]
    failed = final[final.status.map(lost)]
    ok = final[~final.index.isin(failed.index)]
    seeds = {a: verdicts.Seeds(tuple(float(v) for v in g.sort_values("seed").eval_loss))
             for a, g in ok.groupby("attention")}
    first = rows.iloc[0]
    table = []
    for att in ("linear", *SUCCESSORS):
        if att not in seeds:
            table.append([att, "not run" if att not in set(final.attention) else "failed", None, None, None])
            continue
        g = ok[ok.attention == att]
        table.append([att, seeds[att].text("{:#.3g}"), f"{100 * g.eval_accuracy.mean():.1f} %",
                      g.time_per_step_ms.mean() if "time_per_step_ms" in g else None,
                      answer(seeds[att], seeds["linear"]) if att != "linear" and "linear" in seeds else "—"])
    out = ["## Beyond the paper: linear attention's successors",
           "The paper's linear attention updates its memory additively, S_i = S_{i-1} + phi(k_i) v_i^T. Its "
           "successors change only that update: retention decays it by a fixed gamma per head, gated linear "
           "attention by a learned decay per key dimension, and the delta rule writes over what a key held "
           "(docs/attention.md). One question, judged over the seeds by the rules of the claims above (a gap "
           "inside the spread is a tie): on the copy task at the paper's N = 128, where the CPU-sized model's "
           "linear attention no longer copies every symbol (a 16 x 16 state per head), does each successor "
           "reach a lower held-out loss than linear? Their time and memory against N are in Figure 1's runs "
           "and the kernel and CPU-speed sections.",
           f"### {FOLDER}\n\nHardware: {hardware(rows)}  \nCommand: {code(command(path.parent, ctx.root))}  \n"
           f"Setup: N = {first.max_len}, copies of {first.min_copy}-{first.max_copy} symbols, {first.n_layers} "
           f"layers, d_model {first.d_model}, {int(final.steps.max()) if len(final) else 0:,} updates per run",
           md_table(["attention", "held-out loss (nats/symbol), mean ± sd", "symbols right", "ms/step",
                     "copies better than linear?"], table)]
    for _, r in failed.iterrows():
        out.append(f"Failed, left out: {r.attention} seed {r.seed}: {r.status}.")
    return "\n\n".join(out)


SECTIONS = [(70, "successors", successors)]
