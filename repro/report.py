"""python -m repro.report [--results results] [--out PATH] [--docs]: every table and figure of the paper
beside ours, from whatever lies under results/, as one markdown file (results/REPORT.md, written
atomically; --out writes a copy elsewhere, its figure links made relative to it).

What it reads (the convention for results folders; any depth under results/):
  benchmark.csv (+ summary.json, benchmark.png)   Figure 1        (task=benchmark)
  copy_final.csv (+ copy_curves.png, ...)         Figure 2        (task=copy)
  throughput.csv                                  Tables 1/2 and 4 images/s, Table 5 s/image (task=throughput)
  any CSV with a bits_per_dim column              Tables 1/2 bits/dim; rows name `dataset` (mnist,
                                                  cifar10) or carry it in `task`, and `attention`
  any CSV with a PER column                       Table 3, one table per folder: `valid_per_%` /
                                                  `per_%` (percent) or `per` (a fraction when <= 1);
                                                  rows name `attention` (or `model`) and may carry
                                                  seconds_per_epoch or s_per_epoch; a folder whose
                                                  `label` (in the CSV or its .jsonl rows) says
                                                  "timing run" gives seconds per epoch only
  bench.csv (repro.kernels.bench)                 the kernel targets of issue 17, one table per run
  kernels.csv (task=kernels)                      the chunked path against the loop and naive formula
  bpd_vs_time.csv (+ .png)                        MNIST bits/dim against training time (reproduce_gpu)
  <step>/status.json, env/env.json, env/kernel_tests.xml   each reproduce_gpu run's steps, environment
                                                  and kernel tests
  cpu_speed_<T>t_<time>.csv (+ .json)             the CPU speed of the core (issue 18), the newest run
                                                  per thread count T (repro.kernels.cpu_speed)
  rows carry `device` (the hardware) as every result row does (for Tables 1/2 bits/dim and Table 3,
  the run rows in a .jsonl beside the CSV may carry it instead). Tables 1, 2, 4 and 5 give ours in
  one column per hardware: CPU (any CPU), and each GPU by its name; a cell never mixes hardware.
The command that produced a folder: its `command.txt` (the exact command line, one or more
lines), else the first `python ...` command in the README.md of the folder or of the nearest
parent folder under results/. A paper table with no result of ours says "not yet run".
"""
import argparse
import json
import math
import os
import re
from pathlib import Path

import pandas as pd

from . import paper
from .results import REPO, atomic_write, read_jsonl


# ----------------------------------------------------------------------------- helpers

def _num(v: float) -> str:
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"


def md_table(header, rows) -> str:
    def cell(v):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "—"
        if isinstance(v, float):
            return _num(v)
        return str(v).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def _commands_in(text: str) -> list[tuple[str, str]]:
    """(line, command) for every `python ...` command in a README: indented or fenced lines (with
    backslash continuations) and inline `...` spans."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        for span in re.findall(r"`([^`]*python [^`]*)`", line):
            out.append((line, span))
        m = re.match(r"^\s+((?:[A-Z_]+=\S+ )*python .*)$", line)
        if m:
            parts, j = [m.group(1)], i
            while parts[-1].endswith("\\") and j + 1 < len(lines):
                j += 1
                parts[-1] = parts[-1][:-1].rstrip()
                parts.append(lines[j].strip())
            out.append((line, " ".join(parts)))
    return out


def command(folder: Path, root: Path) -> str:
    """The command that produced `folder` (see the module docstring)."""
    if (folder / "command.txt").is_file():
        return " ".join(line.strip().rstrip("\\").strip() for line in (folder / "command.txt").read_text().splitlines()
                        if line.strip())
    d = folder
    while True:
        found = _commands_in((d / "README.md").read_text()) if (d / "README.md").is_file() else []
        if d != folder:  # a parent's README: the command on the line naming this folder
            named = [c for line, c in found if f"{folder.relative_to(d).as_posix()}" in line]
            found = [(None, c) for c in named] or found
        if found:
            return found[0][1]
        if d == root or root not in d.parents:
            return "not recorded (add a command.txt)"
        d = d.parent


def hardware(df) -> str:
    if "device" not in df:
        return "not recorded"
    return "; ".join(sorted(set(map(str, df.device.dropna()))))[:200] or "not recorded"


def is_gpu(device: str) -> bool:
    return bool(re.search(r"nvidia|cuda|tesla|geforce|\b[AHVLP]\d{2,3}\b", device, re.I))


def hw_class(device: str) -> str:
    """The hardware a result is shown under: "CPU" for every CPU (their device strings differ by
    thread count), else the GPU's own name (two GPUs are two columns)."""
    return device.strip() if is_gpu(device) else "CPU"


def dataset_of(value) -> str | None:
    v = str(value).lower()
    return "cifar10" if "cifar" in v else "mnist" if "mnist" in v else None


def code(text) -> str:
    return f"`{text}`"


