"""Tables 1, 2, 4 and 5: image generation. Bits/dim from the CSVs with a bits/dim column (the
image task's bpd_final.csv), images/s and seconds per image from task=throughput's
throughput.csv; and the GPU MNIST step's bits/dim against time.

A column holds one run, the one results/claims.yaml names for it: bits/dim from one folder per
hardware (report.tables_1_2.bits_per_dim), images/s and seconds per image from one throughput run
at one batch (report.tables_1_2.images_per_s, report.table_4, report.table_5), named under the
table with its command."""
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from repro.common import paper
from repro.common.results import run_load
from repro.reproduction.manifest import ManifestError
from repro.reproduction.report.format import (
    code,
    command,
    dataset_of,
    hardware,
    hw_class,
    md_table,
    num,
    run_rows,
)
from repro.reproduction.report.marks import extrapolated, loaded, marked, names
from repro.reproduction.report.schema import Rows, Table, failed, read_rows

BPD_COLUMNS = ("bits_per_dim", "eval_bits_per_dim", "test_bits_per_dim")
IMAGE_ROWS = Rows("image_rows.jsonl", {"*": {"attention": str}})  # a bits/dim folder's raw rows
TABLES = [Table("throughput.csv", {"size": str, "method": str, "batch": float, "images_per_s": float,
                                   "seconds_per_image": float, "status": str, "device": str},
                {"loadavg_1min_start": float, "loadavg_1min_end": float}),
          Table("bpd_vs_time.csv", {"attention": str, "step": float, "elapsed_s": float, "eval_bpd": float}),
          # by name too: a bpd_final.csv that lost its bits/dim column must fail, not stop being a bits/dim
          # table (Table 1's column would then come from another folder)
          Table("bpd_final.csv", {"attention": str, "eval_bits_per_dim": float, "status": str}, {"dataset": str}),
          *(Table("*.csv", {col: float}, {"attention": str, "device": str}, when=col) for col in BPD_COLUMNS)]


def _devices_by_attention(folder) -> dict:
    """{attention: device} from the run rows (.jsonl) beside a table whose rows do not name their
    device (the image task's bpd_final.csv)."""
    found = {}
    for r in run_rows(folder):
        if r.get("attention") and r.get("device"):
            found.setdefault(str(r["attention"]), set()).add(str(r["device"]))
    return {att: "; ".join(sorted(devices)) for att, devices in found.items()}


def bits_per_dim(csvs, root):
    """{(dataset, attention, hardware class): (value, folder, device)} from the CSVs with a bits/dim
    column of the folders the manifest names, one folder per dataset and class of hardware (a
    column never mixes folders: two folders of one class is a ManifestError naming them)."""
    found = {}
    for path, df in csvs:
        col = next((c for c in BPD_COLUMNS if c in df), None)
        if col is None or "attention" not in df:
            continue
        beside = {} if "device" in df else _devices_by_attention(path.parent)
        for _, r in df.iterrows():
            lost = "status" in r and failed(r.status)  # shown as failed, never as a value
            ds = dataset_of(r.get("dataset", r.get("task", "")))
            if ds and (lost or pd.notna(r[col])):
                device = str(r["device"]) if "device" in df else beside.get(str(r.attention), "")
                found.setdefault((ds, hw_class(device)), {}).setdefault(path.parent, {})[str(r.attention)] = (
                    f"failed ({r.status})" if lost else float(r[col]), path.parent, device)
    chosen = {}
    for (ds, cls), folders in found.items():
        if len(folders) > 1:
            names = " and ".join(str(f.relative_to(root)) for f in folders)
            raise ManifestError(f"report.tables_1_2.bits_per_dim: {names} both hold {ds} bits/dim on {cls}: "
                                "name one folder per hardware")
        chosen.update({(ds, att, cls): v for att, v in next(iter(folders.values())).items()})
    return chosen


@dataclass
class Run:
    """One throughput run (folder, batch) a column of a table shows, and its rows by (dataset, method)."""
    cls: str
    folder: Path | None = None
    batch: int | None = None
    rows: dict = field(default_factory=dict)
    quiet: bool = False  # named a quiet run in the manifest: its header says so
    repeats: dict = field(default_factory=dict)  # (dataset, method) -> every run's row, where the folder holds several


