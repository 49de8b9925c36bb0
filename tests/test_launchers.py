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

from repro.results import read_jsonl

REPO = Path(__file__).resolve().parent.parent
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
    assert sorted({r["git_sha"] for r in rows}) and (sweep / "0/results.jsonl").is_file() and (sweep / "1/results.jsonl").is_file()
    table = pd.read_csv(sweep / "copy_final.csv")
    assert table.n_seeds.tolist() == [2] and (sweep / "copy_curves.png").stat().st_size > 0
    if launcher == "slurm_local":  # submitit's own job folder: pickled job, logs, result
        assert list((sweep / ".submitit").glob("*/*_result.pkl"))


def test_slurm_config_takes_cluster_overrides(compose_cfg):
    from hydra import compose, initialize_config_dir

    from repro.config import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True,
                      overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=4",
                                 "hydra.launcher.tasks_per_node=4", "hydra.launcher.nodes=2",
                                 "hydra.launcher.timeout_min=2880"])
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.partition, launcher.gpus_per_node, launcher.tasks_per_node, launcher.nodes,
            launcher.timeout_min) == ("gpu", 4, 4, 2, 2880)
    with pytest.raises(Exception, match="gpus_per_nod"):  # the plugin's schema still checks keys
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            compose(config_name="config", return_hydra_config=True,
                    overrides=["hydra/launcher=slurm", "hydra.launcher.gpus_per_nod=4"])