def read_csvs(root: Path, name: str):
    return [(p.parent, pd.read_csv(p)) for p in sorted(root.rglob(name))]


# ----------------------------------------------------------------------------- sections

def figure1(root, rel) -> str:
    out = ["## Figure 1: time and memory against sequence length",
           f"Paper: forward + backward of one attention layer per sample on a {paper.FIGURE1_HARDWARE} "
           "(values read off the log-log plot, ±15%). Ours: the same measurement (repro.tasks.benchmark)."]
    found = read_csvs(root, "benchmark.csv")
    if not found:
        return "\n\n".join(out + ["not yet run"])
    for folder, df in found:
        ok = df[df.status == "ok"] if "status" in df else df
        causal = "non-causal" if "causal" in df and not df.causal.astype(str).str.lower().eq("true").all() else "causal"
        out.append(f"### {folder.relative_to(root)} ({causal})\n\nHardware: {hardware(df)}  \n"
                   f"Command: {code(command(folder, root))}")
        rows = []
        for att, points in paper.FIGURE1.items():
            for ours in paper.FIGURE1_OURS.get(att, [att]):
                if ours not in set(df.attention):
                    continue  # not in this run at all
                for n, (t, m) in points.items():
                    mine = ok[(ok.attention == ours) & (ok.n == n)]
                    rows.append([att, ours, n, t, mine.time_per_sample_ms.iloc[0] if len(mine) else "not measured",
                                 m, mine.mem_per_sample_mb.iloc[0] if len(mine) else "not measured"])
        if rows:
            out.append(md_table(["paper's attention", "ours", "N", "paper ms/sample", "our ms/sample",
                                 "paper MB/sample", "our MB/sample"], rows))
        summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").is_file() else {}
        slopes = []
        for att, s in summary.get("attentions", {}).items():
            theirs = paper.FIGURE1_PAPER_NAME.get(att, att)
            slopes.append([att, paper.FIGURE1_SLOPES.get(theirs), s.get("time_slope_all"), s.get("mem_slope_all"),
                           paper.FIGURE1_LARGEST_N.get(theirs), s.get("largest_n"), s.get("first_failure", "")])
        if slopes:
            out.append("Slopes of log time and log memory against log N (paper: 1 for linear, 2 for softmax):\n\n" +
                       md_table(["attention", "paper slope", "our time slope", "our memory slope",
                                 "paper largest N", "our largest N", "first failure"], slopes))
        if (folder / "benchmark.png").is_file():
            out.append(f"![Figure 1, {folder.name}]({rel(folder / 'benchmark.png')})")
    return "\n\n".join(out)


def figure2(root, rel) -> str:
    out = ["## Figure 2: the copy task", f"Paper ({paper.FIGURE2_SETUP}): {paper.FIGURE2_CLAIM}."]
    found = read_csvs(root, "copy_final.csv")
    if not found:
        return "\n\n".join(out + ["not yet run"])
    for folder, df in found:
        rows_file = folder / "copy_rows.jsonl"
        hw = hardware(pd.read_json(rows_file, lines=True)) if rows_file.is_file() else hardware(df)
        out.append(f"### {folder.relative_to(root)}\n\nHardware: {hw}  \nCommand: {code(command(folder, root))}")
        rows = [[r.max_len, r.attention, r.get("n_seeds"), r.get("steps"), r.get("eval_loss"), r.get("eval_accuracy"),
                 r.get("time_per_step_ms"), "curves only"] for _, r in df.iterrows()]
        out.append(md_table(["N", "attention", "seeds", "steps", "our held-out loss", "our held-out accuracy",
                             "our ms/step", "paper"], rows))
        for png in ("copy_curves.png", "copy_lengths.png"):
            if (folder / png).is_file():
                out.append(f"![{png}]({rel(folder / png)})")
    return "\n\n".join(out)


def _devices_by_attention(folder) -> dict:
    """{attention: device} from the run rows (.jsonl) beside a table whose rows do not name their
    device (the image task's bpd_final.csv)."""
    found = {}
    for r in _run_rows(folder):
        if r.get("attention") and r.get("device"):
            found.setdefault(str(r["attention"]), set()).add(str(r["device"]))
    return {att: "; ".join(sorted(devices)) for att, devices in found.items()}


def _bits_per_dim(csvs):
    """{(dataset, attention, hardware class): (value, folder, device)} from every CSV with a
    bits/dim column (the last folder wins among those on the same class of hardware)."""
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
                found[(ds, str(r.attention), hw_class(device))] = (float(r[col]), path.parent, device)
    return found


def _throughput(root):
    return [(folder, df) for folder, df in read_csvs(root, "throughput.csv") if {"size", "method"} <= set(df)]


def _extrapolated(r) -> bool:
    return str(r.get("extrapolated", "")).lower() == "true"


