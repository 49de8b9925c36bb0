"""task=conformance: does an attention, the suite's (attention=<a config of conf/attention>) or
a user's (attention=custom attention._target_=package.module.Class), behave as the suite
expects? The checks (repro.attention.conformance) run on the layer built as the model builds it,
at the model's d_model and n_heads, on small random inputs in float64 and float32. One table
(property, result, detail) is printed and written under the run dir (conformance.csv and
.json); a property that fails ends the run with one line naming it (exit 1)."""
import pandas as pd

from repro.attention.conformance import check, first_failure
from repro.common.config import parse_device
from repro.common.errors import ConfigError, RunFailed
from repro.common.results import atomic_write, json_text, output_dirs, provenance, rows_to_csv, write_jsonl
from repro.conf import in_multirun, run_dir
from repro.conf.attention import attention_name, build_attention

COLUMNS = ["attention", "property", "result", "detail"]


def run(cfg) -> float:
    t, m = cfg.task, cfg.model
    if m is None or "d_model" not in m or "n_heads" not in m:
        raise ConfigError("task=conformance builds the attention at the model's width: model=<one of conf/model> "
                          "with d_model and n_heads (its preset: model=tiny)")
    name, device = attention_name(cfg), parse_device(cfg.device)
    target = cfg.attention._target_

    def build(d_model, n_heads):
        return build_attention(cfg, d_model, n_heads)

    table = check(build, m.d_model, m.n_heads, batch=t.batch, length=t.length, seed=cfg.seed, device=device)
    meta = {"task": "conformance", "attention": name, "target": target, "seed": cfg.seed, "status": "ok",
            "d_model": m.d_model, "n_heads": m.n_heads, "batch": t.batch, "length": t.length,
            "publish": t.get("publish"), "publish_replace": bool(t.get("publish_replace")), **provenance(device)}
    rows = [{**meta, **row} for row in table]
    out = run_dir(cfg)
    write_jsonl(out / "results.jsonl", rows)
    # a sweep's job keeps its table to its own dir: the sweep's summary publishes every job's rows once
    failures = aggregate([{**r, "publish": None} for r in rows] if in_multirun() else rows, out)
    failed = first_failure(table)
    if failed:
        raise RunFailed(f"attention {name} ({target}) fails {failed['property']}: {failed['detail']}")
    return failures


def format_table(df) -> str:
    """The columns aligned, the detail last and whole (no truncation: it holds the numbers)."""
    cols = [c for c in COLUMNS if c in df.columns]
    widths = {c: max(len(c), *(len(str(v)) for v in df[c])) for c in cols[:-1]}
    lines = ["  ".join(c.ljust(widths[c]) if c in widths else c for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) if c in widths else str(r[c]) for c in cols)
              for _, r in df.iterrows()]
    return "\n".join(lines)


def aggregate(rows, out_dir) -> float:
    """conformance.csv / .json / .txt: one row per (attention, property); a sweep over
    attentions gives one table of them all. Returns the number of failing properties."""
    df = pd.DataFrame(rows).sort_values("attention", kind="stable")  # a sweep's jobs come in job order
    first = df.iloc[0]
    sizes = f"d_model={first.d_model}, n_heads={first.n_heads}, batch={first.batch}, length={first.length}"
    which = (f"{first.attention} ({first.target})" if df.attention.nunique() == 1
             else f"{df.attention.nunique()} attentions")
    text = f"conformance of {which}: {sizes}, float64 and float32, on {first.device}\n" + format_table(df)
    print(text)
    table = df[["attention", "target", "property", "result", "detail"]].to_dict("records")
    for d in output_dirs(rows, out_dir, "conformance_rows.jsonl"):
        atomic_write(d / "conformance.csv", rows_to_csv(table))
        atomic_write(d / "conformance.json", json_text(table, indent=1) + "\n")
        atomic_write(d / "conformance.txt", text + "\n")
    return float((df.result == "fail").sum())
