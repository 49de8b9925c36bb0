"""A run whose loss turns non-finite fails: one line, exit 1 (a sweep: that job's failed.json and
exit 1 at the end, the other jobs unaffected), with its rows and summaries kept and marked."""
import json

import pandas as pd
import pytest
from run_cli import SMOKE_COPY, run_py

from repro.common.results import read_jsonl

pytestmark = pytest.mark.slow  # run.py runs and sweeps

ARGS = [*SMOKE_COPY, "trainer.max_steps=10"]


def run(*args, multirun=False):
    return run_py(*ARGS, *args, multirun=multirun)


def test_a_diverged_run_exits_1_with_one_line_and_keeps_its_rows(tmp_path):
    # lr=1e30: finite and positive, so the checks before the run let it through; it diverges at once
    res = run("trainer.optimizer.lr=1e30", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 1, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "the run diverged" in errors[0] and "non-finite loss" in errors[0], res.stderr
    assert "Traceback" not in res.stderr
    final = [r for r in read_jsonl(tmp_path / "results.jsonl") if r["kind"] == "final"]
    assert final and final[0]["status"].startswith("error: non-finite loss")
    summary = pd.read_csv(tmp_path / "copy_final.csv")
    assert summary.status.str.startswith("error: non-finite loss").all()


def test_a_diverged_job_fails_its_sweep_and_only_itself(tmp_path):
    res = run("trainer.optimizer.lr=1e30,1e-3", f"hydra.sweep.dir={tmp_path}", multirun=True)
    assert res.returncode == 1, res.stderr[-2000:]
    failed = json.loads((tmp_path / "0" / "failed.json").read_text())
    lr = [float(o.split("=")[1]) for o in failed["overrides"] if o.startswith("trainer.optimizer.lr=")]
    assert "the run diverged" in failed["error"] and lr == [1e30]
    assert not (tmp_path / "1" / "failed.json").exists()
    ok = [r for r in read_jsonl(tmp_path / "1" / "results.jsonl") if r["kind"] == "final"]
    assert ok[0]["status"] == "ok"