def _marked(value, r) -> str:
    """A measured value, marked when the run was stopped at its time budget and extrapolated."""
    return f"{_num(float(value))}{' (extrapolated)' if _extrapolated(r) else ''}"


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


def _gpu_headers(gpus, quantity) -> list[str]:
    """One column per GPU, named by it; with none, one column saying so."""
    return [f"our {quantity}, {g}" for g in gpus] or [GPU_NONE]


GPU_NONE = "our GPU: not measured yet"
NOT_STATED = ("The paper does not state the batch it generated at; ours is our largest batch, and a value "
              "marked (extrapolated) comes from a generation stopped at its time budget and extrapolated "
              "(`positions_measured` in its throughput.csv).")
BY_HARDWARE = ("Our values are in one column per hardware (CPU, and each GPU by name): a cell holds one "
               "run's value on that hardware, never a mix; `python -m repro.reproduce_gpu` fills the GPU "
               "columns.")


def _cpu_hardware(found) -> str | None:
    """The CPU(s) the chosen CPU rows ran on: each a device string."""
    return "; ".join(dict.fromkeys(d for d in found if d)) or None


def _commands(folders, root) -> str | None:
    cmds = "; ".join(dict.fromkeys(command(f, root) for f in folders))
    return code(cmds) if cmds else None


def tables_1_2(root, rel, bpd) -> str:
    out = ["## Tables 1 and 2: image generation, bits/dim and images/s",
           "Paper: bits/dim on the test set and images/s of unconditional generation; Table 1 MNIST "
           f"({paper.IMAGES_SETUP['mnist']}), Table 2 CIFAR-10 ({paper.IMAGES_SETUP['cifar10']}). "
           f"Ours: bits/dim from the image task, images/s from task=throughput. {NOT_STATED} {BY_HARDWARE}"]
    thr = _throughput(root)
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
                         cpu_hw, _commands(folders, root)])
        header = ["method", "paper bits/dim", "our bits/dim, CPU", *[f"our bits/dim, {g}" for g in gpus],
                  *([] if gpus else [GPU_NONE]), "paper images/s", "our images/s, CPU",
                  *[f"our images/s, {g}" for g in gpus], *([] if gpus else [GPU_NONE]), "our CPU hardware",
                  "command"]
        out.append(f"### {paper.TABLES_1_2[ds]}: {name}\n\n" + md_table(header, rows))
    out += bpd_vs_time(root, rel)
    return "\n\n".join(out)


def bpd_vs_time(root, rel) -> list[str]:
    """The GPU MNIST step's held-out bits/dim against training time (reproduce_gpu step 6)."""
    out = []
    for folder, df in read_csvs(root, "bpd_vs_time.csv"):
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


def table_4(root, rel) -> str:
    out = ["## Table 4 (supplementary): images per second, with stateful softmax",
           "Paper: images/s of unconditional generation for both datasets, with softmax re-running the prefix "
           "and stateful softmax (a key/value cache, supplementary C.1). Ours: task=throughput. "
           f"{NOT_STATED} {BY_HARDWARE}"]
    thr = _throughput(root)
    gpus = gpu_classes(thr)
    for ds, name in [("mnist", "MNIST"), ("cifar10", "CIFAR-10")]:
        rows = []
        for method, p_ips in paper.IMAGES_PER_S[ds].items():
            ips = {cls: _largest_batch(thr, ds, method, cls) for cls in ["CPU", *gpus]}
            cpu_hw = _cpu_hardware([str(ips["CPU"][1].get("device", "")) or "not recorded"] if ips["CPU"] else [])
            rows.append([method, p_ips, *[_images_per_s(ips[c]) for c in ["CPU", *gpus]], *([] if gpus else [None]),
                         cpu_hw, _commands([f[0] for f in ips.values() if f], root)])
        out.append(f"### Table 4, {name}\n\n" + md_table(
            ["method", "paper images/s", "our images/s, CPU", *_gpu_headers(gpus, "images/s"), "our CPU hardware",
             "command"], rows))
    return "\n\n".join(out)


def table_5(root, rel) -> str:
    out = ["## Table 5 (supplementary): seconds to generate one image",
           "Paper: CPU and GPU seconds to generate one image, both datasets. Ours: task=throughput at batch 1; "
           "(extrapolated) where the run was stopped at its time budget and its total extrapolated (a measured "
           f"run of the same method is preferred). {BY_HARDWARE}"]
    thr = _throughput(root)
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
                         _commands([f[0] for f in mine.values() if f], root)])
        out.append(f"### Table 5, {name}\n\n" + md_table(
            ["method", "paper CPU s", "paper GPU s", "our CPU s", *_gpu_headers(gpus, "GPU s"), "our CPU hardware",
             "command"], rows))
    return "\n\n".join(out)


def _run_rows(folder):
    """The run rows (.jsonl) beside a table, as dicts."""
    return [r for path in sorted(folder.glob("*.jsonl")) for r in read_jsonl(path)]


