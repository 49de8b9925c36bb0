"""task=benchmark: the paper's Figure 1. Forward + backward of one attention layer on random
input for a grid of sequence lengths N, batch scaled inversely with N; time and peak memory
per sample, a row per (attention, N), a log-log plot and a table.

One run measures task.attentions (or the `attention` chosen on the command line); a Hydra
multirun over attention and lengths aggregates all its jobs at the end (repro.cli.callbacks).
"""
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tqdm import tqdm

from repro.common.config import parse_device, parse_dtype
from repro.common.errors import ConfigError, RunFailed, building_from_config
from repro.common.results import (
    atomic_write,
    check_publish,
    json_text,
    output_dirs,
    provenance,
    read_jsonl,
    rows_to_csv,
    save_figure,
    write_jsonl,
)
from repro.conf import in_multirun, run_dir
from repro.conf.attention import attention_config, attention_name
from repro.tasks.benchmark_point import measure_safely, run_isolated
from repro.training.backends import note_fallback
from repro.training.loggers import make_logger
from repro.training.memory import cap_gpu_memory
from repro.training.memory import memory_limit as point_memory_limit

FAILED = ("oom", "timeout", "error")
RAW_NAME = "benchmark_rows.jsonl"  # the rows, beside the aggregate in a publish folder
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
    memory_limit = point_memory_limit(t.memory_limit_gb)
    # Whether the publish folder will take these rows, before an hour of measuring (a sweep's
    # jobs publish nothing: its callback publishes the whole sweep, checked then)
    publishing = {"task": "benchmark", "publish": t.get("publish"), "publish_replace": bool(t.get("publish_replace"))}
    if not in_multirun():
        check_publish([{**publishing, "attention": name, "n": n, "batch": max(1, t.tokens // n), "seed": cfg.seed}
                       for name, _ in attentions for n in lengths], RAW_NAME)
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
        if row is not None:  # kept; published where this run publishes
            row = {**row, **publishing}
        else:
            spec = {"attention": att, "d_model": cfg.model.d_model, "n_heads": cfg.model.n_heads, "n": n,
                    "batch": batch, "causal": bool(t.causal), "dtype": dtype, "device": str(device),
                    "warmup": t.warmup, "repeats": t.repeats, "time_budget_s": t.time_budget_s, "seed": cfg.seed}
            load = os.getloadavg()[0]  # the machine's load over the point: its times are inflated above the cores
            if name in failed and t.skip_after_failure:  # a longer N would fail the same way
                status, at = failed[name]
                result = {"status": status, "reason": f"skipped: {status} at N={at}"}
            elif isolate:
                # the budget, then at most one more pass (memory), which is itself under the budget
                result = run_isolated(spec, memory_limit, 2 * t.time_budget_s + 60)
            else:
                result = measure_safely(spec)
            row = {"task": "benchmark", "attention": name, "target": att["_target_"], "n": n, "batch": batch,
                   **settings, "attention_settings": per_attention[name], **result,
                   "loadavg_1min_start": load, "loadavg_1min_end": os.getloadavg()[0], **meta, **publishing}
        note_fallback(name, row)
        if row["status"] != "ok":
            tqdm.write(f"{name} N={n}: {row['status']}: {row.get('reason', '')}", file=sys.stderr)
        if row["status"] in FAILED and name not in failed:
            failed[name] = (row["status"], n)
        rows.append(row)
        write_jsonl(out / "results.jsonl", rows)
        logger.log({f"{name}/time_per_sample_ms": row.get("time_per_sample_ms"),
                    f"{name}/mem_per_sample_mb": row.get("mem_per_sample_mb"), "n": n}, step=i)

    summary = aggregate(rows, out, publish=not in_multirun())
    logger.log_table("benchmark", rows)
    logger.log_image("benchmark_plot", out / "benchmark.png")
    logger.finish()
    if not any(r["status"] == "ok" for r in rows):
        raise RunFailed(f"no benchmark point succeeded ({len(rows)} failed, reasons above); "
                        f"rows in {out / 'results.jsonl'}")
    return summary.get("headline", float("nan"))


# ----------------------------------------------------------------------------- aggregation

SLOPE_COLS = {"time": "time_per_sample_ms", "mem": "mem_per_sample_mb", "saved": "saved_per_sample_mb"}


def per_n(g, col) -> pd.Series:
    """col per distinct N (the mean of rows that measured one N again: repeated lengths, resumed
    runs), in N order."""
    return g.dropna(subset=[col]).groupby("n")[col].mean().sort_index()


def _slope(s: pd.Series):
    """Least-squares slope of log(value) against log(N) over distinct N: 1 linear, 2 quadratic."""
    if len(s) < 2:
        return None
    return float(np.polyfit(np.log(s.index.to_numpy(float)), np.log(s.to_numpy(float)), 1)[0])


def _slopes(g) -> dict:
    """One run's slopes: over all its N and over its three largest."""
    out = {}
    for name, col in SLOPE_COLS.items():
        s = per_n(g, col)
        out[f"{name}_slope_all"] = _slope(s)
        if name != "saved":
            out[f"{name}_slope_top3"] = _slope(s.tail(3))
    return out


def summarize(rows) -> dict:
    """Per attention: the largest N measured, the first failure, and the slopes of time and memory
    against N, fitted over distinct N (repeated lengths averaged first); with several seeds (a seed
    sweep), each seed's slopes and their mean. Crossovers from the per-N means."""
    df = _frame(rows)
    ok = df[df.status == "ok"]
    per_att = {}
    for name, g in ok.groupby("attention", sort=False):
        seeds = [getattr(x, "item", lambda x=x: x)() for x in dict.fromkeys(g.seed)] if "seed" in g else []
        if len(seeds) > 1:
            each = {seed: _slopes(g[g.seed == seed]) for seed in seeds}
            slopes = {k: (float(np.mean(v)) if (v := [e[k] for e in each.values() if e[k] is not None]) else None)
                      for k in next(iter(each.values()))}
            extra = {"seeds": seeds, "slopes_per_seed": {str(seed): e for seed, e in each.items()}}
        else:
            slopes, extra = _slopes(g), {}
        per_att[name] = {"largest_n": int(g.n.max()), **slopes, **extra}
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
            a = per_n(ok[ok.attention == lin], "time_per_sample_ms")
            b = per_n(ok[ok.attention == other], "time_per_sample_ms")
            common = sorted(set(a.index) & set(b.index))
            faster = [int(n) for n in common if a[n] < b[n]]
            # from the smallest N on which linear stays faster at every larger common N
            since = next((int(n) for n in common if all(a[m] < b[m] for m in common if m >= n)), None)
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
            mean = per_n(ok, col)  # seeds and repeated lengths: one point per N
            line, = ax.plot(mean.index, mean.values, marker="o", label=name)
            if col == "mem_per_sample_mb" and ok.saved_per_sample_mb.notna().any():  # the exact count beside
                saved = per_n(ok, "saved_per_sample_mb")
                ax.plot(saved.index, saved.values, ls="--", lw=1, color=line.get_color())
            bad = g[g.status != "ok"].head(1)
            if len(bad) and len(mean):
                ax.plot(bad.n, [mean.iloc[-1]], marker="x", ls="", ms=10, color=line.get_color())
                ax.annotate(bad.status.iloc[0], (bad.n.iloc[0], mean.iloc[-1]), fontsize=8,
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


def _pivot(df, col) -> str:
    """N down, attention across: the mean of the point's ok rows, else its first row's status."""
    atts, ns = list(dict.fromkeys(df.attention)), sorted(dict.fromkeys(df.n))
    cells = pd.DataFrame("", index=pd.Index(ns, name="n"), columns=pd.Index(atts, name="attention"))
    for (n, att), g in df.groupby(["n", "attention"], sort=False):
        ok = g[g.status == "ok"]
        cells.loc[n, att] = f"{ok[col].mean():.3g}" if len(ok) else str(g.status.iloc[0])
    return cells.to_string()


def backends(df) -> dict:
    """{attention: 'name (why)', ...}: the kernels its rows ran on (rows from before the record:
    none)."""
    if "kernel_backend" not in df:
        return {}
    out = {}
    for att, g in df.dropna(subset=["kernel_backend"]).groupby("attention", sort=False):
        pairs = dict.fromkeys(zip(g.kernel_backend, g.get("kernel_backend_why", pd.Series("", index=g.index))))
        out[att] = "; ".join(f"{b} ({w})" if isinstance(w, str) and w else str(b) for b, w in pairs)
    return out


def table(df) -> str:
    repeated = df[df.status == "ok"].groupby(["attention", "n"]).size().max() if (df.status == "ok").any() else 1
    note = (f"(each value: the mean of the point's rows, up to {repeated}: seeds or repeated lengths)\n"
            if repeated > 1 else "")
    return (f"{note}time per sample (ms)\n{_pivot(df, 'time_per_sample_ms')}\n\n"
            f"peak memory per sample (MB)\n{_pivot(df, 'mem_per_sample_mb')}\n\n"
            f"kept for backward per sample (MB, exact: saved tensors' storages)\n{_pivot(df, 'saved_per_sample_mb')}")


def aggregate(rows, out_dir, publish: bool = True) -> dict:
    """CSV, plot, summary and printed table for a list of benchmark rows (also in the folder the
    rows' `publish` names, through the guarded publish_folder, with the rows as benchmark_rows.jsonl;
    publish=False: out_dir alone, as a sweep's job does)."""
    out_dir = Path(out_dir)
    targets = output_dirs(rows, out_dir, RAW_NAME) if publish else [out_dir]  # refused before anything is written
    df = _frame(rows)
    summary = summarize(rows)
    lines = [table(df), ""]
    for name, s in summary["attentions"].items():
        slopes = ", ".join(f"{k} {v:.2f}" for k, v in s.items() if k.endswith(("_all", "_top3")) and v is not None)
        seeds = f" (mean over {len(s['seeds'])} seeds)" if "seeds" in s else ""
        lines.append(f"{name}: largest N {s['largest_n']}"
                     + (f" ({s['first_failure']})" if "first_failure" in s else "")
                     + (f"; slopes{seeds} {slopes}" if slopes else ""))
    for pair, c in summary["crossovers"].items():
        since = c["linear_faster_from_n"]
        lines.append(f"{pair}: linear faster from N={since} on" if since
                     else f"{pair}: linear never faster in this grid")
    lines += [f"{att}: kernel {b}" for att, b in backends(df).items()]
    text = "\n".join(lines)
    print(text)
    pos = [v["linear_faster_from_n"] for v in summary["crossovers"].values() if v["linear_faster_from_n"]]
    summary["headline"] = float(min(pos)) if pos else float("nan")
    for d in targets:
        atomic_write(d / "benchmark.csv", rows_to_csv(rows))
        atomic_write(d / "summary.json", json_text(summary, indent=2))
        atomic_write(d / "table.txt", text + "\n")
        _plot(df, d / "benchmark.png")
    return summary
