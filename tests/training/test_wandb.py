"""wandb in offline mode (no network, no account): a training run leaves an offline run under its
run dir with the resolved config and the logged keys; a resume continues the same wandb run id;
a results folder's CSVs and figures go in as tables and images."""
import json
from pathlib import Path

import pytest

from repro.common.results import read_jsonl
from repro.tasks.copy import run
from repro.training import load_checkpoint
from repro.training.loggers import RUN_ID_FILE, publish_dir

BASE = ("experiment=smoke_copy", "attention=linear", "task.max_len=12", "task.batch_size=4", "model.n_layers=1",
        "model.d_model=16", "model.n_heads=2", "model.d_ff=16", "trainer.log_every=1", "trainer.eval_every=2",
        "trainer.eval_batches=1", "trainer.progress=false", "logger=wandb", "logger.mode=offline")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def offline_runs(run_dir):
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def history_keys(run):
    """Keys of every history record in the offline run's transaction log (wandb's own reader),
    and its config. wandb's service may still be writing the log when finish() returns: read
    until its exit record is there."""
    import time

    for _ in range(40):
        keys, config, done = _scan(run)
        if done:
            break
        time.sleep(0.25)
    return keys, config


def _scan(run):
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    store = datastore.DataStore()
    store.open_for_scan(str(next(run.glob("run-*.wandb"))))
    keys, config, done = set(), {}, False
    while (data := store.scan_data()) is not None:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            keys |= {item.key or "/".join(item.nested_key) for item in rec.history.item}
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in rec.config.update})
        elif kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in rec.run.config.update})
            config["_run"] = {"id": rec.run.run_id, "group": rec.run.run_group, "job_type": rec.run.job_type}
        done = done or kind == "exit"
    return keys, config, done


@pytest.mark.slow  # trains, then resumes
def test_offline_run_logs_config_and_metrics_and_resume_keeps_the_id(compose_cfg, tmp_path):
    first = tmp_path / "first"
    run(compose_cfg(*BASE, "trainer.max_steps=2", "logger.group=g1", f"+task.out_dir={first}"))
    (run1,) = offline_runs(first)
    run_id = (first / RUN_ID_FILE).read_text().strip()
    assert run1.name.endswith(run_id) and load_checkpoint(first)["logger_run_id"] == run_id
    keys, config = history_keys(run1)
    assert {"train/loss", "train/accuracy", "train/lr", "eval/loss", "final/train_loss"} <= keys
    assert config["model"]["d_model"] == 16 and config["trainer"]["max_steps"] == 2  # the resolved config
    assert config["_run"] == {"id": run_id, "group": "g1", "job_type": "copy"}

    rest = tmp_path / "rest"
    run(compose_cfg(*BASE, "trainer.max_steps=4", "logger.group=g1", f"trainer.resume={first}",
                    f"+task.out_dir={rest}"))
    (run2,) = offline_runs(rest)
    assert run2.name.endswith(run_id) and (rest / RUN_ID_FILE).read_text().strip() == run_id
    assert history_keys(run2)[1]["_run"]["id"] == run_id
    assert read_jsonl(rest / "results.jsonl")[-1]["steps"] == 4


def test_publish_dir_logs_tables_and_figures(compose_cfg, tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (tmp_path / "copy_final.csv").write_text("attention,eval_accuracy\nlinear,0.9\nsoftmax,0.95\n")
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    fig.savefig(tmp_path / "benchmark.png")
    cfg = compose_cfg("logger=wandb", "logger.mode=offline")
    assert publish_dir(cfg, tmp_path, group="sweep-x", job_type="sweep")
    (run_dir,) = offline_runs(tmp_path)
    keys, config = history_keys(run_dir)
    assert (any(k.startswith("tables/copy_final") for k in keys)
            and any(k.startswith("figures/benchmark") for k in keys)), keys
    (table,) = run_dir.glob("files/media/table/tables/copy_final_*.table.json")
    assert json.loads(table.read_text())["data"] == [["linear", 0.9], ["softmax", 0.95]]  # numbers stay numbers
    assert list(run_dir.glob("files/media/images/figures/benchmark_*.png"))
    assert config["_run"]["group"] == "sweep-x" and config["_run"]["job_type"] == "sweep"
    assert not publish_dir(compose_cfg("logger=csv"), tmp_path)  # other loggers: nothing to do


TINY_CLI = ["experiment=smoke_copy", "task.max_len=12", "task.batch_size=4", "model.n_layers=1", "model.d_model=16",
            "model.n_heads=2", "model.d_ff=16", "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=0",
            "trainer.checkpoint=false", "trainer.progress=false", "logger=wandb"]


def run_py(cwd, *args):
    import os
    import subprocess
    import sys

    from repro.common.results import REPO

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    # as from a shell: not the wandb service of this test process (a test above started it)
    env.pop("WANDB_SERVICE", None)
    proc = subprocess.run([sys.executable, str(REPO / "run.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Callback" not in proc.stderr, proc.stderr  # Hydra's warning when a callback raised
    return proc.stdout


def announced(stdout, what) -> "Path":
    import re

    (line,) = re.findall(rf"^{what} dir: (.+)$", stdout, re.M)
    return Path(line)


def logged(run_dir):
    """Every key logged by the offline runs under run_dir (a table's or image's key: its first two
    parts, tables/<name>), and the media files they hold."""
    keys = set()
    for offline_run in offline_runs(run_dir):
        keys |= {"/".join(k.split("/")[:2]) for k in history_keys(offline_run)[0]}
    media = {p.relative_to(p.parents[2]).as_posix() for p in run_dir.glob("wandb/offline-run-*/files/media/*/*/*")}
    return keys, media


@pytest.mark.slow
def test_a_run_from_the_command_line_uploads_its_tables_and_figures(tmp_path):
    keys, media = logged(announced(run_py(tmp_path, *TINY_CLI), "run"))
    assert {"train/loss", "tables/copy_final", "tables/copy_curves", "figures/copy_curves"} <= keys, keys
    assert any(m.startswith("table/tables/copy_final_") for m in media), media
    assert any(m.startswith("images/figures/copy_curves_") and m.endswith(".png") for m in media), media


@pytest.mark.slow
def test_a_sweep_from_the_command_line_uploads_its_aggregate(tmp_path):
    sweep = announced(run_py(tmp_path, "-m", *TINY_CLI, "seed=0,1"), "sweep")
    keys, media = logged(sweep)
    assert {"tables/copy_final", "tables/copy_curves", "figures/copy_curves"} <= keys, keys
    (table,) = [m for m in media if m.startswith("table/tables/copy_final_")]
    data = json.loads((next(sweep.glob(f"wandb/offline-run-*/files/media/{table}"))).read_text())
    assert data["columns"][:3] == ["max_len", "attention", "n_seeds"] and data["data"][0][:3] == [12, "linear", 2]
    for job in ("0", "1"):  # each job's own run has its metrics
        assert "train/loss" in logged(sweep / job)[0]