def _asr_device(df, folder) -> str:
    """The device named by the table, else by the run rows beside it."""
    return hardware(df if "device" in df else pd.DataFrame(_run_rows(folder)))


def is_timing_run(df, folder) -> bool:
    """A run made to time epochs, not to train (its label, in the table or in the run rows beside
    it, says "timing run"): its error rates are those of an untrained model, not results."""
    labels = list(df["label"].dropna()) if "label" in df else [r.get("label") for r in _run_rows(folder)]
    return any(re.search(r"\btiming run\b", str(label), re.I) for label in labels if label)


def _asr_tables(csvs):
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


def table_3(root, rel, asr_tables) -> str:
    out = ["## Table 3: speech recognition (WSJ), phoneme error rate and seconds per epoch",
           f"Paper: WSJ 80 h, CTC over phonemes, {paper.ASR_HARDWARE}. Ours: the ASR task on the corpus its "
           "folder names (see its command); validation PER, as the paper reports. A timing run (a few updates "
           "of an untrained model, its label says so) gives seconds per epoch only: its PER is no result."]
    headers = ["model", "paper PER %", "our PER %", "paper s/epoch", "our s/epoch"]
    tables = []
    for path, df, col, name_col, secs in asr_tables:
        folder = path.parent
        timing = is_timing_run(df, folder)
        found = {}
        for _, r in df.dropna(subset=[col]).iterrows():
            per = float(r[col]) * (1 if col.endswith("%") or float(r[col]) > 1 else 100)
            found[str(r[name_col]).lower().replace("-lstm", "lstm").replace("_", "")] = (
                "timing run" if timing else per, r.get(secs) if secs else None)
        rows = [[name, p_per, found[name][0] if name in found else "not run here", p_s,
                 found[name][1] if name in found else None] for name, (p_per, p_s) in paper.ASR.items()]
        tables.append(f"### {folder.relative_to(root)}{' (timing run)' if timing else ''}\n\n"
                      f"Hardware: {_asr_device(df, folder)}  \n"
                      f"Command: {code(command(folder, root))}\n\n" + md_table(headers, rows))
    if not tables:
        tables = [md_table(headers, [[name, p_per, "not yet run", p_s, None] for name, (p_per, p_s) in paper.ASR.items()])]
    return "\n\n".join(out + tables)


# Issue 17's kernel targets, at one shape: H100, B = H = 8, D = M = 64, N = 16k. (label, method,
# dtype, pass, peer, bound): with no peer, ms <= bound; with a peer, peer ms / our ms >= bound
# (faster than a peer: > 1, written as bound None).
TARGET_SHAPE = {"batch": 8, "heads": 8, "d": 64, "n": 16384}
TARGET_GPU = "H100"
KERNEL_TARGETS = [
    ("forward <= 0.32 ms, bf16", "cupy", "bf16", "fwd", None, 0.32),
    ("forward + backward <= 1.25 ms, bf16", "cupy", "bf16", "fwd_bwd", None, 1.25),
    (">= 10x the authors' kernel, fp32, forward", "cupy", "fp32", "fwd", "fast_transformers", 10.0),
    (">= 10x the authors' kernel, fp32, forward + backward", "cupy", "fp32", "fwd_bwd", "fast_transformers", 10.0),
    ("faster than fla's chunk kernel, bf16, forward", "cupy", "bf16", "fwd", "fla_chunk", None),
    ("faster than fla's chunk kernel, bf16, forward + backward", "cupy", "bf16", "fwd_bwd", "fla_chunk", None),
]
BENCH_METHODS = ("cupy", "cupy_norm", "torch", "fast_transformers", "fla_chunk", "sdpa")


def _bench(csvs):
    """(folder, rows) of every kernel benchmark table (repro.kernels.bench's bench.csv)."""
    need = {"method", "pass", "dtype", "n", "batch", "heads", "d", "status", "device"}
    return [(path.parent, df) for path, df in csvs if path.name == "bench.csv" and need <= set(df)]


def _ms_cell(r) -> str:
    """A measured time with its % of the bandwidth floor when the row carries it, else the
    status's first word (missing, oom, skipped, error)."""
    if r is None:
        return "not measured yet"
    if r.status != "ok":
        return str(r.status).split(":")[0]
    pct = r.get("pct_of_floor")
    return f"{_num(float(r.ms))} ms" + (f" ({float(pct):.0f}% of floor)" if pd.notna(pct) else "")


