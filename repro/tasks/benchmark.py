"""task=benchmark: the paper's Figure 1. Forward + backward of one attention layer on random
input for a grid of sequence lengths N, batch scaled inversely with N; time and peak memory
per sample, a row per (attention, N), a log-log plot and a table.

One run measures task.attentions (or the `attention` chosen on the command line); a Hydra
multirun over attention and lengths aggregates all its jobs at the end (repro.cli.callbacks).
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tqdm import tqdm

from repro.cli.attention import attention_config, attention_name
from repro.cli.config import (
    ConfigError,
    RunFailed,
    building_from_config,
    parse_device,
    parse_dtype,
    run_dir,
)
from repro.cli.logging import make_logger
from repro.common.results import (
    REPO,
    atomic_write,
    json_text,
    provenance,
    publish_folder,
    read_jsonl,
    rows_to_csv,
    save_figure,
    write_jsonl,
)
from repro.tasks.benchmark_point import PARENT_ENV, measure_safely

FAILED = ("oom", "timeout", "error")
METRICS = ("time_ms", "time_per_sample_ms", "peak_mem_mb", "mem_per_sample_mb", "saved_per_sample_mb")


def _frame(rows) -> pd.DataFrame:
    """Rows as a frame with every metric column present (all-failed sweeps have none)."""
    df = pd.DataFrame(rows)
    return df.assign(**{m: df[m] if m in df else float("nan") for m in METRICS})


def _lengths(value) -> list[int]:
    lengths = [value] if isinstance(value, int) else list(value)
    if not lengths or any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ConfigError(f"task.lengths must be positive integers; got {value!r}")
    return sorted(lengths)


def _attentions(cfg) -> list[tuple[str, dict]]:
    """(name, config) pairs to measure: the `attention` group's choice when one is selected
    (a multirun over attention=...), else task.attentions."""
    if cfg.get("attention") is not None:
        return [(attention_name(cfg), OmegaConf.to_container(cfg.attention))]
    names = cfg.task.attentions
    if not names:
        raise ConfigError("task.attentions is empty and no attention=... was chosen; "
                          "name at least one config of conf/attention")
    return [(n, attention_config(n)) for n in names]


def _run_isolated(spec: dict, memory_limit: float, timeout: float) -> dict:
    """measure() in a fresh Python process, killed when it passes the memory limit (an 'oom'
    row, before the kernel's OOM killer hits the machine) or the time limit."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # The point dies with this process: killed here on any exception (Ctrl-C), and by the
        # kernel when this process is killed outright (benchmark_point.die_with_parent).
        proc = subprocess.Popen([sys.executable, "-m", "repro.tasks.benchmark_point", json.dumps(spec)],
                                cwd=REPO, stdout=out, stderr=err, text=True,
                                env={**os.environ, PARENT_ENV: str(os.getpid())})
        try:
            ps, began, killed = psutil.Process(proc.pid), time.monotonic(), None
            while proc.poll() is None:
                try:
                    rss = ps.memory_info().rss
                except psutil.NoSuchProcess:
                    break
                if rss > memory_limit:
                    killed = {"status": "oom",
                              "reason": f"resident memory passed the limit of {memory_limit / 2**30:.1f} GiB"}
                elif time.monotonic() - began > timeout:
                    killed = {"status": "timeout", "reason": f"still running after {timeout:.0f} s"}
                if killed:
                    return killed
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read().strip(), err.read().strip()
    if proc.returncode == 0 and stdout:
        return json.loads(stdout.splitlines()[-1])
    if proc.returncode in (-9, 137):
        return {"status": "oom", "reason": "killed by the operating system (out of memory)"}
    last = (stderr.splitlines() or ["no output"])[-1]
    return {"status": "error", "reason": f"exit {proc.returncode}: {last[:200]}"}


# the row's name of each setting -> the config key that sets it (for the message below)
SETTING_KEYS = {"d_model": "model.d_model", "n_heads": "model.n_heads", "causal": "task.causal", "dtype": "task.dtype",
                "tokens": "task.tokens", "warmup": "task.warmup", "max_repeats": "task.repeats",
                "time_budget_s": "task.time_budget_s", "memory_limit_gb": "task.memory_limit_gb",
                "gpu_memory_gb": "task.gpu_memory_gb",
                "isolated": "task.isolate", "seed": "seed", "device": "device (the machine and its threads)"}


def _attention_settings(att: dict) -> dict:
    return {k: v for k, v in att.items() if k != "_partial_"}


def _check_resume(old_rows, settings: dict, per_attention: dict, path):
    """Refuse, in one line, to resume from rows measured with other settings: their points
    would be kept and plotted beside new ones as if comparable."""
    for r in old_rows:
        diffs = [f"{SETTING_KEYS[k]}={r.get(k, 'not recorded')!r} (now {v!r})" for k, v in settings.items()
                 if r.get(k, "?") != v]
        mine, theirs = per_attention.get(r["attention"]), r.get("attention_settings") or {}
        if mine is not None and theirs != mine:
            diffs += [f"attention {r['attention']} {k}={theirs.get(k, 'not recorded')!r} (now {mine.get(k)!r})"
                      for k in dict.fromkeys([*theirs, *mine]) if theirs.get(k) != mine.get(k)]
        if diffs:
            raise ConfigError(f"{path} holds rows measured with other settings: {'; '.join(diffs)}; rerun with "
                              f"those settings to resume it, or in a new run dir")


def _validate(t):
    if t.tokens < 1 or t.warmup < 0 or t.repeats < 1 or t.time_budget_s <= 0:
        raise ConfigError(f"task: tokens and repeats must be >= 1, warmup >= 0, time_budget_s > 0; "
                          f"got tokens={t.tokens}, repeats={t.repeats}, warmup={t.warmup}, "
                          f"time_budget_s={t.time_budget_s}")
    if t.isolate not in ("auto", True, False):
        raise ConfigError(f"task.isolate={t.isolate!r}; valid: auto, true, false")


def cap_gpu_memory(device, gb) -> float | None:
    """task.gpu_memory_gb: let this process use at most `gb` GiB of the GPU's memory (the rest is
    an out-of-memory error to torch), so that a large GPU runs out where a smaller one did (the
    paper's 11 GB GTX 1080 Ti: softmax stopped at 4,096, LSH at 16,384). Returns the fraction set."""
    if gb is None:
        return None
    if not isinstance(gb, (int, float)) or isinstance(gb, bool) or not 0 < gb < float("inf"):
        raise ConfigError(f"task.gpu_memory_gb={gb!r}: give a positive number of GiB, or null for the whole GPU")
    if device.type != "cuda":
        raise ConfigError(f"task.gpu_memory_gb={gb} caps a GPU's memory, and this run is on {device.type}; "
                          "on a CPU the cap is task.memory_limit_gb")
    total = torch.cuda.get_device_properties(device).total_memory
    if gb * 2**30 > total:
        raise ConfigError(f"task.gpu_memory_gb={gb}: the GPU has {total / 2**30:.1f} GiB")
    fraction = gb * 2**30 / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def run(cfg) -> float:
    t = cfg.task
    _validate(t)
    lengths, dtype, device = _lengths(t.lengths), t.dtype, parse_device(cfg.device)
    parse_dtype(dtype)
    cap_gpu_memory(device, t.get("gpu_memory_gb"))
    attentions = _attentions(cfg)
    with building_from_config():  # a bad attention setting fails here, once, not in every point
        for _, att in attentions:
            instantiate(OmegaConf.create(att))(d_model=cfg.model.d_model, n_heads=cfg.model.n_heads)
    out = run_dir(cfg)
    isolate = device.type == "cpu" if t.isolate == "auto" else bool(t.isolate)
    memory_limit = (t.memory_limit_gb * 2**30 if t.memory_limit_gb else 0.8 * psutil.virtual_memory().available)
    logger = make_logger(cfg, out)
    meta = provenance(device)

    # What a measurement depends on besides its point (attention, N): every row records it.
    settings = {"d_model": cfg.model.d_model, "n_heads": cfg.model.n_heads, "causal": bool(t.causal), "dtype": dtype,
                "tokens": t.tokens, "warmup": t.warmup, "max_repeats": t.repeats, "time_budget_s": t.time_budget_s,
                "memory_limit_gb": t.memory_limit_gb, "isolated": isolate, "seed": cfg.seed, "device": meta["device"]}
    if t.get("gpu_memory_gb") is not None:  # recorded only when set (earlier rows resume as they were)
        settings["gpu_memory_gb"] = t.gpu_memory_gb
    per_attention = {name: _attention_settings(att) for name, att in attentions}
    # Resume: rows already in this run dir (an interrupted run, rerun with hydra.run.dir=<its dir>)
    # are kept and their points not measured again, if measured with these same settings.
    old = read_jsonl(out / "results.jsonl") if (out / "results.jsonl").exists() else []
    _check_resume(old, settings, per_attention, out / "results.jsonl")
    done = {(r["attention"], r["n"]): r for r in old}
    rows = []
    points = [(a, n) for a in attentions for n in lengths]
    failed: dict[str, tuple[str, int]] = {}  # attention -> (status, N) of its first failure
    for i, ((name, att), n) in enumerate(tqdm(points, desc="benchmark", unit="point", dynamic_ncols=True)):
        batch = max(1, t.tokens // n)
        row = done.get((name, n))
        if row is None:
            spec = {"attention": att, "d_model": cfg.model.d_model, "n_heads": cfg.model.n_heads, "n": n,
                    "batch": batch, "causal": bool(t.causal), "dtype": dtype, "device": str(device),
                    "warmup": t.warmup, "repeats": t.repeats, "time_budget_s": t.time_budget_s, "seed": cfg.seed}
            if name in failed and t.skip_after_failure:  # a longer N would fail the same way
                status, at = failed[name]
                result = {"status": status, "reason": f"skipped: {status} at N={at}"}
            elif isolate:
                # the budget, then at most one more pass (memory), which is itself under the budget
                result = _run_isolated(spec, memory_limit, 2 * t.time_budget_s + 60)
            else:
                result = measure_safely(spec)
            row = {"task": "benchmark", "publish": t.get("publish"),
                   "attention": name, "target": att["_target_"], "n": n, "batch": batch,
                   **settings, "attention_settings": per_attention[name], **result, **meta}
        if row["status"] != "ok":
            tqdm.write(f"{name} N={n}: {row['status']}: {row.get('reason', '')}", file=sys.stderr)
        if row["status"] in FAILED and name not in failed:
            failed[name] = (row["status"], n)
        rows.append(row)
        write_jsonl(out / "results.jsonl", rows)
        logger.log({f"{name}/time_per_sample_ms": row.get("time_per_sample_ms"),
                    f"{name}/mem_per_sample_mb": row.get("mem_per_sample_mb"), "n": n}, step=i)

    summary = aggregate(rows, out)
    logger.log_table("benchmark", rows)
    logger.log_image("benchmark_plot", out / "benchmark.png")
    logger.finish()
    if not any(r["status"] == "ok" for r in rows):
        raise RunFailed(f"no benchmark point succeeded ({len(rows)} failed, reasons above); "
                        f"rows in {out / 'results.jsonl'}")
    return summary.get("headline", float("nan"))


# ----------------------------------------------------------------------------- aggregation

def _slope(df, col):
    """Least-squares slope of log(col) against log(N): 1 linear, 2 quadratic."""
    if len(df) < 2:
        return None
    return float(np.polyfit(np.log(df["n"]), np.log(df[col]), 1)[0])


def summarize(rows) -> dict:
    df = _frame(rows)
    ok = df[df.status == "ok"]
    per_att = {}
    for name, g in ok.groupby("attention", sort=False):
        g = g.sort_values("n")
        top = g.tail(3)
        per_att[name] = {"largest_n": int(g.n.max()),
                         "time_slope_all": _slope(g, "time_per_sample_ms"),
                         "time_slope_top3": _slope(top, "time_per_sample_ms"),
                         "mem_slope_all": _slope(g, "mem_per_sample_mb"),
                         "mem_slope_top3": _slope(top, "mem_per_sample_mb"),
                         "saved_slope_all": _slope(g.dropna(subset=["saved_per_sample_mb"]), "saved_per_sample_mb")}
    for name in df.attention.unique():
        per_att.setdefault(name, {"largest_n": None})
        failures = df[(df.attention == name) & (df.status != "ok")]
        if len(failures):
            per_att[name]["first_failure"] = f"{failures.iloc[0].status} at N={failures.iloc[0].n}"
    crossovers = {}
    linear = [a for a in per_att if "linear" in a]
    for lin in linear:
        for other in per_att:
            if other == lin:
                continue
            a = ok[ok.attention == lin].set_index("n").time_per_sample_ms
            b = ok[ok.attention == other].set_index("n").time_per_sample_ms
            common = sorted(set(a.index) & set(b.index))
            faster = [n for n in common if a[n] < b[n]]
            # from the smallest N on which linear stays faster at every larger common N
            since = next((n for n in common if all(a[m] < b[m] for m in common if m >= n)), None)
            crossovers[f"{lin} vs {other}"] = {"linear_faster_from_n": since, "faster_at": faster}
    return {"attentions": per_att, "crossovers": crossovers}


def _plot(df, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (col, label), ax in zip([("time_per_sample_ms", "time per sample (ms)"),
                                 ("mem_per_sample_mb", "peak memory per sample (MB); dashed: kept for backward")],
                                axes):
        for name, g in df.groupby("attention", sort=False):
            g = g.sort_values("n")
            ok = g[g.status == "ok"]
            line, = ax.plot(ok.n, ok[col], marker="o", label=name)
            if col == "mem_per_sample_mb" and ok.saved_per_sample_mb.notna().any():  # the exact count beside
                ax.plot(ok.n, ok.saved_per_sample_mb, ls="--", lw=1, color=line.get_color())
            bad = g[g.status != "ok"].head(1)
            if len(bad) and len(ok):
                ax.plot(bad.n, [ok[col].iloc[-1]], marker="x", ls="", ms=10, color=line.get_color())
                ax.annotate(bad.status.iloc[0], (bad.n.iloc[0], ok[col].iloc[-1]), fontsize=8,
                            textcoords="offset points", xytext=(-4, 6), ha="right")
        ax.set_xscale("log", base=2)
        if (df.status == "ok").any():  # an all-failed sweep still gets its (empty) figure
            ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    # Below the axes rather than inside: with a whole family the legend would hide the curves.
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8,
               frameon=False)
    first = df.iloc[0]  # first.dtype would be the row's pandas dtype, hence the item access
    fig.suptitle(f"attention forward+backward, d_model={first['d_model']}, "
                 f"heads={first['n_heads']}, {first['dtype']}, causal={first['causal']}\n"
                 f"{first['device']}", fontsize=9)
    rows_of_legend = -(-len(labels) // 6)
    fig.tight_layout(rect=(0, 0.05 * rows_of_legend, 1, 1))
    save_figure(fig, path)


def table(df) -> str:
    def cells(col):
        return [f"{v:.3g}" if s == "ok" else s for v, s in zip(df[col], df.status)]
    df = df.assign(time=cells("time_per_sample_ms"), mem=cells("mem_per_sample_mb"),
                   saved=cells("saved_per_sample_mb"))
    pivot = {k: df.pivot_table(index="n", columns="attention", values=k, aggfunc="first", sort=False).to_string()
             for k in ("time", "mem", "saved")}
    return (f"time per sample (ms)\n{pivot['time']}\n\npeak memory per sample (MB)\n{pivot['mem']}\n\n"
            f"kept for backward per sample (MB, exact: saved tensors' storages)\n{pivot['saved']}")


def aggregate(rows, out_dir) -> dict:
    """CSV, plot, summary and printed table for a list of benchmark rows (also in the folder the
    rows' `publish` names)."""
    out_dir = Path(out_dir)
    df = _frame(rows)
    summary = summarize(rows)
    lines = [table(df), ""]
    for name, s in summary["attentions"].items():
        slopes = ", ".join(f"{k} {v:.2f}" for k, v in s.items() if k.endswith(("_all", "_top3")) and v is not None)
        lines.append(f"{name}: largest N {s['largest_n']}"
                     + (f" ({s['first_failure']})" if "first_failure" in s else "")
                     + (f"; slopes {slopes}" if slopes else ""))
    for pair, c in summary["crossovers"].items():
        since = c["linear_faster_from_n"]
        lines.append(f"{pair}: linear faster from N={since} on" if since
                     else f"{pair}: linear never faster in this grid")
    text = "\n".join(lines)
    print(text)
    pos = [v["linear_faster_from_n"] for v in summary["crossovers"].values() if v["linear_faster_from_n"]]
    summary["headline"] = float(min(pos)) if pos else float("nan")
    publish = publish_folder(rows)
    targets = [out_dir] + ([publish] if publish else [])
    for d in targets:
        atomic_write(d / "benchmark.csv", rows_to_csv(rows))
        atomic_write(d / "summary.json", json_text(summary, indent=2))
        atomic_write(d / "table.txt", text + "\n")
        _plot(df, d / "benchmark.png")
    return summary
