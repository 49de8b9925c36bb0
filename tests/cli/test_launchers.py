"""Sweeps through the launcher plugins (conf/hydra/launcher): the basic launcher, the submitit
launcher's local executor (the SLURM path, minus sbatch) and joblib run a tiny two-point copy sweep
(the last two each job in its own process) as a user would, without naming hydra.sweep.dir: every
job lands in the one sweep dir announced, and the sweep ends aggregated there. Also: the SLURM
config composes with its overrides."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from repro.common.results import read_jsonl

REPO = Path(__file__).resolve().parents[2]  # tests/<folder>/this file
TINY = ["experiment=smoke_copy", "task.max_len=12", "task.batch_size=4", "model.n_layers=1", "model.d_model=16",
        "model.n_heads=2", "model.d_ff=16", "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=0",
        "trainer.checkpoint=false", "trainer.progress=false"]


def hydra_run(cwd, *args, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(REPO / "run.py"), *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 or not check, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def announced_sweep_dir(stdout) -> Path:
    (line,) = re.findall(r"^sweep dir: (.+)$", stdout, re.M)
    return Path(line)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["basic", "slurm_local", "joblib_cpu"])
def test_sweep_through_launcher_completes_and_aggregates(tmp_path, launcher):
    out = hydra_run(tmp_path, "-m", f"hydra/launcher={launcher}", *TINY, "seed=0,1").stdout
    sweep = announced_sweep_dir(out)
    # the one dir the launcher announced, and no other: each worker used to resolve ${uid:} again
    assert list((tmp_path / "multirun").glob("*/*")) == [sweep]
    if launcher != "slurm_local":  # (submitit jobs print to their own log files)
        assert sorted(re.findall(r"^run dir: (.+)$", out, re.M)) == [str(sweep / "0"), str(sweep / "1")]
    rows = read_jsonl(sweep / "copy.jsonl")
    finals = [r for r in rows if r["kind"] == "final"]
    assert sorted(r["seed"] for r in finals) == [0, 1] and all(r["status"] == "ok" for r in finals)
    assert (sorted({r["git_sha"] for r in rows}) and (sweep / "0/results.jsonl").is_file()
            and (sweep / "1/results.jsonl").is_file())
    table = pd.read_csv(sweep / "copy_final.csv")
    assert table.n_seeds.tolist() == [2] and (sweep / "copy_curves.png").stat().st_size > 0
    if launcher == "slurm_local":  # submitit's own job folder: pickled job, logs, result
        assert list((sweep / ".submitit").glob("*/*_result.pkl"))


def test_slurm_config_takes_cluster_overrides(compose_cfg):
    from hydra import compose, initialize_config_dir

    from repro.conf import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True,
                      overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                                 "hydra.launcher.gpus_per_node=4", "hydra.launcher.tasks_per_node=4",
                                 "hydra.launcher.nodes=2",
                                 "hydra.launcher.timeout_min=2880"])
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.partition, launcher.gpus_per_node, launcher.tasks_per_node, launcher.nodes,
            launcher.timeout_min) == ("gpu", 4, 4, 2, 2880)
    # the plugin's schema still checks keys
    with pytest.raises(Exception, match="gpus_per_nod"), \
            initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        compose(config_name="config", return_hydra_config=True,
                overrides=["hydra/launcher=slurm", "hydra.launcher.gpus_per_nod=4"])


@pytest.mark.slow
def test_a_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    """linformer cannot be causal: its job fails, the linear job still runs, the sweep is
    aggregated, the failure listed at the end, and the exit status is 1. (The record is a file in
    the job's dir, read by the launching process: the same for every launcher.)"""
    proc = hydra_run(tmp_path, "-m", *TINY, "attention=linformer,linear", check=False)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweep = announced_sweep_dir(proc.stdout)
    assert read_jsonl(sweep / "0/failed.json")[0]["error"].startswith("attention linformer is non-causal only")
    assert pd.read_csv(sweep / "copy_final.csv").attention.tolist() == ["linear"]
    lines = proc.stderr.splitlines()
    i = lines.index("error: 1 of 2 jobs of the sweep failed:")
    assert (lines[i + 1].startswith("  #0 ")
            and "attention=linformer: attention linformer is non-causal only" in lines[i + 1])
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_run_prints_its_dir_and_logs_to_run_log(tmp_path):
    out = hydra_run(tmp_path, *TINY, "seed=3").stdout
    assert out.startswith("run dir: "), out[:500]
    run_dir = Path(out.splitlines()[0].removeprefix("run dir: "))
    log = (run_dir / "run.log").read_text()  # Hydra's job log: what the run printed, as log lines
    assert "copy linear N=12 seed=3: ok, step 2" in log and "[stdout][INFO] - " in log


@pytest.mark.slow  # run.py runs
def test_a_command_failing_after_its_run_dir_was_made_removes_it(tmp_path):
    # a task's own check, after Hydra made the run dir: the dir holds only Hydra's files
    proc = hydra_run(tmp_path, "task=asr", "model=wsj_tiny", "task.source=kaldi", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: task.source=kaldi needs task.train_dir", proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_sweep_run_again_into_its_dir_resumes_its_jobs_and_forgets_old_failures(tmp_path):
    """An interrupted sweep is continued by running its command again: each job with a checkpoint
    goes on from it (here: finished, so nothing to train), and the failures recorded by an
    earlier run of it are forgotten; a different sweep into the same dir is refused."""
    tiny = [a for a in TINY if not a.startswith("trainer.checkpoint=")]
    first = hydra_run(tmp_path, "-m", "hydra.sweep.dir=sw", *tiny, "attention=linear,linformer", check=False)
    assert first.returncode == 1 and (tmp_path / "sw/1/failed.json").is_file()
    # another sweep into the same dir is refused, touching nothing
    other = hydra_run(tmp_path, "-m", "hydra.sweep.dir=sw", *tiny, "attention=linear", check=False)
    assert other.returncode == 2 and "already holds another sweep" in other.stderr
    (tmp_path / "sw/0/failed.json").write_text('{"overrides": [], "error": "an earlier failure"}\n')
    again = hydra_run(tmp_path, "-m", "hydra.sweep.dir=sw", *tiny, "attention=linear,linformer", check=False)
    assert "this sweep job has a checkpoint; resuming it" in again.stdout
    assert not (tmp_path / "sw/0/failed.json").exists()


def test_the_sweep_dir_is_pinned_when_hydra_alone_can_expand_the_sweep(tmp_path):
    """A glob() sweep, or hydra.mode=MULTIRUN without -m, still gets one fixed sweep dir."""
    from repro.cli.preflight import preflight

    for argv in (["-m", *TINY, "attention=glob(linear)"], ["hydra.mode=MULTIRUN", *TINY, "seed=0,1"]):
        pinned = [a for a in preflight(argv) if a.startswith("hydra.sweep.dir=")]
        assert len(pinned) == 1 and "${" not in pinned[0], argv


def test_the_job_log_keeps_a_progress_bar_as_its_last_state():
    """run.log's tee holds only the bar's current state between writes (it used to keep the
    whole \\r history: quadratic time over a long run)."""
    import io
    import logging

    from repro.cli.joblog import _Tee

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    handler = Lines()
    tee = _Tee(io.StringIO(), "stdout", logging.INFO, [handler])
    for i in range(5000):
        tee.write(f"\r{i:5d}/5000 |{'#' * (i % 40):40s}|")
        assert len(tee.pending) < 60
    tee.write("\nplain line\nhalf")
    tee.write(" a line\n")
    assert handler.lines == [f" 4999/5000 |{'#' * 39:40s}|", "plain line", "half a line"]


@pytest.mark.slow
def test_a_launcher_sweep_publishes_its_aggregate(tmp_path):
    """task.publish in a sweep: the sweep's aggregate (every job's rows) lands in the publish
    folder, found through each job's config; it used to hold the last job's rows alone (the
    callback aggregated without publishing, for the tasks that publish by argument)."""
    publish = Path("outputs") / f"test-publish-{os.getpid()}"
    args = ["-m", "hydra/launcher=joblib_cpu", "experiment=smoke_benchmark", "model=tiny", "attention=softmax,linear",
            "task.lengths=[16]", "task.tokens=16", "task.repeats=1", "task.warmup=0", "task.isolate=false",
            f"task.publish={publish}"]
    try:
        hydra_run(tmp_path, *args)
        table = pd.read_csv(REPO / publish / "benchmark.csv")
        assert sorted(table.attention) == ["linear", "softmax"], table
        # the sweep's command as typed (not the pinned sweep dir run.py adds), from the joblib workers' rows
        typed = " ".join(f"'{a}'" if "[" in a else a for a in args)
        assert (REPO / publish / "command.txt").read_text() == f"OMP_NUM_THREADS=1 python run.py {typed}\n"
    finally:
        import shutil
        shutil.rmtree(REPO / publish, ignore_errors=True)