def _target_rows(rows):
    """[label, measured, standing] for each of KERNEL_TARGETS from the bench rows of one GPU
    (None: no rows at all)."""
    at = {}
    if rows is not None:
        shape = (rows.batch == TARGET_SHAPE["batch"]) & (rows.heads == TARGET_SHAPE["heads"]) & \
                (rows.d == TARGET_SHAPE["d"]) & (rows.n == TARGET_SHAPE["n"])
        ordered = rows[shape].sort_values("time", kind="stable") if "time" in rows else rows[shape]
        at = {(r.method, r["dtype"], r["pass"]): r for _, r in ordered.iterrows()}  # the latest row of a point
    out = []
    for label, method, dtype, pass_, peer, bound in KERNEL_TARGETS:
        mine, theirs = at.get((method, dtype, pass_)), at.get((peer, dtype, pass_)) if peer else None
        if mine is None or (peer and theirs is None):
            out.append([label, "not measured yet" if mine is None else f"{peer}: not measured yet", "not measured yet"])
            continue
        if mine.status != "ok" or (peer and theirs.status != "ok"):
            why = mine if mine.status != "ok" else theirs
            out.append([label, f"{why.method}: {why.status}", "not measured"])
            continue
        if peer is None:
            out.append([label, _ms_cell(mine), "met" if float(mine.ms) <= bound else "not met"])
        else:
            ratio = float(theirs.ms) / float(mine.ms)  # above 1: ours is faster
            ok = ratio >= bound if bound is not None else ratio > 1
            out.append([label, f"{ratio:.3g}x ({method} {_num(float(mine.ms))} ms, {peer} {_num(float(theirs.ms))} ms)",
                        "met" if ok else "not met"])
    return out


def kernels(root, rel, csvs) -> str:
    shape = ", ".join(f"{'B' if k == 'batch' else 'H' if k == 'heads' else 'D = M' if k == 'd' else 'N'} = {v:,}"
                      for k, v in TARGET_SHAPE.items())
    out = ["## Kernel benchmark: the causal dot product against its peers",
           f"Issue 17's targets for this suite's CUDA kernel (method `cupy`), on an {TARGET_GPU} at {shape}; "
           "from `python -m repro.kernels.bench` (reproduce_gpu step 2), each target on the latest row of its point. "
           "% of floor: the least bytes the pass must move over the copy bandwidth measured in the same run."]
    bench = _bench(csvs)
    gpu_rows = {}
    for _, df in bench:
        for cls, g in df.groupby(df.device.astype(str).map(hw_class)):
            if cls != "CPU":
                gpu_rows[cls] = pd.concat([gpu_rows[cls], g]) if cls in gpu_rows else g
    header = ["target", "measured", "standing"]
    if not gpu_rows:
        out.append(f"### Kernel targets (GPU: not measured yet)\n\n" + md_table(header, _target_rows(None)))
    for cls, rows in sorted(gpu_rows.items()):
        note = "" if TARGET_GPU.lower() in cls.lower() else f" (the targets were set for an {TARGET_GPU})"
        out.append(f"### Kernel targets on {cls}{note}\n\n" + md_table(header, _target_rows(rows)))
    for folder, df in bench:
        out.append(_bench_table(folder, df, root))
    for path, df in csvs:  # the CPU kernel task's table (task=kernels: chunked against loop and naive)
        if path.name == "kernels.csv" and {"implementation", "n", "forward_ms"} <= set(df):
            folder = path.parent
            rows = [[r.implementation, int(r.n), r.get("dtype"), r.forward_ms, r.get("forward_backward_ms"),
                     r.get("forward_backward_ms_vs_chunked")] for _, r in df.iterrows()]
            out.append(f"### {folder.relative_to(root)} (the chunked path, task=kernels)\n\n"
                       f"Hardware: {hardware(df)}  \nCommand: {code(command(folder, root))}\n\n"
                       + md_table(["implementation", "N", "dtype", "forward ms", "forward + backward ms",
                                   "forward + backward vs chunked (x slower)"], rows))
    return "\n\n".join(out)


def _bench_table(folder, df, root) -> str:
    """One benchmark run: a row per (dtype, pass, N, shape), a column per method (ms and % of the
    bandwidth floor), and why a method has no number."""
    df = df.sort_values("time", kind="stable") if "time" in df else df
    methods = [m for m in BENCH_METHODS if m in set(df.method)] + sorted(set(df.method) - set(BENCH_METHODS))
    latest = {(r["dtype"], r["pass"], int(r.batch), int(r.heads), int(r.d), int(r.n), r.method): r
              for _, r in df.iterrows()}
    points = sorted({k[:6] for k in latest}, key=lambda k: (k[0], k[1] != "fwd", k[2:]))
    rows = [[*point[:2], "{} x {} x {}".format(*point[2:5]), point[5],
             *[_ms_cell(latest[(*point, m)]) if (*point, m) in latest else None for m in methods]]
            for point in points]
    whys = sorted({f"{m}: {s}" for m, s in zip(df.method, df.status.astype(str)) if s != "ok"})
    return (f"### {folder.relative_to(root)}\n\nHardware: {hardware(df)}  \nCommand: {code(command(folder, root))}\n\n"
            + md_table(["dtype", "pass", "B x H x D", "N", *methods], rows)
            + ("\n\nNo number: " + "; ".join(whys) if whys else ""))


