"""Result rows on disk: every row carries where and how it was measured, and every file is
written atomically (temporary file, then rename), so an interrupted run leaves no half file.
A published folder (a task's `publish` setting) is written through one guarded path,
publish_folder (output_dirs for a task's aggregate), which never replaces another run's rows or
files unless told to, and writes nothing before its checks pass."""
import io
import json
import math
import os
import platform
import shlex
import subprocess
import tempfile
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import cache
from pathlib import Path

import torch

from repro.common.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _umask() -> int:
    """This process's umask (from /proc on Linux: reading it elsewhere means setting it)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def atomic_write(path, data: str | bytes):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600; a result file gets what open() would give it (0666 less
        # the umask), so that others on a shared machine can read it when the umask says so
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_figure(fig, path):
    """A matplotlib figure as a PNG, written atomically; the figure is closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write(path, buf.getvalue())


def output_dirs(rows, out_dir, raw_name: str) -> list[Path]:
    """Where a task's aggregate goes: out_dir, and the `publish` folder (under the repository)
    that the rows name, if any, once publish_folder has let them in (raw rows written there as
    raw_name)."""
    publish = publish_folder(rows, raw_name)
    same = publish is not None and publish.resolve() == Path(out_dir).resolve()  # repro.cli.publish: one folder
    return [Path(out_dir)] + ([publish] if publish and not same else [])


# What tells one run from another in a folder's raw rows: a folder is replaced only by rows that
# hold every run it holds.
RUN_KEYS = ("task", "attention", "model", "seed", "max_len", "dataset", "size", "method", "implementation", "n",
            "batch")
RAW_ROWS = "*_rows.jsonl"  # every task's raw rows in a published folder (copy_rows.jsonl, benchmark_rows.jsonl, ...)
# How the refusal names the two settings: run.py's, or python -m repro.cli.publish's (publishing_as)
_OPTIONS = {"folder": "task.publish", "replace": "task.publish_replace=true"}


def _runs_of(rows) -> set:
    return {tuple(str(r.get(k)) for k in RUN_KEYS) for r in rows}


def repo_relative(path) -> str:
    """A path as it reads best in a message: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def publish_target(rows) -> Path | None:
    """The folder under the repository that the rows ask their aggregate to be published in (their
    `publish` setting), or None. Writes nothing: publish_folder does, after its checks."""
    publish = next((r.get("publish") for r in rows if r.get("publish")), None)
    return REPO / publish if publish else None


def check_publish(rows, raw_name: str | None = None) -> Path | None:
    """The rows' publish folder, or None; a ConfigError (one line naming the folder and the option)
    when publishing them would replace another run's rows or files. A folder is open when it holds
    no file (sub-folders aside, and command.txt, the record every publish rewrites: a GPU step
    writes its commands there before its jobs publish), when every raw-rows file in it (raw_name,
    *_rows.jsonl) holds only runs these rows hold too (the same sweep again, or more of it), or
    when the rows carry publish_replace (task.publish_replace=true). A folder with files but no
    raw rows cannot say whose they are: closed (the committed results made before raw rows were
    published hold none)."""
    folder = publish_target(rows)
    if folder is None or any(r.get("publish_replace") is True for r in rows):
        return folder
    where, opt = f"{_OPTIONS['folder']}={repo_relative(folder)}", _OPTIONS["replace"]
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{where}: a file, not a folder; publish into a folder")
    held = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
                  and p.name != "command.txt") if folder.is_dir() else []
    if not held:
        return folder
    raws = sorted(p for p in {*folder.glob(RAW_ROWS), *([folder / raw_name] if raw_name else [])} if p.is_file())
    if not raws:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ConfigError(f"{where}: the folder holds files of another run ({shown}) and no raw rows that say which "
                          f"runs made them; publish into another folder, or give {opt} to replace them")
    lost = 0
    for path in raws:
        try:
            old = read_jsonl(path, strict=True)
        except (OSError, ValueError) as err:
            raise ConfigError(f"{where}: its raw rows {path.name} cannot be read ({err}); publish into another "
                              f"folder, or give {opt} to replace them") from err
        lost += len(_runs_of(old) - _runs_of(rows))
    if lost:
        raise ConfigError(f"{where}: it holds the results of {lost} run(s) this one does not include "
                          f"({', '.join(p.name for p in raws)}); publish into another folder, or give {opt} "
                          f"to replace them")
    return folder


def publish_folder(rows, raw_name: str | None = None) -> Path | None:
    """The one guarded way into a published folder: check_publish first, and only then the
    commands that made the rows (their `command`, one a line) in its command.txt, so that the
    report never has to guess a published folder's command (rows from outside run.py name none:
    nothing written), and the rows themselves as raw_name. Returns the folder (None: the rows
    name none); the caller writes its aggregate there."""
    folder = check_publish(rows, raw_name)
    if folder is None:
        return None
    commands = dict.fromkeys(str(r["command"]) for r in rows if r.get("command"))
    if commands:
        atomic_write(folder / "command.txt", "".join(c + "\n" for c in commands))
    if raw_name:
        write_jsonl(folder / raw_name, rows)
    return folder


@contextmanager
def publishing_as(folder: str, replace: str):
    """Name the publish settings in check_publish's refusals as this caller's command line does."""
    saved = dict(_OPTIONS)
    _OPTIONS.update(folder=folder, replace=replace)
    try:
        yield
    finally:
        _OPTIONS.update(saved)


COMMAND_ENV = "REPRO_COMMAND"  # run.py puts its command line here; every row it makes carries it
RECORDED_ENV = ("OMP_NUM_THREADS", "REPRO_KERNEL")  # settings from the environment that change results


def run_load(row) -> float | None:
    """The 1-minute load average over a timed row's run (the larger of the loadavg_1min_start and
    _end it recorded), or None where it recorded neither (a dict or a table row; NaN is unrecorded)."""
    vals = [float(v) for v in (row.get("loadavg_1min_start"), row.get("loadavg_1min_end")) if v is not None and v == v]
    return max(vals) if vals else None


def run_command(argv: list[str], world_size: int = 1, env: dict | None = None) -> str:
    """The command line of a run.py process as the user typed it (argv without the program, before
    run.py adds to it), with the environment settings that change its results: this process's, or
    `env` for a run that another starts with those settings alone."""
    pairs = env.items() if env is not None else ((k, os.environ[k]) for k in RECORDED_ENV if os.environ.get(k))
    prefix = [f"{k}={shlex.quote(v)}" for k, v in pairs]
    start = ["python", "run.py"] if world_size <= 1 else ["torchrun", f"--nproc_per_node={world_size}", "run.py"]
    return " ".join([*prefix, *start, *map(shlex.quote, argv)])


def json_text(obj, **kwargs) -> str:
    """obj as strict JSON: NaN and infinities (not JSON) written as null."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v
    return json.dumps(clean(obj), allow_nan=False, **kwargs)


