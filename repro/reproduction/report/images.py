"""Tables 1, 2, 4 and 5: image generation. Bits/dim from any CSV with a bits/dim column (the
image task's bpd_final.csv), images/s and seconds per image from task=throughput's
throughput.csv, one column per hardware; and the GPU MNIST step's bits/dim against time."""
import pandas as pd

from repro.common import paper
from repro.reproduction.report.format import (
    code,
    command,
    commands_of,
    dataset_of,
    hardware,
    hw_class,
    md_table,
    num,
    run_rows,
)
from repro.reproduction.report.schema import Table, named

BPD_COLUMNS = ("bits_per_dim", "eval_bits_per_dim", "test_bits_per_dim")
TABLES = [Table("throughput.csv", {"size": str, "method": str, "batch": float},
                {"images_per_s": float, "seconds_per_image": float, "device": str}),
          Table("bpd_vs_time.csv", {"attention": str, "step": float, "elapsed_s": float, "eval_bpd": float}),
          # by name too: a bpd_final.csv that lost its bits/dim column must fail, not stop being a bits/dim
          # table (Table 1's column would then come from another folder)
          Table("bpd_final.csv", {"attention": str, "eval_bits_per_dim": float}, {"dataset": str, "status": str}),
          *(Table("*.csv", {col: float}, {"attention": str, "device": str}, when=col) for col in BPD_COLUMNS)]


def _devices_by_attention(folder) -> dict:
    """{attention: device} from the run rows (.jsonl) beside a table whose rows do not name their
    device (the image task's bpd_final.csv)."""
    found = {}
    for r in run_rows(folder):
        if r.get("attention") and r.get("device"):
            found.setdefault(str(r["attention"]), set()).add(str(r["device"]))
    return {att: "; ".join(sorted(devices)) for att, devices in found.items()}


def bits_per_dim(csvs):
    """{(dataset, attention, hardware class): (value, folder, device)} from every CSV with a
    bits/dim column, one run per column: for each dataset and class of hardware, the one folder
    holding the most attentions (of equals, the last by path), never a mix of folders; and
    {(dataset, class): [folders left out]}."""
    found = {}
    for path, df in csvs:
        col = next((c for c in ("bits_per_dim", "eval_bits_per_dim", "test_bits_per_dim") if c in df), None)
        if col is None or "attention" not in df:
            continue
        beside = {} if "device" in df else _devices_by_attention(path.parent)
        for _, r in df.dropna(subset=[col]).iterrows():
            ds = dataset_of(r.get("dataset", r.get("task", "")))
            if ds:
                device = str(r["device"]) if "device" in df else beside.get(str(r.attention), "")
                found.setdefault((ds, hw_class(device)), {}).setdefault(path.parent, {})[str(r.attention)] = (
                    float(r[col]), path.parent, device)
    chosen, left_out = {}, {}
    for (ds, cls), folders in found.items():
        pick = max(folders, key=lambda f: (len(folders[f]), str(f)))
        chosen.update({(ds, att, cls): v for att, v in folders[pick].items()})
        if len(folders) > 1:
            left_out[(ds, cls)] = sorted(f for f in folders if f != pick)
    return chosen, left_out


def _throughput(csvs):
    """(folder, table) of every throughput.csv (task=throughput) that names sizes and methods."""
    return [(folder, df) for folder, df in named(csvs, "throughput.csv") if {"size", "method"} <= set(df)]


def _extrapolated(r) -> bool:
    return str(r.get("extrapolated", "")).lower() == "true"


def _marked(value, r) -> str:
    """A measured value, marked when the run was stopped at its time budget and extrapolated."""
    return f"{num(float(value))}{' (extrapolated)' if _extrapolated(r) else ''}"


def _on(df, cls):
    """The rows of `df` that ran on hardware class `cls` (see hw_class)."""
    devices = df["device"].astype(str) if "device" in df else pd.Series("", index=df.index)
    return df[devices.map(hw_class) == cls]


def _largest_batch(thr, ds, method, cls):
    """(folder, row) of our run of `method` on `ds` on hardware class `cls` at the largest batch
    (the last folder of equals), or None."""
    found = [(f, _on(d, cls)) for f, d in thr]
    found = [(f, d[(d["size"].map(dataset_of) == ds) & (d.method == method)]) for f, d in found]
    found = [(f, d[d.batch == d.batch.max()]) for f, d in found if len(d)]
    found.sort(key=lambda fd: fd[1].batch.iloc[0])
    return (found[-1][0], found[-1][1].iloc[0]) if found else None