def _kernel_tests(xml_path) -> str:
    """passed / failed / skipped counts of a JUnit XML, and the names of the failed tests."""
    import xml.etree.ElementTree as ET
    try:
        tree = ET.parse(xml_path).getroot()
    except ET.ParseError as err:
        return f"unreadable ({err})"
    suites = [tree] if tree.tag == "testsuite" else tree.findall("testsuite")
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname', '')}.{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    return (f"{passed} passed, {count['failures'] + count['errors']} failed, {count['skipped']} skipped"
            + (f" (failed: {', '.join(failed)})" if failed else ""))


def _flat(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items() if v is not None)
    if isinstance(value, list):
        return " / ".join(map(str, value))
    return str(value)


def gpu_runs(root) -> tuple[str, set]:
    """The GPU runs' steps (status.json of each reproduce_gpu step), the environment report and
    the kernel tests; and the folders it shows."""
    from .reproduce_gpu import STEPS
    out = ["## GPU runs: environment and steps (`python -m repro.reproduce_gpu`)"]
    step_dirs = sorted(p.parent for p in root.rglob("status.json") if p.parent.name in STEPS.values())
    if not step_dirs:
        return "\n\n".join(out + ["Not run yet (no results/gpu/ folder): every GPU column above says "
                                  "\"not measured yet\"."]), set()
    by_run = {}
    for d in step_dirs:
        by_run.setdefault(d.parent, []).append(d)
    for run, steps in by_run.items():
        part = [f"### {run.relative_to(root) if run != root else run.name}"]  # the device's folder
        order = {name: i for i, name in STEPS.items()}
        rows = []
        for d in sorted(steps, key=lambda d: order[d.name]):
            status = json.loads((d / "status.json").read_text())
            jobs = "; ".join(f"{name}: {j.get('status')}" + (f" ({j['reason']})" if j.get("reason") else "")
                             + (f", {_num(float(j['seconds']))} s" if j.get("seconds") is not None else "")
                             for name, j in status.get("jobs", {}).items())
            files = ", ".join(sorted(p.name for p in d.iterdir() if p.is_file() and p.suffix in (".csv", ".png",
                                                                                                     ".json", ".xml")
                                     and p.name != "status.json"))
            rows.append([f"{order[d.name]} {d.name}", status.get("status"), jobs, files])
        part.append(md_table(["step", "status", "jobs", "files"], rows))
        env = run / "env"
        if (env / "env.json").is_file():
            facts = json.loads((env / "env.json").read_text())
            part.append("Environment (env/env.json):\n\n"
                        + md_table(["key", "value"], [[k, _flat(v)] for k, v in facts.items()]))
        if (env / "kernel_tests.xml").is_file():
            part.append(f"GPU kernel tests (env/kernel_tests.xml): {_kernel_tests(env / 'kernel_tests.xml')}")
        elif env.is_dir():
            part.append("GPU kernel tests: no env/kernel_tests.xml (not run; see step 1's jobs)")
        out.append("\n\n".join(part))
    return "\n\n".join(out), set(step_dirs)


def others(root, rel, used) -> str:
    rest = sorted({p.parent for p in root.rglob("*") if p.is_file() and p.name != "REPORT.md"} - used)
    rest = [d for d in rest if d != root and not any(u in d.parents or d in u.parents for u in used)]
    if not rest:
        return ""
    lines = ["## Other results", "Folders under results/ with no table of the paper (kernels, ablations, ...):"]
    for d in rest:
        readme = d / "README.md"
        link = f"[{d.relative_to(root)}]({rel(readme if readme.is_file() else d)})"
        lines.append(f"- {link}: {code(command(d, root))}")
    return "\n\n".join([lines[0], lines[1], "\n".join(lines[2:])])


CPU_SPEED = re.compile(r"cpu_speed_(\d+)t_(\d{8}T\d{6})\.csv")


def _newest_cpu_speed(csvs) -> list[tuple[Path, pd.DataFrame]]:
    """(path, table) of the newest cpu_speed CSV per thread count, fewest threads first, from the
    CSVs `sections` has read."""
    newest = {}
    for path, df in csvs:
        if m := CPU_SPEED.fullmatch(path.name):
            key = int(m[1])
            if key not in newest or m[2] > CPU_SPEED.fullmatch(newest[key][0].name)[2]:
                newest[key] = (path, df)
    return [newest[t] for t in sorted(newest)]


