"""docs/extending.md, done once: in a copy of the repository, an attention (its module, its
config, its test), a task (its module, its config) and a report table (one module) are added
from tests/extending/ exactly where the page says, and run end to end: the attention's test, the
task alone and as a launcher sweep that publishes, the copy task with the new attention, and
the report with the new section."""
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from repro.attention.conformance import PROPERTIES

REPO = Path(__file__).resolve().parents[1]
TOY = Path(__file__).resolve().parent / "extending"
PAGE = REPO / "docs" / "extending.md"
# what docs/extending.md says to add, and where (its tables name these paths)
ADDED = {"mean_attention.py": "repro/attention/mean.py", "mean.yaml": "conf/attention/mean.yaml",
         "toy_test_mean_attention.py": "tests/attention/test_mean_attention.py", "norms.py": "repro/tasks/norms.py",
         "norms_task.yaml": "conf/task/norms.yaml", "norms_section.py": "repro/reproduction/report/norms.py"}
# docs/extending.md, "Adding a kernel": the example op's files and where they go
KERNEL_ADDED = {"causal_mean/__init__.py": "repro/kernels/<op>/__init__.py",
                "causal_mean/reference.py": "repro/kernels/<op>/reference.py",
                "causal_mean/chunked.py": "repro/kernels/<op>/chunked.py",
                "toy_test_causal_mean.py": "tests/kernels/test_<op>.py"}


def test_the_documented_files_are_the_ones_added():
    """The page's tables name each place (with <name> for the example's name) and its example."""
    page = PAGE.read_text()
    assert "`tests/extending/my_attention/softplus.py`" in page  # the user's attention, left where it is
    for src, dest in ADDED.items():
        stem = Path(dest).stem.removeprefix("test_")
        assert f"`{dest.replace(stem, '<name>')}`" in page and f"`tests/extending/{src}`" in page, (src, dest)


@pytest.mark.slow
def test_an_attention_a_task_and_a_report_table_added_as_documented_run_end_to_end(tmp_path):
    clone = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("repro", "conf"):
        shutil.copytree(REPO / part, clone / part, ignore=ignore)
    shutil.copy(REPO / "run.py", clone / "run.py")
    (clone / "tests").mkdir()
    for src, dest in ADDED.items():
        (clone / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(TOY / src, clone / dest)
    env = {**os.environ, "PYTHONPATH": str(clone), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}

    def run(*args):
        res = subprocess.run([sys.executable, *args], cwd=clone, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"{args}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        return res.stdout

    run("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/attention/test_mean_attention.py")
    assert "norm" in run("run.py", "task=norms", "attention=mean", "model=tiny")
    run("run.py", "-m", "hydra/launcher=joblib_cpu", "task=norms", "attention=mean,softmax", "model=tiny",
        "task.publish=results/norms")
    table = pd.read_csv(clone / "results" / "norms" / "norms.csv")
    assert sorted(set(table.attention)) == ["mean", "softmax"] and len(table) == 4
    run("run.py", "experiment=smoke_copy", "attention=mean", "task.max_len=12", "task.batch_size=4",
        "trainer.max_steps=3", "trainer.eval_every=0", "trainer.checkpoint=false", "trainer.progress=false")
    (clone / "results" / "claims.yaml").write_text("report:\n  norms: [norms]\nruns:\n  norms: command.txt\n")
    run("-m", "repro.report", "--results", "results")
    report = (clone / "results" / "REPORT.md").read_text()
    assert "## Output norms (task=norms)" in report and "| mean | 8 |" in report

    # a user's attention, in a package of its own: the page's two commands, as written there
    user = tmp_path / "user"
    shutil.copytree(TOY / "my_attention", user / "my_attention", ignore=ignore)
    env["PYTHONPATH"] = os.pathsep.join([str(user), str(clone)])
    check, copy = user_commands()
    out = run(*check)
    shown = re.search(r"```\n(attention +property.*?)```", PAGE.read_text(), re.S)[1].splitlines()[1:]
    assert [re.split(r" {2,}", line)[1] for line in shown] == list(PROPERTIES)  # every property, in order
    for line in shown:  # each property with its result, as the page shows it
        attention, prop, result = re.split(r" {2,}", line)[:3]
        assert re.search(rf"^{attention} +{re.escape(prop)} +{result} ", out, re.M), line
    assert (clone / "outputs" / "conformance" / "conformance.csv").is_file()
    run(*copy, "task.max_len=12", "task.batch_size=4", "trainer.max_steps=3", "trainer.eval_every=0",
        "trainer.checkpoint=false", "trainer.progress=false")


def user_commands():
    """The page's `PYTHONPATH=tests/extending python run.py ...` commands: [run.py, args...] each,
    the conformance check's with a run dir of its own."""
    lines = re.findall(r"^ {4}PYTHONPATH=tests/extending python (run\.py .*)$", PAGE.read_text(), re.M)
    lines = [line for line in lines if "scorecard" not in line]  # the card: tests/tasks/test_scorecard.py
    assert len(lines) == 2 and "task=conformance" in lines[0] and "experiment=smoke_copy" in lines[1], lines
    check, copy = (shlex.split(line) for line in lines)
    return check + ["hydra.run.dir=outputs/conformance"], copy


@pytest.mark.slow
def test_a_kernel_added_as_documented_is_checked_against_its_reference(tmp_path):
    """"Adding a kernel" followed in a copy of the repository: the op folder's files where the page
    says, its test passes, the layout check flags the folder until KERNEL_FOLDERS names it; with a
    wrong PyTorch path the same test fails. Every op folder of the suite has the files the page
    lists as every folder's (its docstring) and its line in docs/kernels.md."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from test_structure import KERNEL_FOLDERS, misplaced_kernel_files
    finally:
        sys.path.remove(str(REPO / "tests"))
    page = PAGE.read_text()
    section = page[page.index("## Adding a kernel"):]
    end = section.find("\n## ", 5)
    section = section if end < 0 else section[:end]
    for src, dest in KERNEL_ADDED.items():
        assert f"`{dest}`" in section and f"`tests/extending/{src}`" in section, (src, dest)
    assert "`KERNEL_FOLDERS` of `tests/test_structure.py`" in section and "`docs/kernels.md`" in section
    kernels_doc = (REPO / "docs" / "kernels.md").read_text()
    for folder in KERNEL_FOLDERS:
        assert (REPO / "repro" / "kernels" / folder / "__init__.py").read_text().startswith('"""'), folder
        assert f"{folder}/" in kernels_doc, folder

    clone = tmp_path / "repo"
    shutil.copytree(REPO / "repro", clone / "repro", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (clone / "tests").mkdir()
    for src, dest in KERNEL_ADDED.items():
        target = clone / dest.replace("<op>", "causal_mean")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(TOY / src, target)
    assert misplaced_kernel_files(clone / "repro" / "kernels") != []  # until the folder is named
    assert misplaced_kernel_files(clone / "repro" / "kernels") == sorted(
        f"causal_mean/{Path(d).name}" for d in KERNEL_ADDED.values() if d.startswith("repro/"))
    env = {**os.environ, "PYTHONPATH": str(clone), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}

    def test_op():
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_causal_mean.py"]
        return subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True, timeout=300)

    res = test_op()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    chunked = clone / "repro" / "kernels" / "causal_mean" / "chunked.py"
    chunked.write_text(chunked.read_text().replace("torch.arange(1, ", "torch.arange(2, ").replace(
        "v.shape[2] + 1,", "v.shape[2] + 2,"))  # divides by i + 1: off by one
    res = test_op()
    assert res.returncode != 0 and "failed" in res.stdout, res.stdout[-3000:]
