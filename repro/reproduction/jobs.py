"""One job of a reproduction step: a command run in a process group of its own, its output
to a log, stopped with SIGTERM (to the whole group) at its wall-clock cap or before a deadline,
and stopped the same way when this process is interrupted."""
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from repro.common.results import REPO

GRACE_S = 60  # after SIGTERM, what a job has to checkpoint and write its last row before SIGKILL


def finished_ok(job_file) -> bool:
    """A step's jobs/<name>.json says its job finished (status ok): not to be run, or resumed, again."""
    path = Path(job_file)
    return path.is_file() and json.loads(path.read_text()).get("status") == "ok"


@dataclass
class Job:
    name: str
    argv: list
    wall_s: float | None = None  # past it: SIGTERM (a training run checkpoints and writes its final row)
    env: dict = field(default_factory=dict)
    skip: str | None = None  # why this job does not run here
    fresh: Path | None = None  # a folder removed before the job starts (a training run redone from scratch)
    # a training run's results.jsonl: once the job ends ok it is kept in the step's results as
    # runs/<name>.jsonl, which travel back from a remote GPU node in the packed results (the run
    # folder does not), so the step's aggregate over its runs can be made in a later window
    rows: Path | None = None


def shown(argv) -> str:
    """A job's command as a user types it: `python`, paths relative to the repository."""
    text = shlex.join("python" if a == sys.executable else str(a) for a in argv)
    return text.replace(f"{REPO}/", "")


class Interrupted(Exception):
    """This command got SIGTERM or SIGINT: the job in flight is stopped, nothing else starts."""


def on_signal(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def _stop_group(proc, grace_s):
    """SIGTERM to the job's whole process group (a sweep, compute-sanitizer's child), then
    SIGKILL to the group if it is still there after grace_s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=max(grace_s, 0.1))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the group, also where its leader has exited
    proc.wait()


def run_job(job, log_path, grace_s=GRACE_S, deadline=None):
    """Runs job.argv in the repository, its output to log_path; returns (status, rc, seconds).
    status: ok, failed (rc), stopped at wall (SIGTERM to the job's process group at its cap, counted
    from the start, or grace_s before `deadline`, a time.monotonic() value), killed (the group
    outlived grace_s after SIGTERM). When this process is interrupted (Interrupted), the job's
    group gets SIGTERM, then SIGKILL, before the exception goes on."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled"), **job.env}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    stop_at = began + job.wall_s if job.wall_s else float("inf")
    if deadline is not None:
        grace_s = min(grace_s, max((deadline - began) / 4, 1.0))
        stop_at = min(stop_at, deadline - grace_s)
    with open(log_path, "w") as log:
        log.write("$ " + shown(job.argv) + "\n")
        log.flush()
        # a session of its own: the job's group is signalled as one (a Ctrl-C at the terminal
        # reaches this process, which forwards it)
        proc = subprocess.Popen(list(map(str, job.argv)), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        stopped = False
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                now = time.monotonic()
                if not stopped and now >= stop_at:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)  # the loop finishes its step, evaluates, checkpoints
                    stopped = now
                if stopped and now - stopped > grace_s:
                    _stop_group(proc, 0)
                    return "killed", proc.returncode, now - began
        except BaseException:
            _stop_group(proc, min(grace_s, 20))
            raise
    seconds = time.monotonic() - began
    if stopped:
        return "stopped at wall", proc.returncode, seconds
    return ("ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"), proc.returncode, seconds
