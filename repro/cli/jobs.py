"""How a run.py job ends when its task raises.

An error that is the user's to fix (ConfigError, a constructor's error through Hydra's
instantiate, RunFailed) is one line, `error: ...`, on a line of its own (open progress bars are
closed first). A single run then exits (2 for a bad config, 1 for a run that produced nothing or
diverged) and leaves no run dir behind if nothing but Hydra's own files is in it. A job of a sweep
instead records its failure (<job dir>/failed.json: its overrides and the line; another error
also prints its traceback) and returns, so the sweep goes on; at the sweep's end
repro.cli.callbacks lists the failed jobs and run.py exits 1.
"""
import errno
import json
import shutil
import sys
import traceback
from pathlib import Path

from hydra.errors import InstantiationException

from repro.cli.rundir import LOCK
from repro.common.errors import ConfigError, RunFailed
from repro.common.results import atomic_write
from repro.conf import in_multirun
from repro.training.distributed import is_main
from repro.training.stopping import DIVERGED

FAILED_FILE = "failed.json"
failed_jobs: list[dict] = []  # in the launching process, after a sweep: its failed jobs
summary_error: str | None = None  # ... and why its summary (the tasks' aggregate) failed, if it did


# The file system's refusals (a full disk or quota, no permission, a read-only mount, a path
# through a file): the user's to fix, not a bug, so one line rather than a traceback.
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR)


def error_line(err) -> str | None:
    """The one line for an error that is the user's to fix; None for anything else (a bug:
    its traceback is what helps)."""
    if isinstance(err, InstantiationException) and err.__cause__ is not None:
        err = err.__cause__
    elif isinstance(err, OSError) and err.errno in DISK_ERRORS:
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror or err}{where} (results and checkpoints are written whole or not at all)"
    elif not isinstance(err, (ConfigError, RunFailed, InstantiationException)):
        return None
    return (str(err).strip().splitlines() or [type(err).__name__])[-1]


def _close_progress_bars():
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def _job_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def job_started():
    (_job_dir() / FAILED_FILE).unlink(missing_ok=True)  # a sweep rerun into the same dir
    DIVERGED.clear()  # the jobs of a sweep can share one process


def fail_if_diverged():
    """After the task returned: a run that ended on a non-finite loss fails its job (its rows,
    summaries and last checkpoint are kept)."""
    if DIVERGED:
        raise RunFailed(f"the run diverged: {'; '.join(DIVERGED)} (its rows, summaries and any earlier checkpoint "
                        "are kept; a lower learning rate or gradient clipping may help)")


def job_failed(err: Exception):
    """Called from run.py's main with the exception the task raised."""
    from hydra.core.hydra_config import HydraConfig

    line = error_line(err)
    _close_progress_bars()
    if line is None and not in_multirun():
        raise err  # a bug: Hydra reports it with its traceback
    if line is None:
        traceback.print_exception(err)
        line = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
    print(f"error: {line}", file=sys.stderr, flush=True)
    out = _job_dir()
    if in_multirun():
        atomic_write(out / FAILED_FILE, json.dumps({"overrides": list(HydraConfig.get().overrides.task),
                                                    "error": line}) + "\n")
        return None
    if is_main():  # one rank removes it
        _remove_if_empty(out)
    sys.exit(1 if isinstance(err, (RunFailed, OSError)) else 2)


def _remove_if_empty(run_dir: Path):
    """Remove a run dir holding only what Hydra writes (.hydra/, the job's log) and its lock, and its
    parents that this left empty, up to the working directory."""
    if not run_dir.is_dir() or any(p.name not in (".hydra", LOCK) and p.suffix != ".log" for p in run_dir.iterdir()):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    cwd, parent = Path.cwd().resolve(), run_dir.resolve().parent
    while parent != cwd and cwd in parent.parents and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


def sweep_failures(sweep_dir) -> list[dict]:
    """The failed jobs recorded under a sweep dir, in job order."""
    paths = sorted(Path(sweep_dir).glob(f"*/{FAILED_FILE}"), key=lambda p: (len(p.parent.name), p.parent.name))
    return [{"job": p.parent.name, **json.loads(p.read_text())} for p in paths]