def _images_per_s(found):
    if found is None:
        return "not yet run"
    _, r = found
    return f"{_marked(r.images_per_s, r)} at batch {int(r.batch)}"


def _batch_1(thr, ds, method, cls):
    """(folder, rows) of our run of `method` on `ds` on class `cls` at batch 1, a measured run
    preferred to an extrapolated one, else the last folder; or None."""
    mine = [(f, _on(d, cls)) for f, d in thr]
    mine = [(f, d[(d["size"].map(dataset_of) == ds) & (d.method == method) & (d.batch == 1)]) for f, d in mine]
    mine = [(f, d) for f, d in mine if len(d)]
    mine.sort(key=lambda fd: not _extrapolated(fd[1].iloc[0]))  # measured last
    return mine[-1] if mine else None


def gpu_classes(thr, bpd=None) -> list[str]:
    """The GPUs (by name) that any throughput or bits/dim row ran on, in order."""
    names = {hw_class(str(v)) for _, d in thr if "device" in d for v in d.device.dropna()}
    names |= {cls for (_, _, cls) in (bpd or {})}
    return sorted(names - {"CPU"})


GPU_NONE = "our GPU: not measured yet"


NOT_STATED = ("The paper does not state the batch it generated at; ours is our largest batch, and a value "
              "marked (extrapolated) comes from a generation stopped at its time budget and extrapolated "
              "(`positions_measured` in its throughput.csv).")


BY_HARDWARE = ("Our values are in one column per hardware (CPU, and each GPU by name): a cell holds one "
               "run's value on that hardware, never a mix; `python -m repro.reproduce_gpu` fills the GPU "
               "columns.")


def _gpu_headers(gpus, quantity) -> list[str]:
    """One column per GPU, named by it; with none, one column saying so."""
    return [f"our {quantity}, {g}" for g in gpus] or [GPU_NONE]


def _cpu_hardware(found) -> str | None:
    """The CPU(s) the chosen CPU rows ran on: each a device string."""
    return "; ".join(dict.fromkeys(d for d in found if d)) or None


def chosen_bpd(ctx) -> dict:
    """bits_per_dim of the CSVs under results/, once per report."""
    if "bpd" not in ctx.memo:
        ctx.memo["bpd"], ctx.memo["bpd_left_out"] = bits_per_dim(ctx.csvs)
        ctx.used |= {v[1] for v in ctx.memo["bpd"].values()}
    return ctx.memo["bpd"]


def tables_1_2(ctx) -> str:
    root, csvs = ctx.root, ctx.csvs
    ctx.used |= {folder for folder, _ in named(csvs, "throughput.csv")}
    bpd = chosen_bpd(ctx)
    out = ["## Tables 1 and 2: image generation, bits/dim and images/s",
           "Paper: bits/dim on the test set and images/s of unconditional generation; Table 1 MNIST "
           f"({paper.IMAGES_SETUP['mnist']}), Table 2 CIFAR-10 ({paper.IMAGES_SETUP['cifar10']}). "
           f"Ours: bits/dim from the image task, images/s from task=throughput. {NOT_STATED} {BY_HARDWARE}"]
    thr = _throughput(csvs)
    gpus = gpu_classes(thr, bpd)
    for ds, name in [("mnist", "MNIST"), ("cifar10", "CIFAR-10")]:
        rows = []
        for method, (p_bpd, p_ips) in paper.BITS_PER_DIM[ds].items():
            bits = {cls: bpd.get((ds, method, cls)) for cls in ["CPU", *gpus]}
            ips = {cls: _largest_batch(thr, ds, method, cls) for cls in ["CPU", *gpus]}
            cpu_hw = _cpu_hardware([bits["CPU"][2] if bits["CPU"] else "",
                                    str(ips["CPU"][1].get("device", "")) if ips["CPU"] else ""])
            folders = [b[1] for b in bits.values() if b] + [f[0] for f in ips.values() if f]
            rows.append([method, p_bpd, *[bits[c][0] if bits[c] else "not yet run" for c in ["CPU", *gpus]],
                         *([] if gpus else [None]), p_ips,
                         *[_images_per_s(ips[c]) for c in ["CPU", *gpus]], *([] if gpus else [None]),
                         cpu_hw, commands_of(folders, root)])
        header = ["method", "paper bits/dim", "our bits/dim, CPU", *[f"our bits/dim, {g}" for g in gpus],
                  *([] if gpus else [GPU_NONE]), "paper images/s", "our images/s, CPU",
                  *[f"our images/s, {g}" for g in gpus], *([] if gpus else [GPU_NONE]), "our CPU hardware",
                  "command"]
        out.append(f"### {paper.TABLES_1_2[ds]}: {name}\n\n" + md_table(header, rows))
        for cls in ["CPU", *gpus]:  # one run per column: say which, and which were left out
            left = ctx.memo["bpd_left_out"].get((ds, cls))
            source = next((v[1] for (d, _, c), v in bpd.items() if (d, c) == (ds, cls)), None)
            if left and source is not None:
                out.append(f"Our bits/dim, {cls}: one run, `{source.relative_to(root)}` (the folder with the most "
                           "attentions); left out of this column, not mixed in: "
                           + ", ".join(f"`{f.relative_to(root)}`" for f in left) + ".")
    out += bpd_vs_time(ctx)
    return "\n\n".join(out)