def column_runs(ctx, cells, section: str, part: str | None = None) -> list[Run]:
    """The columns the manifest names for a table (report.<section>[.<part>]), each one run at one
    batch with its rows of `cells` ((dataset, method) pairs); a folder that holds no throughput
    table, or rows of several kinds of hardware at that batch, is a ManifestError naming it."""
    where = f"report.{section}" + (f".{part}" if part else "")
    runs = []
    for column in ctx.manifest.columns(section, part):
        found = [df for path, df in ctx.csvs if path == column.folder / "throughput.csv"]
        if not found or not {"size", "method"} <= set(found[0]):
            raise ManifestError(f"{where}: {column.folder.relative_to(ctx.root)} holds no throughput.csv "
                                "(task=throughput's table)")
        df = found[0][found[0].batch == column.batch]
        classes = sorted(set(df["device"].astype(str).map(hw_class))) if "device" in df else []
        if len(classes) != 1:
            raise ManifestError(f"{where}: {column.folder.relative_to(ctx.root)} at batch {column.batch} holds "
                                + (f"rows of {' and '.join(classes)}: a column holds one hardware" if classes
                                   else "no rows"))
        every = {}
        for _, r in df.iterrows():
            every.setdefault((dataset_of(r["size"]), str(r.method)), []).append(r)
        rows = {k: v[-1] for k, v in every.items()}
        runs.append(Run(classes[0], column.folder, column.batch, {k: r for k, r in rows.items() if k in cells},
                        column.quiet, {k: v for k, v in every.items() if k in cells and len(v) > 1}))
    return runs


def by_hardware(runs: list[Run], classes) -> list[Run]:
    """The columns in the order of `classes` (CPU first), a "not yet run" one for a class with none."""
    return [run for cls in classes for run in ([r for r in runs if r.cls == cls] or [Run(cls)])]


def _cell(run: Run, ds, method, column) -> str:
    if run.folder is None:
        return "not yet run"
    r = run.rows.get((ds, method))
    if r is None:
        return "not in this run"
    if failed(r.status):  # oom, timeout, error: ...: never a value
        return str(r.status)
    runs = [x for x in run.repeats.get((ds, method), []) if not failed(x.status) and pd.notna(x[column])]
    if len(runs) > 1:  # the same command run several times: their range, one rule for every such cell
        values = sorted(float(x[column]) for x in runs)
        marks = names(any(map(extrapolated, runs)), any(map(loaded, runs)))
        return f"{num(values[0])}–{num(values[-1])} ({len(runs)} runs" + "".join(f", {m}" for m in marks) + ")"
    return marked(r[column], r) if pd.notna(r[column]) else "not measured"


def _header(quantity, run: Run) -> str:
    return (f"our {quantity}, {run.cls}" + (f", batch {run.batch}" if run.batch is not None else "")
            + (", quiet run" if run.quiet else ""))


def _run_note(run: Run, quantity, root) -> str | None:
    """One line under a table: which run a column shows, on what, and its command."""
    if run.folder is None:
        return None
    rows = list(run.rows.values()) + [r for every in run.repeats.values() for r in every]
    n_runs = max((len(every) for every in run.repeats.values()), default=1)
    device = "; ".join(dict.fromkeys(str(r.get("device", "")) for r in rows if str(r.get("device", ""))))
    shas = ", ".join(dict.fromkeys(str(r["git_sha"])[:7] for r in rows if pd.notna(r.get("git_sha"))))
    loads = [v for v in map(run_load, rows) if v is not None]
    load = f", 1-min load {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    runs = "one run" if n_runs == 1 else f"{n_runs} runs of one command (a cell they all measured: their range)"
    note = (f"{_header(quantity, run)[0].upper()}{_header(quantity, run)[1:]}: {runs}, "
            f"`{run.folder.relative_to(root)}` ({device or 'device not recorded'}{f', git {shas}' if shas else ''}"
            f"{load}): {code(command(run.folder, root))}")
    return note + "."


def gpu_classes(runs, bpd=None) -> list[str]:
    """The GPUs (by name) of a table's columns and bits/dim, in order."""
    return sorted(({run.cls for run in runs} | {cls for (_, _, cls) in (bpd or {})}) - {"CPU"})


GPU_NONE = "our GPU: not measured yet"


