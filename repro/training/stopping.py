"""Stopping a training run from outside: SIGINT (Ctrl-C) and SIGTERM (kill, a SLURM pre-emption).

fit() finishes the current step, writes the checkpoint and the final row, then prints one line
saying where the checkpoint is and the command that resumes it, and exits with the shell's
status for that signal (130 for SIGINT, 143 for SIGTERM), without a traceback. A process
started with SIGINT ignored (a background job of a script) is stopped by it all the same,
since someone sent it on purpose, and exits 130 too.
"""
import shlex
import signal
import sys
import threading
from contextlib import contextmanager

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


def resume_command(run_dir, world: int = 1) -> str:
    """The command line that continues this run: its own overrides (Hydra's record of them, this
    job's alone in a sweep) with trainer.resume=<run dir>, in a new run dir. Outside run.py
    (a notebook, a test) only the override is known."""
    from hydra.core.hydra_config import HydraConfig

    resume = f"trainer.resume={run_dir}"
    if not HydraConfig.initialized():
        return f"add {shlex.quote(resume)} to the command that started it"
    kept = [o for o in HydraConfig.get().overrides.task if o.split("=", 1)[0].lstrip("+~") != "trainer.resume"]
    start = "python run.py" if world == 1 else f"torchrun --nproc_per_node={world} run.py"
    return " ".join([start, *map(shlex.quote, kept), shlex.quote(resume)])


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
