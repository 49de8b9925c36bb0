"""python -m repro.report [--results results] [--out PATH]: every table and figure of the paper
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
  rows carry `device` (the hardware) as every result row does (for Table 3, the run rows in a
  .jsonl beside the CSV may carry it instead).
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
from .results import REPO, atomic_write


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


def _bits_per_dim(csvs):
    """{(dataset, attention): (value, folder, device)} from every CSV with a bits/dim column."""
    found = {}
    for path, df in csvs:
        col = next((c for c in ("bits_per_dim", "eval_bits_per_dim", "test_bits_per_dim") if c in df), None)
        if col is None or "attention" not in df:
            continue
        for _, r in df.dropna(subset=[col]).iterrows():
            ds = dataset_of(r.get("dataset", r.get("task", "")))
            if ds:
                found[(ds, str(r.attention))] = (float(r[col]), path.parent, str(r.get("device", "")))
    return found


def _throughput(root):
    return [(folder, df) for folder, df in read_csvs(root, "throughput.csv") if {"size", "method"} <= set(df)]


def _extrapolated(r) -> bool:
    return str(r.get("extrapolated", "")).lower() == "true"


def _marked(value, r) -> str:
    """A measured value, marked when the run was stopped at its time budget and extrapolated."""
    return f"{_num(float(value))}{' (extrapolated)' if _extrapolated(r) else ''}"


def _largest_batch(thr, ds, method):
    """(folder, row) of our run of `method` on `ds` at the largest batch (the last folder of equals),
    or None."""
    found = [(f, d[(d["size"].map(dataset_of) == ds) & (d.method == method)]) for f, d in thr]
    found = [(f, d[d.batch == d.batch.max()]) for f, d in found if len(d)]
    found.sort(key=lambda fd: fd[1].batch.iloc[0])
    return (found[-1][0], found[-1][1].iloc[0]) if found else None


def _images_per_s(found):
    if found is None:
        return "not yet run", None
    _, r = found
    return _marked(r.images_per_s, r), int(r.batch)


NOT_STATED = ("The paper does not state the batch it generated at; ours is our largest batch, and a value "
              "marked (extrapolated) comes from a generation stopped at its time budget and extrapolated "
              "(`positions_measured` in its throughput.csv).")


def tables_1_2(root, rel, bpd) -> str:
    out = ["## Tables 1 and 2: image generation, bits/dim and images/s",
           "Paper: bits/dim on the test set and images/s of unconditional generation; Table 1 MNIST "
           f"({paper.IMAGES_SETUP['mnist']}), Table 2 CIFAR-10 ({paper.IMAGES_SETUP['cifar10']}). "
           f"Ours: bits/dim from the image task, images/s from task=throughput. {NOT_STATED}"]
    thr = _throughput(root)
    for ds, name in [("mnist", "MNIST"), ("cifar10", "CIFAR-10")]:
        rows = []
        for method, (p_bpd, p_ips) in paper.BITS_PER_DIM[ds].items():
            b = bpd.get((ds, method))
            found = _largest_batch(thr, ds, method)
            ips, batch = _images_per_s(found)
            hw = "; ".join(x for x in [b[2] if b else "", str(found[1].get("device", "")) if found else ""] if x) or None
            cmds = "; ".join(dict.fromkeys(([command(b[1], root)] if b else []) +
                                           ([command(found[0], root)] if found else [])))
            rows.append([method, p_bpd, b[0] if b else "not yet run", p_ips, ips, batch, hw,
                         code(cmds) if cmds else None])
        out.append(f"### {paper.TABLES_1_2[ds]}: {name}\n\n" + md_table(
            ["method", "paper bits/dim", "our bits/dim", "paper images/s", "our images/s", "our batch",
             "our hardware", "command"], rows))
    return "\n\n".join(out)


def table_4(root, rel) -> str:
    out = ["## Table 4 (supplementary): images per second, with stateful softmax",
           "Paper: images/s of unconditional generation for both datasets, with softmax re-running the prefix "
           "and stateful softmax (a key/value cache, supplementary C.1). Ours: task=throughput. " + NOT_STATED]
    thr = _throughput(root)
    for ds, name in [("mnist", "MNIST"), ("cifar10", "CIFAR-10")]:
        rows = []
        for method, p_ips in paper.IMAGES_PER_S[ds].items():
            found = _largest_batch(thr, ds, method)
            ips, batch = _images_per_s(found)
            rows.append([method, p_ips, ips, batch, (str(found[1].get("device", "")) or "not recorded") if found else None,
                         code(command(found[0], root)) if found else None])
        out.append(f"### Table 4, {name}\n\n" + md_table(
            ["method", "paper images/s", "our images/s", "our batch", "our hardware", "command"], rows))
    return "\n\n".join(out)


def table_5(root, rel) -> str:
    out = ["## Table 5 (supplementary): seconds to generate one image",
           "Paper: CPU and GPU seconds to generate one image, both datasets. Ours: task=throughput at batch 1; "
           "(extrapolated) where the run was stopped at its time budget and its total extrapolated (a measured "
           "run of the same method is preferred)."]
    thr = _throughput(root)
    for ds, name in [("mnist", "MNIST"), ("cifar10", "CIFAR-10")]:
        rows = []
        for method, (cpu, gpu) in paper.SECONDS_PER_IMAGE[ds].items():
            mine = [(f, d[(d["size"].map(dataset_of) == ds) & (d.method == method) & (d.batch == 1)]) for f, d in thr]
            mine = [(f, d) for f, d in mine if len(d)]
            mine.sort(key=lambda fd: not _extrapolated(fd[1].iloc[0]))  # measured last
            if mine:
                folder, d = mine[-1]
                r = d.iloc[0]
                value = _marked(r.seconds_per_image, r) if pd.notna(r.get("seconds_per_image")) else r.get("status")
                rows.append([method, cpu, gpu, value, "GPU" if is_gpu(hardware(d)) else "CPU", hardware(d),
                             code(command(folder, root))])
            else:
                rows.append([method, cpu, gpu, "not yet run", None, None, None])
        out.append(f"### Table 5, {name}\n\n" + md_table(["method", "paper CPU s", "paper GPU s", "our s/image",
                                                          "ours on", "our hardware", "command"], rows))
    return "\n\n".join(out)


def _run_rows(folder):
    """The run rows (.jsonl) beside a table, as dicts."""
    rows = []
    for path in sorted(folder.glob("*.jsonl")):
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def _asr_device(df, folder) -> str:
    """The device named by the table, else by the run rows beside it."""
    if "device" in df:
        return hardware(df)
    devices = {r.get("device") for r in _run_rows(folder)} - {None}
    return "; ".join(sorted(devices))[:200] if devices else "not recorded"


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


def build(results: Path, out: Path) -> str:
    results, out = Path(results).resolve(), Path(out).resolve()

    def rel(path):
        return Path(os.path.relpath(Path(path).resolve(), out.parent)).as_posix()

    csvs = [(path, pd.read_csv(path)) for path in sorted(results.rglob("*.csv"))]  # read once, for every section
    bpd, asr_tables = _bits_per_dim(csvs), _asr_tables(csvs)
    used = {p.parent for name in ("benchmark.csv", "copy_final.csv", "throughput.csv") for p in results.rglob(name)}
    used |= {v[1] for v in bpd.values()} | {path.parent for path, *_ in asr_tables}
    parts = ["# Report: the paper's tables and figures beside ours",
             f"Generated by `python -m repro.report` from `{results.relative_to(REPO) if REPO in results.parents else results}`. "
             "Paper values: repro/paper.py (from the paper; figure values read off its plots). "
             "Ours: the committed runs, each with the hardware it ran on and the command that produced it. "
             "CPU-sized runs are smaller than the paper's settings: compare shapes (slopes, orderings), not absolute values.",
             figure1(results, rel), figure2(results, rel), tables_1_2(results, rel, bpd), table_4(results, rel),
             table_5(results, rel),
             table_3(results, rel, asr_tables), others(results, rel, used)]
    return "\n\n".join(p for p in parts if p) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m repro.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(REPO / "results"), help="the results folder (default: results/)")
    ap.add_argument("--out", default=None, help="also write the report here (figure links relative to it)")
    args = ap.parse_args(argv)
    results = Path(args.results)
    if not results.is_dir():
        raise SystemExit(f"error: no results folder at {results}")
    targets = [results / "REPORT.md"] + ([Path(args.out)] if args.out else [])
    for target in targets:
        atomic_write(target, build(results, target))
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