NOT_STATED = ("The paper does not state the batch it generated at; each of our columns names its batch. A value "
              "marked (extrapolated) comes from a generation stopped at its time budget and extrapolated "
              "(`positions_measured` in its throughput.csv); (loaded): the machine's 1-minute load average "
              "passed its number of cores during the run, so its wall-clock value is inflated.")


BY_HARDWARE = ("Our values are in columns by hardware (CPU, and each GPU by name), each column from the one "
               "run at one batch that `results/claims.yaml` names for it, named under the table with its command; "
               "`python -m repro.reproduce_gpu` fills the GPU columns.")


def chosen_bpd(ctx) -> dict:
    """bits_per_dim of the folders the manifest names for Tables 1 and 2, once per report."""
    if "bpd" not in ctx.memo:
        ctx.memo["bpd"] = bits_per_dim(ctx.tables("tables_1_2", "bits_per_dim"), ctx.root)
    return ctx.memo["bpd"]


def _commits(folder: Path, root) -> str:
    """', git <sha>' for the commit the folder's runs were made at, from its raw rows, or one sha
    per attention where they differ (runs added in later GPU windows): '' without raw rows."""
    path = folder / IMAGE_ROWS.name
    if not path.is_file():
        return ""
    by_sha = {}
    for r in read_rows(path, root, IMAGE_ROWS):
        if r.get("git_sha"):
            by_sha.setdefault(str(r["git_sha"])[:7], {})[r["attention"]] = None
    if len(by_sha) > 1:
        return ", git " + ", ".join(f"{sha} ({', '.join(atts)})" for sha, atts in by_sha.items())
    return f", git {next(iter(by_sha))}" if by_sha else ""


def _bpd_note(ctx, ds, cls) -> str | None:
    root, bpd = ctx.root, chosen_bpd(ctx)
    chosen = [v for (d, _, c), v in bpd.items() if (d, c) == (ds, cls)]
    if not chosen:
        return None
    source, devices = chosen[0][1], "; ".join(dict.fromkeys(v[2] for v in chosen if v[2]))
    return (f"Our bits/dim, {cls}: one run, `{source.relative_to(root)}` ({devices or 'device not recorded'}"
            f"{_commits(source, root)}): {code(command(source, root))}.")


def _generation_cells() -> set:
    return {(ds, m) for ds, methods in paper.IMAGES_PER_S.items() for m in methods}


def tables_1_2(ctx) -> str:
    root = ctx.root
    bpd = chosen_bpd(ctx)
    out = ["## Tables 1 and 2: image generation, bits/dim and images/s",
           "Paper: bits/dim on the test set and images/s of unconditional generation; Table 1 MNIST "
           f"({paper.IMAGES_SETUP['mnist']}), Table 2 CIFAR-10 ({paper.IMAGES_SETUP['cifar10']}). "
           f"Ours: bits/dim from the image task, images/s from task=throughput. {NOT_STATED} {BY_HARDWARE}"]
    named_runs = column_runs(ctx, _generation_cells(), "tables_1_2", "images_per_s")
    gpus = gpu_classes(named_runs, bpd)
    runs = by_hardware(named_runs, ["CPU", *gpus])
    for ds, name in [("mnist", "MNIST"), ("cifar10", "CIFAR-10")]:
        rows = []
        for method, (p_bpd, p_ips) in paper.BITS_PER_DIM[ds].items():
            bits = [bpd.get((ds, method, cls)) for cls in ["CPU", *gpus]]
            rows.append([method, p_bpd, *[b[0] if b else "not yet run" for b in bits], *([] if gpus else [None]),
                         p_ips, *[_cell(run, ds, method, "images_per_s") for run in runs],
                         *([] if gpus else [None])])
        header = ["method", "paper bits/dim", "our bits/dim, CPU", *[f"our bits/dim, {g}" for g in gpus],
                  *([] if gpus else [GPU_NONE]), "paper images/s", *[_header("images/s", run) for run in runs],
                  *([] if gpus else [GPU_NONE])]
        notes = [_bpd_note(ctx, ds, cls) for cls in ["CPU", *gpus]] + [_run_note(run, "images/s", root)
                                                                      for run in runs]
        out.append(f"### {paper.TABLES_1_2[ds]}: {name}\n\n" + md_table(header, rows))
        out += [n for n in notes if n]
    out += bpd_vs_time(ctx)
    return "\n\n".join(out)