def bpd_vs_time(ctx) -> list[str]:
    """The GPU MNIST step's held-out bits/dim against training time (reproduce_gpu step 6)."""
    root, rel, csvs = ctx.root, ctx.rel, ctx.csvs
    out = []
    ctx.used |= {folder for folder, _ in named(csvs, "bpd_vs_time.csv")}
    for folder, df in named(csvs, "bpd_vs_time.csv"):
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
    root, csvs = ctx.root, ctx.csvs
    out = ["## Table 4 (supplementary): images per second, with stateful softmax",
           "Paper: images/s of unconditional generation for both datasets, with softmax re-running the prefix "
           "and stateful softmax (a key/value cache, supplementary C.1). Ours: task=throughput. "
           f"{NOT_STATED} {BY_HARDWARE}"]
    thr = _throughput(csvs)
    gpus = gpu_classes(thr)
    for ds, name in [("mnist", "MNIST"), ("cifar10", "CIFAR-10")]:
        rows = []
        for method, p_ips in paper.IMAGES_PER_S[ds].items():
            ips = {cls: _largest_batch(thr, ds, method, cls) for cls in ["CPU", *gpus]}
            cpu_hw = _cpu_hardware([str(ips["CPU"][1].get("device", "")) or "not recorded"] if ips["CPU"] else [])
            rows.append([method, p_ips, *[_images_per_s(ips[c]) for c in ["CPU", *gpus]], *([] if gpus else [None]),
                         cpu_hw, commands_of([f[0] for f in ips.values() if f], root)])
        out.append(f"### Table 4, {name}\n\n" + md_table(
            ["method", "paper images/s", "our images/s, CPU", *_gpu_headers(gpus, "images/s"), "our CPU hardware",
             "command"], rows))
    return "\n\n".join(out)


def table_5(ctx) -> str:
    root, csvs = ctx.root, ctx.csvs
    out = ["## Table 5 (supplementary): seconds to generate one image",
           "Paper: CPU and GPU seconds to generate one image, both datasets. Ours: task=throughput at batch 1; "
           "(extrapolated) where the run was stopped at its time budget and its total extrapolated (a measured "
           f"run of the same method is preferred). {BY_HARDWARE}"]
    thr = _throughput(csvs)
    gpus = gpu_classes(thr)

    def value(found):
        if found is None:
            return "not yet run"
        r = found[1].iloc[0]
        return _marked(r.seconds_per_image, r) if pd.notna(r.get("seconds_per_image")) else r.get("status")

    for ds, name in [("mnist", "MNIST"), ("cifar10", "CIFAR-10")]:
        rows = []
        for method, (cpu, gpu) in paper.SECONDS_PER_IMAGE[ds].items():
            mine = {cls: _batch_1(thr, ds, method, cls) for cls in ["CPU", *gpus]}
            rows.append([method, cpu, gpu, *[value(mine[c]) for c in ["CPU", *gpus]], *([] if gpus else [None]),
                         hardware(mine["CPU"][1]) if mine["CPU"] else None,
                         commands_of([f[0] for f in mine.values() if f], root)])
        out.append(f"### Table 5, {name}\n\n" + md_table(
            ["method", "paper CPU s", "paper GPU s", "our CPU s", *_gpu_headers(gpus, "GPU s"), "our CPU hardware",
             "command"], rows))
    return "\n\n".join(out)


SECTIONS = [(30, "tables_1_2", tables_1_2), (40, "table_4", table_4), (50, "table_5", table_5)]
