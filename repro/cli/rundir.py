"""One run per directory. A run started with `hydra.run.dir=D`, and every sweep (its pinned
`hydra.sweep.dir`), holds an exclusive lock on its directory (`D/.lock`, an flock, with the
owner's pid, host, start time and command line written in it) from before Hydra writes anything
there (.hydra/, run.log) until the process ends. A second run into a held directory exits 2 with
one line naming the owner and touches nothing. The operating system releases the lock when its
owner dies (kill -9 included), so a lock left by a dead process is stale by construction: the
next run takes it. A run into a directory that holds a finished run's checkpoint is refused here
too, before Hydra rewrites that run's record, unless trainer.resume names it (and its checkpoint
accepts this run's settings); so is one that holds a run's results and no checkpoint. A sweep
into a sweep directory that holds another sweep (other overrides than its multirun.yaml records,
or job folders without one) is refused the same way (check_sweep_dir); the same sweep run again
resumes its jobs. A directory named through environment variables (${oc.env:X}) is resolved
first.

A directory inside one that another live run holds (a single run named into a running sweep's
job directory, or a sweep pinned inside another's) is refused the same way. Default run
directories carry ${uid:} and never collide. Under torchrun (several ranks share one run
directory) rank 0 takes the lock for all of them, once the run directory is shared (run.py). On
a network file system the lock is as good as its flock.
"""
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from repro.common.errors import ConfigError

LOCK = ".lock"
_held = []  # this process's open lock files: the lock lasts while the file stays open


def _override(argv, key):
    """The value of the last `key=value` override in argv (Hydra's quoting undone), or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = [a for a in argv if a.split("=", 1)[0].lstrip("+~") == key]
    if not lines:
        return None
    try:
        value = OverridesParser.create().parse_overrides([lines[-1]])[0].value()
    except Exception:  # a syntax error: Hydra reports it in its own words
        return None
    return value if isinstance(value, str) else None


def _owner(f) -> str:
    f.seek(0)
    try:
        owner = json.loads(f.read() or "{}")
    except ValueError:
        owner = {}
    if not owner:
        return "owner unknown"
    return f"pid {owner.get('pid')} on {owner.get('host')}, started {owner.get('started')}"


def _held_by_another(where: Path) -> str | None:
    """The owner of `where`'s lock when a live process holds it (its .lock is flocked), else None."""
    if not (where / LOCK).is_file():
        return None
    try:
        with open(where / LOCK) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _owner(f)
    except OSError:
        pass  # an unreadable lock file: not ours to judge
    return None


def _inside_held(d: Path):
    """Refuse `d` when it, or a directory above it, is held by a live run."""
    if who := _held_by_another(d):
        raise ConfigError(f"{d} is in use by another run ({who}): wait for it to end, or choose another "
                          f"directory (hydra.run.dir, hydra.sweep.dir)")
    for parent in d.parents:
        if who := _held_by_another(parent):
            raise ConfigError(f"{d} is inside {parent}, which is in use by another run ({who}): "
                              f"wait for it to end, or choose a directory outside it")


def lock(directory, what: str) -> Path:
    """Take `directory`'s lock for this process (made if missing) or raise ConfigError."""
    d = Path(directory).resolve()
    _inside_held(d)
    try:
        d.mkdir(parents=True, exist_ok=True)
        f = open(d / LOCK, "a+")
    except OSError as err:
        raise ConfigError(f"cannot use {d} as the {what} directory: {err.strerror or err}") from err
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = _owner(f)
        f.close()
        raise ConfigError(f"{d} is in use by another run ({who}): wait for it to end, or choose another "
                          f"directory (hydra.run.dir, hydra.sweep.dir)") from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv}) + "\n")
    f.flush()
    _held.append(f)
    return d


def hold(argv: list[str], multirun: bool):
    """Before Hydra starts: lock the run's named directory or the sweep's pinned one (see the
    module docstring). Raises ConfigError."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    directory = _resolved(_override(argv, key))
    if directory is None:  # Hydra's default (with ${uid:}) or a ${now:}: a fresh directory
        return None
    _inside_held(Path(directory).resolve())  # a live owner first: the checks below read what it writes
    if multirun:
        check_sweep_dir(Path(directory), argv)
    else:
        from repro.training.checkpoint import check_run_dir

        resume = _override(argv, "trainer.resume")
        check_run_dir(Path(directory), resume)
        rows = Path(directory) / "results.jsonl"
        if _trained(rows) and not (Path(directory) / "checkpoints" / "last.pt").is_file():
            # a finished (or failed) training run that kept no checkpoint: nothing to continue, its rows to
            # lose. (The measuring tasks, task=benchmark and the like, resume from their rows: not refused.)
            raise ConfigError(f"{directory} already holds a run's results ({rows}) and no checkpoint to continue "
                              f"it from: train in a new run dir (leave hydra.run.dir unset, or name another)")
        if resume:
            _check_resume(argv, resume)
    return lock(directory, "sweep" if multirun else "run")


def _task_overrides(lines) -> list | None:
    """The task overrides (not hydra.*) of a command line, parsed; None when they do not parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([str(a) for a in lines if not str(a).startswith("-")])
    except Exception:  # a syntax error: Hydra reports it in its own words
        return None
    return [o for o in parsed if not o.is_hydra_override()]