def _cpu_speed_rows(df) -> list[list]:
    """One row per measure of issue 18's table: ours, what it is set against, the ratio, the target."""
    ok = df[df.status == "ok"] if "status" in df else df
    rows = []

    def get(measure, method, **where):
        m = ok[(ok.measure == measure) & (ok.method == method)]
        for key, value in where.items():
            m = m[m[key] == value]
        return m.iloc[0] if len(m) else None

    def met(r):
        return "yes" if bool(r.met) else "no"

    def sig(v):  # three significant digits, trailing zeros kept (15.0, 1.00)
        return f"{v:,.0f}" if v >= 100 else f"{v:#.3g}".rstrip(".")

    def ms(v):
        return f"{sig(v)} ms"

    def faster(x):
        return f"{x:.2f}× faster" if x >= 1 else f"{1 / x:.2f}× slower"

    for n in sorted(df[df.measure == "kernel_vs_peer"].n.unique()):
        ours, peer = get("kernel_vs_peer", "ours", n=n), get("kernel_vs_peer", "fast_transformers", n=n)
        if peer is None:
            missing = df[(df.measure == "kernel_vs_peer") & (df.n == n) & (df.method == "fast_transformers")]
            why = missing.status.iloc[0] if len(missing) else "missing"
            rows.append([f"`causal_dot_product` fwd + bwd, N = {n:,}", ms(ours.ms) if ours is not None else "—",
                         f"fast-transformers: {why}", "—", "≥ 2×", "—"])
            continue
        rows.append([f"`causal_dot_product` fwd + bwd, N = {n:,}", ms(ours.ms), f"fast-transformers {ms(peer.ms)}",
                     faster(ours.speedup_vs_peer), "≥ 2×", met(ours)])
    if (f := get("forward", "ours")) is not None:
        rows.append([f"forward, N = {f.n:,}", ms(f.ms), f"GEMM {f.gemm_gflops:.0f} GFLOP/s (1024³)",
                     f"{f.matmul_gflops:.0f} GFLOP/s of matmuls", "keep", "—"])
    if (b := get("backward_dense", "ours")) is not None and f is not None:
        rows.append(["backward, dense gradient", ms(b.ms), f"forward {ms(f.ms)}", f"{b.x_forward:.2f}×",
                     "≤ 2.5×", met(b)])
    if (z := get("backward_sum", "ours")) is not None and b is not None:
        rows.append(["backward after `out.sum()` (stride-0 gradient)", ms(z.ms), f"dense gradient {ms(b.ms)}",
                     f"{z.x_dense:.2f}×", "same (≤ 1.1×)", met(z)])
    for n in sorted(ok[ok.measure == "layer"].n.unique()):
        lin, sm = get("layer", "linear", n=n), get("layer", "softmax", n=n)
        if lin is not None and sm is not None:
            rows.append([f"layer fwd + bwd, 16,384 tokens, N = {n:,}", ms(lin.ms), f"softmax (SDPA) {ms(sm.ms)}",
                         faster(lin.speedup_vs_softmax), "> 1×", met(lin)])
    for n in sorted(ok[ok.measure == "generation"].n.unique()):
        gen, floor = get("generation", "linear-compiled", n=n), get("generation", "matvec-floor", n=n)
        if gen is not None and floor is not None:
            size = {784: "MNIST", 3072: "CIFAR-10"}.get(n, f"{n} values")
            rows.append([f"batch-1 generation, {size}, compiled linear step", f"{sig(gen.ms / 1e3)} s per image",
                         f"matvec floor {sig(floor.ms / 1e3)} s", f"{gen.x_floor:.2f}× the floor", "≤ 1.4×", met(gen)])
    return rows


def cpu_speed(runs, rel) -> str:
    """The CPU speed of the core (issue 18): the newest cpu_speed run per thread count
    (_newest_cpu_speed's (path, table) pairs)."""
    if not runs:
        return ""
    out = ["## CPU speed of the core",
           "From `python -m repro.kernels.cpu_speed` (issue 18's table; each pair timed interleaved, medians of its "
           "rounds; the load average is the machine's 1-minute load while the run measured). The newest run per thread "
           "count under results/:"]
    for path, df in runs:
        meta = path.with_suffix(".json")
        command = json.loads(meta.read_text()).get("command") if meta.is_file() else None
        loads = [json.loads(v)[0] for v in df.load_avg_1_5_15.dropna()] if "load_avg_1_5_15" in df else []
        sha = df.git_sha.dropna().iloc[0] if "git_sha" in df and df.git_sha.notna().any() else "?"
        threads = int(df.threads.iloc[0])
        out.append(f"**{threads} thread{'s' if threads > 1 else ''}** ([{path.name}]({rel(path)}); "
                   f"{df.device.iloc[0]}, {df.dtype.iloc[0]}, git {sha}"
                   + (f", load {min(loads):.1f}–{max(loads):.1f}" if loads else "")
                   + (f", {int(df.settle.iloc[0])} untimed call before each timed one"
                      if "settle" in df and df.settle.notna().any() and df.settle.iloc[0] > 0 else "") + ")"
                   + (f": {code(command)}" if command else ""))
        out.append(md_table(["measure", "ours", "against", "ratio", "target", "met"], _cpu_speed_rows(df)))
    return "\n\n".join(out)


