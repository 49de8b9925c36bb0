"""Publish finished runs into a results folder, after the fact:

    python -m repro.cli.publish <sweep or run dir> [<dir> ...] --to results/<folder> [--replace]

Reads every job's results.jsonl under the given directories (a sweep's job folders, or run
folders), and hands the rows to their task's own aggregate with `publish` set to the --to folder:
the CSV, plots, table, command.txt and raw rows land there exactly as a run with task.publish would
have written them, through the same guard (repro.common.results.publish_folder): a folder holding
another run's rows or files is refused, in one line, unless the rows include all of its runs or
--replace is given. Use it to re-aggregate earlier runs, or several sweeps into one folder.

The task's module is found from the suite's own configs (conf/task), as a sweep's summary finds
it, never from a config found in the folders read: files are data.
"""
import argparse
import sys
from pathlib import Path

from repro.common.errors import ConfigError
from repro.common.results import publishing_as, read_jsonl, repo_relative


def _job_order(path: Path):
    """Job folders in number order (2 before 10), as the sweep ran them."""
    return [(0, int(x), "") if x.isdigit() else (1, 0, x) for x in path.parts]


def job_rows(dirs) -> list[dict]:
    """The rows of every results.jsonl under dirs, in folder order."""
    rows = []
    for d in map(Path, dirs):
        if not d.is_dir():
            raise ConfigError(f"{d}: no such directory; give sweep or run directories (they hold results.jsonl)")
        files = sorted(d.rglob("results.jsonl"), key=_job_order)
        if not files:
            raise ConfigError(f"{d}: no results.jsonl under it; give a finished sweep's or run's directory")
        for path in files:
            try:
                rows += read_jsonl(path)
            except (OSError, ValueError) as err:
                raise ConfigError(f"{path}: not readable rows ({err})") from err
    return rows


def task_module(task: str):
    """The module that aggregates rows of `task`, found as a sweep's summary finds it: among the
    suite's own task configs (conf/task), the one named after it (repro.cli.callbacks)."""
    from omegaconf import OmegaConf

    from repro.cli import callbacks

    none = OmegaConf.create({})  # no sweep's config: the suite's task configs alone
    module = callbacks.task_module(task, none, only=False)
    if module is None:
        valid = sorted({t.rsplit(".", 2)[-2] for t in callbacks.task_targets(none)})
        raise ConfigError(f"rows of task {task!r}: no task config runs it; valid: {', '.join(valid)}")
    return module


def publish(dirs, to: str, replace: bool = False) -> Path:
    """Aggregate the rows under dirs into the folder `to` (relative to the repository, like
    task.publish); returns the folder."""
    rows = job_rows(dirs)
    tasks = list(dict.fromkeys(r.get("task") for r in rows))
    if None in tasks:
        raise ConfigError("some rows name no task (a row's `task`); these are not a task's results")
    if len(tasks) != 1:
        raise ConfigError(f"the rows are of {len(tasks)} tasks ({', '.join(tasks)}); publish one task's runs "
                          f"into a folder")
    module = task_module(tasks[0])
    if not hasattr(module, "aggregate"):
        raise ConfigError(f"task {tasks[0]} ({module.__name__}) has no aggregate to publish with")
    folder = (Path.cwd() / to).resolve()
    rows = [{**r, "publish": repo_relative(folder), "publish_replace": replace} for r in rows]
    with publishing_as("--to", "--replace"):
        module.aggregate(rows, folder)
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repro.cli.publish", description=__doc__.split("\n\n")[1])
    parser.add_argument("dirs", nargs="+", help="sweep or run directories (each job's results.jsonl is read)")
    parser.add_argument("--to", required=True, help="the results folder, e.g. results/copy/figure2_cpu")
    parser.add_argument("--replace", action="store_true",
                        help="replace what the folder holds even when these rows do not include its runs")
    args = parser.parse_args(argv)
    try:
        folder = publish(args.dirs, args.to, args.replace)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"published into {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
