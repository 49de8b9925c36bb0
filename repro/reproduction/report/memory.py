"""Memory of whole models in training (python -m repro.reproduction.model_memory's
model_memory.csv): per preset, what one training step keeps for backward (exact) and its peak
resident memory (median and range over rounds), linear attention set against softmax."""

from repro.reproduction.report.format import code, command, hardware, md_table, num
from repro.reproduction.report.schema import Table

TABLES = [Table("model_memory.csv", {"preset": str, "attention": str, "n": float, "batch": float, "kept_mb": float,
                                     "peak_mb": float, "peak_min_mb": float, "peak_max_mb": float},
                {"device": str, "rounds": float, "peak_alloc_mb": float})]


def against(lin, soft) -> str:
    """Linear's peak against softmax's: below, within the two ranges' overlap, or above beyond it."""
    if lin.peak_max_mb < soft.peak_min_mb:
        return "below"
    if lin.peak_min_mb > soft.peak_max_mb:
        return f"above by {num(float(lin.peak_mb - soft.peak_mb))} MB (beyond the spread)"
    return "within the spread"


def memory(ctx) -> str:
    out = ["## Memory of whole models in training",
           "Not a table of the paper (its Figure 1 measures one layer): one training step (forward, backward, "
           "optimizer) of the copy and MNIST models at the sizes of our presets. Kept for backward: the bytes "
           "autograd saves, counted exactly over distinct storages, parameters included; peak allocated: the "
           "most bytes torch's allocator held during the step above what it held before (exact, from the "
           "profiler's record of every allocation); peak resident: resident memory above what was live before "
           "the step (the C library's slack included), median and range over rounds run in fresh processes, "
           "the attentions interleaved."]
    found = ctx.named("memory", "model_memory.csv")
    if not found:
        return ""
    for folder, df in found:
        rows = []
        for preset, g in df.groupby("preset", sort=False):
            by = {str(r.attention): r for _, r in g.iterrows()}
            for att, r in by.items():
                rows.append([preset, int(r.n), int(r.batch), att, r.kept_mb, r.get("peak_alloc_mb"),
                             f"{num(float(r.peak_mb))} ({num(float(r.peak_min_mb))}-{num(float(r.peak_max_mb))})"])
            if {"linear", "softmax"} <= set(by):
                lin, soft = by["linear"], by["softmax"]
                alloc = (f"{num(float(lin.peak_alloc_mb / soft.peak_alloc_mb))}x"
                         if "peak_alloc_mb" in lin and lin.peak_alloc_mb == lin.peak_alloc_mb else None)  # not NaN
                rows.append([preset, int(lin.n), int(lin.batch), "linear / softmax",
                             f"{num(float(lin.kept_mb / soft.kept_mb))}x", alloc, against(lin, soft)])
        out.append(f"### {folder.relative_to(ctx.root)}\n\nHardware: {hardware(df)}  \n"
                   f"Command: {code(command(folder, ctx.root))}\n\n"
                   + md_table(["preset", "N", "batch", "attention", "kept for backward (MB)",
                               "peak allocated (MB, exact)", "peak resident (MB; min-max)"], rows))
    return "\n\n".join(out)


SECTIONS = [(75, "memory", memory)]
