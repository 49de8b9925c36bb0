"""What the "Beyond the paper" tables share: the folder each of the section's presets publishes
and the command that makes it (said where results/claims.yaml names no run yet), the table of a
folder the manifest names, and the marks of a run's rows."""
import re
from pathlib import Path

from repro.common.results import REPO
from repro.reproduction.manifest import ManifestError
from repro.reproduction.report import marks
from repro.reproduction.report.format import code, command
from repro.reproduction.report.schema import failed

# the folder each preset of conf/experiment publishes -> the command that makes it
RUNS = {
    "copy/successors_n128_cpu": "OMP_NUM_THREADS=1 python run.py -m experiment=copy_successors_cpu "
                                "hydra/launcher=joblib_cpu hydra.launcher.n_jobs=2",
    "copy/lengths_successors_cpu": "OMP_NUM_THREADS=1 python run.py -m experiment=copy_lengths_successors_cpu "
                                   "hydra/launcher=joblib_cpu hydra.launcher.n_jobs=2",
    "images/successors_cpu": "OMP_NUM_THREADS=1 python run.py -m experiment=mnist_successors_cpu",
    "throughput/successors_cpu": "OMP_NUM_THREADS=1 python run.py experiment=throughput_successors_cpu",
    "asr/successors_cpu": "python run.py -m experiment=asr_successors_cpu",
}
def not_yet_run(folder: str) -> str:
    """The line a table shows where the manifest names no run: the command that makes its preset's
    folder, once the preset exists (a command naming a preset that is not there would not run)."""
    preset = re.search(r"experiment=(\S+)", RUNS[folder])[1]
    if (REPO / "conf" / "experiment" / f"{preset}.yaml").is_file():
        return f"`{folder}`: not yet run: {code(RUNS[folder])}"
    return f"`{folder}`: not yet run (its preset, experiment={preset}, is not in conf/experiment yet)"


def source(folder: Path, root: Path) -> str:
    return f"`{folder.relative_to(root).as_posix()}`: {code(command(folder, root))}"


def checked(ctx, part: str, name: str, table):
    """(folder, the CSV `name` in it) of the folder the manifest names for this part of the section
    (report.successors.<part>; read once with every other CSV), checked against what this table
    needs; (None, None) when the manifest names none. A folder without the CSV: a ManifestError."""
    folder = ctx.manifest.folder("successors", part)
    if folder is None:
        return None, None
    found = [df for p, df in ctx.csvs if p == folder / name]
    if not found:
        raise ManifestError(f"report.successors.{part}: {folder.relative_to(ctx.root)} holds no {name}")
    table.check(folder / name, found[0], ctx.root)
    return folder, found[0]


def loaded_by(rows, key: str) -> dict:
    """{name: True where any of its final run rows ran with more runnable processes than cores}
    (its wall-clock values are inflated) from a folder's run rows."""
    out = {}
    for r in rows:
        if r.get("kind") == "final" and r.get(key) is not None:
            out[str(r[key])] = out.get(str(r[key]), False) or marks.loaded(r)
    return out


def with_mark(text: str, loaded: bool) -> str:
    return f"{text} (loaded)" if loaded else text


def status_of(status) -> str | None:
    """'failed (<status>)' for a failed run (its numbers are no result), else None."""
    return f"failed ({status})" if failed(status) else None
