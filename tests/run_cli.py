"""`python run.py ...` in a subprocess, as a user runs it (the tests of whole runs share this)."""
import os
import subprocess
import sys

from repro.common.results import REPO

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "0"}
# a copy-task run of a few seconds
SMOKE_COPY = ["experiment=smoke_copy", "attention=linear", "task.max_len=16", "task.batch_size=8", "model.n_layers=1",
              "trainer.log_every=5", "trainer.eval_every=0", "trainer.progress=false"]


def run_py(*args, multirun=False, env=None):
    argv = [sys.executable, "run.py", *(["-m"] if multirun else []), *args]
    return subprocess.run(argv, cwd=REPO, env=env or ENV, text=True, capture_output=True, timeout=600)