def claims(results) -> str:
    """The paper's claims, one verdict each, from the CPU-sized claim runs (repro.claims)."""
    from . import claims as claims_module

    return ("## Does it reproduce the paper's claims?\n\nEach claim a CPU can speak to, put to one CPU-sized "
            "run (the `*_claims_cpu` presets in `conf/experiment/`; each folder's README holds its command, git SHA and "
            "machine load). Verdict rules: `repro/claims.py`.\n\n" + claims_module.section(results).rstrip())


def sections(results: Path, out: Path) -> dict[str, str]:
    """The report's sections by name (title, figure1, figure2, tables_1_2, table_4, table_5,
    table_3, claims, kernels, cpu_speed, gpu_runs, others), links made relative to `out`; "" where a section has nothing."""
    results, out = Path(results).resolve(), Path(out).resolve()

    def rel(path):
        return Path(os.path.relpath(Path(path).resolve(), out.parent)).as_posix()

    csvs = [(path, pd.read_csv(path)) for path in sorted(results.rglob("*.csv"))]  # read once, for every section
    bpd, asr_tables = _bits_per_dim(csvs), _asr_tables(csvs)
    runs, run_dirs = gpu_runs(results)
    used = {p.parent for name in ("benchmark.csv", "copy_final.csv", "throughput.csv", "bpd_vs_time.csv", "bench.csv",
                                  "kernels.csv") for p in results.rglob(name)}
    used |= {v[1] for v in bpd.values()} | {path.parent for path, *_ in asr_tables} | run_dirs
    speed = _newest_cpu_speed(csvs)
    used |= {path.parent for path, _ in speed}
    gpu = {hw_class(str(v)) for _, df in csvs if "device" in df for v in df.device.dropna()}
    gpu = sorted((gpu | {cls for (_, _, cls) in bpd}) - {"CPU"})
    title = "\n\n".join([
        "# Report: the paper's tables and figures beside ours",
        f"Generated by `python -m repro.report` from `{results.relative_to(REPO) if REPO in results.parents else results}`. "
        "Paper values: repro/paper.py (from the paper; figure values read off its plots). "
        "Ours: the committed runs, each with the hardware it ran on and the command that produced it. "
        "CPU-sized runs are smaller than the paper's settings: compare shapes (slopes, orderings), not absolute values. "
        + (f"GPU results: {', '.join(gpu)}." if gpu else
           "GPU: not measured yet (no GPU rows under results/; `python -m repro.reproduce_gpu` makes them).")])
    return {"title": title, "figure1": figure1(results, rel), "figure2": figure2(results, rel),
            "tables_1_2": tables_1_2(results, rel, bpd), "table_4": table_4(results, rel),
            "table_5": table_5(results, rel), "table_3": table_3(results, rel, asr_tables),
            "claims": claims(results), "kernels": kernels(results, rel, csvs), "cpu_speed": cpu_speed(speed, rel),
            "gpu_runs": runs, "others": others(results, rel, used)}


def build(results: Path, out: Path) -> str:
    return "\n\n".join(p for p in sections(results, out).values() if p) + "\n"


# A page of the docs embeds a section between `<!-- report:NAME -->` and `<!-- /report:NAME -->`
# (NAME a key of `sections`); `--docs` rewrites what lies between, tests/test_docs.py checks it is current.
DOC_BLOCK = re.compile(r"(<!-- report:(\w+) -->\n)(?:.*?\n)?(<!-- /report:\2 -->)", re.S)


def render_blocks(page: Path, results: Path) -> str:
    """The text of `page` with each report block filled from `results` (links relative to the page)."""
    text = Path(page).read_text()
    if not DOC_BLOCK.search(text):
        return text
    found = sections(results, page)
    unknown = sorted({m[2] for m in DOC_BLOCK.finditer(text)} - found.keys())
    if unknown:
        raise SystemExit(f"error: {page}: unknown report section {', '.join(unknown)}; valid: {', '.join(found)}")
    return DOC_BLOCK.sub(lambda m: m[1] + (found[m[2]] or "(nothing under results/ yet)") + "\n" + m[3], text)


def doc_pages() -> list[Path]:
    return [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m repro.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(REPO / "results"), help="the results folder (default: results/)")
    ap.add_argument("--out", default=None, help="also write the report here (figure links relative to it)")
    ap.add_argument("--docs", action="store_true",
                    help="also rewrite the <!-- report:NAME --> blocks of README.md and docs/*.md")
    args = ap.parse_args(argv)
    results = Path(args.results)
    if not results.is_dir():
        raise SystemExit(f"error: no results folder at {results}")
    if args.docs:
        for page in doc_pages():
            text = render_blocks(page, results)
            if text != page.read_text():
                atomic_write(page, text)
                print(f"wrote {page}")
    targets = [results / "REPORT.md"] + ([Path(args.out)] if args.out else [])
    for target in targets:
        atomic_write(target, build(results, target))
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
