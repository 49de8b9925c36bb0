"""Stopping `python run.py` from outside, as a user does: SIGTERM, Ctrl-C (SIGINT), and SIGINT to
a process started with SIGINT ignored. Each writes its checkpoint, prints one line naming it and
the command that resumes it, and exits 143 / 130 without a traceback; the printed command resumes."""
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from repro.common.results import REPO, read_jsonl
from repro.training import load_checkpoint

pytestmark = pytest.mark.slow  # run.py runs, stopped

ARGS = ["experiment=smoke_copy", "attention=linear", "task.max_len=16", "task.batch_size=8", "model.n_layers=1",
        "trainer.log_every=1", "trainer.eval_every=0", "trainer.max_steps=100000", "trainer.progress=false"]


def start(run_dir, ignore_sigint=False):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "0"}
    return subprocess.Popen(
        [sys.executable, "run.py", *ARGS, f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None)


def test_sigterm_ctrl_c_and_ignored_sigint_stop_with_a_checkpoint_and_one_line(compose_cfg, tmp_path):
    cases = {"term": (signal.SIGTERM, False, 143), "int": (signal.SIGINT, False, 130),
             "int-ignored": (signal.SIGINT, True, 130)}
    procs = {name: start(tmp_path / name, ignore) for name, (_, ignore, _) in cases.items()}  # side by side: faster
    waiting, deadline = set(procs), time.time() + 120
    while waiting and time.time() < deadline:  # signal each once it is training (its first row written)
        for name in list(waiting):
            rows = tmp_path / name / "results.jsonl"
            if rows.exists() and rows.read_text().count("\n") >= 1:
                procs[name].send_signal(cases[name][0])
                waiting.discard(name)
        time.sleep(0.05)
    assert not waiting, "the runs did not start training within 120 s"
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        run_dir, code = tmp_path / name, cases[name][2]
        step = load_checkpoint(run_dir)["step"]
        line = (f"stopped by {cases[name][0].name} at step {step}: checkpoint {run_dir / 'checkpoints/last.pt'}; "
                f"resume with: python run.py {' '.join(ARGS)} trainer.resume={run_dir}")
        assert (proc.returncode, err.strip()) == (code, line), out
        assert read_jsonl(run_dir / "results.jsonl")[-1]["steps"] == step

    # the printed command continues the run (composed here, two more steps, instead of 100,000)
    command = shlex.split(err.strip().split("resume with: ")[1])
    assert command[:2] == ["python", "run.py"]
    from repro.tasks.copy import run

    run(compose_cfg(*command[2:], f"trainer.max_steps={step + 2}", f"+task.out_dir={tmp_path / 'resumed'}"))
    rows = read_jsonl(tmp_path / "resumed/results.jsonl")
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, step + 3))


def test_a_signal_outside_the_training_loop_stops_with_one_line(tmp_path):
    """Ctrl-C during start-up or a benchmark used to print a traceback, and a SIGINT to a run
    started with SIGINT ignored (a background job) was lost: the run went on and exited 0. Outside
    the loop a signal now ends the run at once: one line, 130 (SIGINT) or 143 (SIGTERM)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "0"}
    cases = {"int": (signal.SIGINT, False), "int-ignored": (signal.SIGINT, True), "term": (signal.SIGTERM, False)}
    procs = {name: subprocess.Popen(
        [sys.executable, "run.py", "experiment=smoke_benchmark", "task.time_budget_s=600",
         f"hydra.run.dir={tmp_path / name}"], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore else None)
        for name, (_, ignore) in cases.items()}
    deadline = time.time() + 120
    while time.time() < deadline and not all((tmp_path / n / ".hydra").is_dir() for n in cases):
        time.sleep(0.05)
    time.sleep(0.5)  # inside the benchmark: no training loop, no checkpoint
    for name, (sig, _) in cases.items():
        procs[name].send_signal(sig)
    for name, (sig, _) in cases.items():
        _, err = procs[name].communicate(timeout=120)
        assert procs[name].returncode == 128 + sig, err[-2000:]
        assert "Traceback" not in err and err.strip().splitlines()[-1] == (
            f"error: stopped by {sig.name} outside the training loop (no checkpoint written at this point)"), err


def test_an_error_raised_while_unwinding_from_the_stop_exits_as_the_stop(tmp_path):
    """The stop's SystemExit lands in whatever code runs; code whose `finally` then fails on what it
    left half-built (OmegaConf's flag_override did, mid-merge) used to turn the stop into a failed
    job: Hydra's report of that error and status 1. The run now exits as the stop, with its one line."""
    (tmp_path / "stop_task.py").write_text(
        "import os, signal, time\n\n"
        "def run(cfg):\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        time.sleep(60)\n"
        "    finally:\n"
        "        raise RuntimeError('broken while unwinding')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "run.py", "experiment=smoke_benchmark", "task._target_=stop_task.run",
         f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=env, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: stopped by SIGINT outside the training loop (no checkpoint written at this point)"), proc.stderr
    assert "broken while unwinding" not in proc.stderr and "Traceback" not in proc.stderr
