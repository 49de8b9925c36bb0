"""A sweep whose summary (the tasks' aggregate, run by the AggregateSweep callback) fails is a
failed sweep: Hydra turns an exception raised in a callback into a warning, so the callback
records it and run.py exits 1 naming it. A job killed before its final row (kill -9) leaves
rows the copy task's summary takes without failing."""
import json

import pandas as pd
from omegaconf import OmegaConf

from repro.cli import jobs
from repro.cli.callbacks import AggregateSweep
from repro.tasks.copy import finals


def _job(sweep, name, rows, target="repro.tasks.copy.run"):
    d = sweep / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text(f"task:\n  _target_: {target}\n")
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_failed_summary_is_recorded_not_raised(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    _job(sweep, "0", [{"task": "copy", "kind": "final"}])  # a row the copy summary cannot read (no max_len)
    monkeypatch.setattr(jobs, "summary_error", None)
    AggregateSweep().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}, "logger": None}))
    assert jobs.summary_error is not None
    err = capsys.readouterr().err
    assert f"error: the sweep's summary in {sweep} failed: " in err and "Traceback" not in err


def test_a_killed_jobs_rows_summarise_without_failing():
    rows = [{"task": "copy", "kind": "train", "step": s, "loss": 1.0, "max_len": 16, "attention": "linear",
             "seed": 0} for s in (1, 2)]
    f = finals(pd.DataFrame(rows))
    assert f.empty and "steps" in f.columns and "eval_loss" in f.columns