def _sweep_identity(overrides) -> list[str]:
    """What makes a sweep the sweep it is: its task overrides as typed, but the single values of
    settings a resume may change (trainer.max_steps, the logger, the device...:
    repro.training.parts.MAY_CHANGE_ON_RESUME), so that a sweep can be resumed to train on."""
    from repro.training.parts import MAY_CHANGE_ON_RESUME

    def may_change(o):
        return not o.is_sweep_override() and any(o.key_or_group == m or o.key_or_group.startswith(m + ".")
                                                 for m in MAY_CHANGE_ON_RESUME)
    return [o.input_line for o in overrides if not may_change(o)]


def check_sweep_dir(sweep_dir: Path, argv):
    """A sweep goes into a fresh dir, or into its own: the same sweep run again (the same task
    overrides as <sweep dir>/multirun.yaml records, settings a resume may change aside) resumes its
    jobs. Another sweep into a used dir is refused before Hydra writes there: its rows would mix
    with the earlier sweep's in one summary, and its jobs be counted with theirs."""
    from omegaconf import OmegaConf

    record = sweep_dir / "multirun.yaml"
    jobs = sorted({p.parent for p in [*sweep_dir.glob("*/.hydra"), *sweep_dir.glob("*/results.jsonl")]})
    mine = _task_overrides(argv)
    if mine is None or not (record.is_file() or jobs):
        return
    try:
        theirs = _task_overrides(OmegaConf.to_container(OmegaConf.load(record).hydra.overrides.task))
    except Exception:  # missing or unreadable: no record of a sweep to resume
        theirs = None
    if theirs is None:
        raise ConfigError(f"{sweep_dir} already holds runs ({jobs[0] if jobs else record}) and no readable record "
                          "of the sweep that made them (multirun.yaml): run this sweep in a new dir (leave "
                          "hydra.sweep.dir unset, or name another)")
    if _sweep_identity(theirs) != _sweep_identity(mine):
        typed = lambda overrides: " ".join(o.input_line for o in overrides) or "no overrides"
        raise ConfigError(f"{sweep_dir} already holds another sweep ({typed(theirs)}), not this one ({typed(mine)}): "
                          "their rows would mix in one summary; run this sweep in a new dir (leave hydra.sweep.dir "
                          "unset, or name another), or run that one again with its own overrides to resume its jobs")


def _trained(rows: Path) -> bool:
    """Whether a results.jsonl holds a training loop's rows (kind train, eval or final)."""
    if not rows.is_file():
        return False
    try:
        lines = rows.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            if json.loads(line).get("kind") in ("train", "eval", "final"):
                return True
        except (ValueError, AttributeError):
            continue
    return False


FRESH = ("${now:", "${uid:", "${hydra:")  # interpolations that name a new directory (or only Hydra knows)


def _resolved(directory):
    """The directory a `hydra.run.dir`/`hydra.sweep.dir` value names, its environment variables
    (${oc.env:X}) resolved; None for Hydra's fresh ones (${now:}, ${uid:}) and for what cannot be
    resolved here (Hydra reports that itself)."""
    if directory is None or "${" not in directory:
        return directory
    if any(f in directory for f in FRESH):
        return None
    from omegaconf import OmegaConf

    try:
        return str(OmegaConf.create({"d": directory}).d)
    except Exception:  # a missing variable or a bad interpolation: Hydra's to report
        return None


def _check_resume(argv, resume):
    """A resume that its checkpoint refuses (another seed, another size: a different fingerprint) is
    refused here, before Hydra rewrites the run's record (.hydra/) in place: the same check the
    trainer makes, on the config composed from these overrides."""
    from hydra import compose, initialize_config_dir

    from repro.conf import CONF_DIR
    from repro.training.checkpoint import check_fingerprint, load_checkpoint
    from repro.training.parts import default_fingerprint

    overrides = [a for a in argv if not a.startswith("-") and a.split("=", 1)[0].lstrip("+~").split(".")[0] != "hydra"]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        fingerprint = default_fingerprint(cfg)
    except Exception:  # a bad override: Hydra reports it in its own words, before any write
        return
    check_fingerprint(load_checkpoint(resume), fingerprint)