def write_jsonl(path, rows):
    atomic_write(path, "".join(json.dumps(r, default=str) + "\n" for r in rows))


def read_jsonl(path, strict: bool = False):
    """The rows of a JSONL file. A torn last line (no newline, not valid JSON: a run killed while
    appending, repro.training.rows) is left out, right for a run reading its own log; with
    strict (the report, the claims: they read finished files) it is an error naming the line, as
    any other bad line is: a row silently missing there changes a table or a verdict."""
    lines = Path(path).read_text().split("\n")
    rows = []
    for i, line in enumerate(lines[:-1], 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"line {i} is not valid JSON ({err.msg})") from err
    if lines[-1].strip():  # no newline after the last line: whole if it parses, torn if not
        try:
            rows.append(json.loads(lines[-1]))
        except json.JSONDecodeError as err:
            if strict:
                raise ValueError(f"line {len(lines)}: the last line is cut off (no newline at its end, not "
                                 f"valid JSON: {err.msg}): a write that did not finish") from err
    return rows


@cache
def git_sha() -> str:
    """$REPRO_GIT_SHA when the caller passes it (a copy of the tree on a remote GPU node, whose
    .git, when one travels, may be an older commit than the tree that was sent);
    else the checkout's commit (+ '-dirty'); else 'unknown'."""
    passed = os.environ.get("REPRO_GIT_SHA", "").strip()
    if passed:
        return passed
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    return out


def provenance(device: torch.device) -> dict:
    """What every row carries besides its metrics."""
    out = {"device": device_name(device), "versions": versions(), "git_sha": git_sha(),
           "time": datetime.now(UTC).isoformat(timespec="seconds")}
    if os.environ.get(COMMAND_ENV):  # made by run.py (see run_command): the command that made the row
        out["command"] = os.environ[COMMAND_ENV]
    return out


def rows_to_csv(rows) -> str:
    """Rows as CSV text; nested values (versions) as JSON."""
    import pandas as pd

    df = pd.DataFrame(rows)
    for col in df.columns:
        if df[col].map(lambda v: isinstance(v, (dict, list))).any():
            df[col] = df[col].map(json.dumps)
    return df.to_csv(index=False)
