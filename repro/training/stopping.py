"""Stopping a training run: from outside, SIGINT (Ctrl-C) and SIGTERM (kill, a SLURM pre-emption);
from inside, the time limit trainer.max_time_s and a non-finite loss (DIVERGED, which
repro.cli.jobs.fail_if_diverged turns into the job's failure). The lines printed and the exit
statuses are described once, in docs/training.md ("A time limit", "Stopping and resuming"). A
SIGINT stops even a process started with SIGINT ignored: someone sent it on purpose.
"""
import shlex
import signal
import sys
import threading
from contextlib import contextmanager

# This job's runs that ended on a non-finite loss, "<run dir>: <what>" (Trainer.finish): their rows,
# summaries and last checkpoint stay for inspection, and run.py then fails the job.
DIVERGED: list[str] = []

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stop_on_signals():
    """Yields a list that SIGINT/SIGTERM append their number to, so the loop can finish the
    step and checkpoint before leaving (see `exit_stopped`). The old handlers come back after."""
    caught = []
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield caught
        return
    old = {s: signal.getsignal(s) for s in SIGNALS}
    for s in old:
        signal.signal(s, lambda signum, _: caught.append(signum))
    try:
        yield caught
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def resume_command(run_dir, world: int = 1, **changed) -> str:
    """The command line that continues this run: its own overrides (Hydra's record of them, this
    job's alone in a sweep) with trainer.resume=<run dir>, in a new run dir; `changed` replaces
    or adds overrides (trainer__max_time_s=120 -> trainer.max_time_s=120). Outside run.py (a
    notebook, a test) only the new overrides are known."""
    from hydra.core.hydra_config import HydraConfig

    new = [f"{k.replace('__', '.')}={v}" for k, v in changed.items()] + [f"trainer.resume={run_dir}"]
    if not HydraConfig.initialized():
        return f"add {' '.join(map(shlex.quote, new))} to the command that started it"
    dropped = {o.split("=", 1)[0] for o in new}
    kept = [o for o in HydraConfig.get().overrides.task if o.split("=", 1)[0].lstrip("+~") not in dropped]
    start = "python run.py" if world == 1 else f"torchrun --nproc_per_node={world} run.py"
    return " ".join([start, *map(shlex.quote, kept), *map(shlex.quote, new)])


def time_limit_line(limit: float, step: int, elapsed: float, run_dir, checkpoint, world: int = 1) -> str:
    """The line printed when trainer.max_time_s ended a run: where it stopped and, with a
    checkpoint, the command that trains on (resuming, with twice the limit)."""
    where = f"stopped at the time limit trainer.max_time_s={limit:g} at step {step}, {elapsed:.1f} s of training"
    if checkpoint is None:
        return f"{where}: no checkpoint (trainer.checkpoint=false); rows in {run_dir}/results.jsonl"
    more = resume_command(run_dir, world, trainer__max_time_s=f"{2 * limit:g}")
    return f"{where}: checkpoint {checkpoint}; to train on, resume with a larger limit: {more}"


def exit_stopped(signum: int, step: int, run_dir, checkpoint, world: int = 1, main: bool = True):
    """The one line (rank 0) and the exit: 128 + the signal's number, as the shell reports a
    process the signal killed. checkpoint: the file written at the stop, or None."""
    if main:
        name = signal.Signals(signum).name
        if checkpoint is None:
            where = f"no checkpoint (trainer.checkpoint=false); rows so far in {run_dir}/results.jsonl"
        else:
            where = f"checkpoint {checkpoint}; resume with: {resume_command(run_dir, world)}"
        print(f"stopped by {name} at step {step}: {where}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)