def bpd_vs_time(ctx) -> list[str]:
    """The GPU MNIST step's held-out bits/dim against training time (reproduce_gpu step 6)."""
    root, rel = ctx.root, ctx.rel
    out = []
    for folder, df in ctx.named("tables_1_2", "bpd_vs_time.csv", "bpd_vs_time"):
        if not {"attention", "elapsed_s", "eval_bpd"} <= set(df):
            continue
        rows = []
        for att, g in df.sort_values("step").groupby("attention", sort=False):
            last = g.iloc[-1]
            rows.append([att, paper.BITS_PER_DIM["mnist"].get(att, (None,))[0], len(g), int(last.step),
                         float(last.elapsed_s), float(last.eval_bpd), float(g.eval_bpd.min())])
        out.append(f"### Table 1, MNIST: held-out bits/dim against training time ({folder.relative_to(root)})\n\n"
                   f"Hardware: {hardware(df)}  \nCommand: {code(command(folder, root))}\n\n"
                   "The same training wall time per attention (trainer.max_time_s); training seconds are the "
                   "rows' elapsed_s, steps and evaluations included (bpd_vs_time.csv).\n\n"
                   + md_table(["attention", "paper bits/dim (converged)", "our evaluations", "our last step",
                               "our training s", "our last bits/dim", "our best bits/dim"], rows))
        if (folder / "bpd_vs_time.png").is_file():
            out.append(f"![bits/dim against time, {folder.relative_to(root)}]({rel(folder / 'bpd_vs_time.png')})")
    return out


def table_4(ctx) -> str:
    out = ["## Table 4 (supplementary): images per second, with stateful softmax",
           "Paper: images/s of unconditional generation for both datasets, with softmax re-running the prefix "
           "and stateful softmax (a key/value cache, supplementary C.1). Ours: task=throughput. "
           f"{NOT_STATED} {BY_HARDWARE}"]
    named_runs = column_runs(ctx, _generation_cells(), "table_4")
    gpus = gpu_classes(named_runs)
    runs = by_hardware(named_runs, ["CPU", *gpus])
    for ds, name in [("mnist", "MNIST"), ("cifar10", "CIFAR-10")]:
        rows = [[method, p_ips, *[_cell(run, ds, method, "images_per_s") for run in runs], *([] if gpus else [None])]
                for method, p_ips in paper.IMAGES_PER_S[ds].items()]
        out.append(f"### Table 4, {name}\n\n" + md_table(
            ["method", "paper images/s", *[_header("images/s", run) for run in runs],
             *([] if gpus else [GPU_NONE])], rows))
        out += [n for n in (_run_note(run, "images/s", ctx.root) for run in runs) if n]
    return "\n\n".join(out)


def table_5(ctx) -> str:
    out = ["## Table 5 (supplementary): seconds to generate one image",
           "Paper: CPU and GPU seconds to generate one image, both datasets. Ours: task=throughput at batch 1; "
           "(extrapolated) where the run was stopped at its time budget and its total extrapolated, (loaded) where "
           f"the machine's load passed its cores. {BY_HARDWARE}"]
    cells = {(ds, m) for ds, methods in paper.SECONDS_PER_IMAGE.items() for m in methods}
    named_runs = column_runs(ctx, cells, "table_5")
    gpus = gpu_classes(named_runs)
    runs = by_hardware(named_runs, ["CPU", *gpus])
    headers = [_header("s/image", run) for run in runs]
    for ds, name in [("mnist", "MNIST"), ("cifar10", "CIFAR-10")]:
        rows = [[method, cpu, gpu, *[_cell(run, ds, method, "seconds_per_image") for run in runs],
                 *([] if gpus else [None])] for method, (cpu, gpu) in paper.SECONDS_PER_IMAGE[ds].items()]
        out.append(f"### Table 5, {name}\n\n" + md_table(
            ["method", "paper CPU s", "paper GPU s", *headers, *([] if gpus else [GPU_NONE])], rows))
        out += [n for n in (_run_note(run, "s/image", ctx.root) for run in runs) if n]
    return "\n\n".join(out)


SECTIONS = [(30, "tables_1_2", tables_1_2), (40, "table_4", table_4), (50, "table_5", table_5)]
