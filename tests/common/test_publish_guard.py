"""Published results go through one guarded path (repro.common.results.publish_folder): a folder
holding another run's rows or files is not replaced unless the new rows include its runs or the
run says task.publish_replace=true; nothing in the folder is written before that check passes,
command.txt included. Every task that publishes, and python -m repro.cli.publish."""
import json

import pytest

from repro.common import results
from repro.common.errors import ConfigError
from repro.common.results import read_jsonl
from tests.run_cli import ENV, SMOKE_COPY, run_py

CPU = "AMD EPYC (2 cores, 1 threads)"
COMMAND = "python run.py task=x"


def snapshot(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ----------------------------------------------------------------------------- the guard itself

def _rows(folder, seeds=(0, 1, 2), **extra):
    return [{"task": "copy", "attention": a, "seed": s, "max_len": 16, "publish": str(folder), "command": COMMAND,
             **extra} for a in ("softmax", "linear") for s in seeds]


def test_a_folder_with_files_but_no_raw_rows_is_refused_and_left_as_it_was(tmp_path):
    """The committed Figure 1 folders hold a CSV, a plot and a README but no raw rows: nothing tells
    whose they are, so a run publishing there is refused (naming the folder and the option), and
    neither command.txt nor anything else is written; task.publish_replace=true replaces them."""
    folder = tmp_path / "figure1"
    folder.mkdir()
    (folder / "benchmark.csv").write_text("attention,n\nlinear,512\n")
    (folder / "command.txt").write_text("python run.py experiment=figure1_cpu\n")
    before = snapshot(folder)
    with pytest.raises(ConfigError) as err:
        results.output_dirs(_rows(folder), tmp_path / "run", "copy_rows.jsonl")
    line = str(err.value)
    assert "\n" not in line and f"task.publish={folder}" in line and "task.publish_replace=true" in line
    assert "benchmark.csv" in line and snapshot(folder) == before
    dirs = results.output_dirs(_rows(folder, publish_replace=True), tmp_path / "run", "copy_rows.jsonl")
    assert dirs == [tmp_path / "run", folder]
    assert (folder / "command.txt").read_text() == COMMAND + "\n" and len(read_jsonl(folder / "copy_rows.jsonl")) == 6


def test_a_refused_publish_leaves_command_txt_untouched(tmp_path):
    """A run of fewer runs than the folder holds: refused before command.txt is written (it used to
    be rewritten first, naming a command whose results the folder does not hold)."""
    folder = tmp_path / "pub"
    results.output_dirs(_rows(folder), tmp_path / "run", "copy_rows.jsonl")
    before = snapshot(folder)
    probe = [{**_rows(folder)[0], "command": "python run.py experiment=copy_claims_cpu seed=0"}]
    with pytest.raises(ConfigError, match="holds the results of 5 run\\(s\\) this one does not include"):
        results.output_dirs(probe, tmp_path / "run", "copy_rows.jsonl")
    assert snapshot(folder) == before
    # the same sweep again, or more of it, replaces them
    results.output_dirs(_rows(folder, seeds=(0, 1, 2, 3)), tmp_path / "run", "copy_rows.jsonl")
    assert len(read_jsonl(folder / "copy_rows.jsonl")) == 8


def test_another_tasks_raw_rows_and_unreadable_raw_rows_protect_the_folder(tmp_path):
    folder = tmp_path / "pub"
    results.output_dirs(_rows(folder), tmp_path / "run", "copy_rows.jsonl")
    bench = [{"task": "benchmark", "attention": "linear", "n": 16, "batch": 4, "seed": 0, "publish": str(folder)}]
    with pytest.raises(ConfigError, match="holds the results of 6 run"):
        results.output_dirs(bench, tmp_path / "run", "benchmark_rows.jsonl")
    assert not (folder / "benchmark_rows.jsonl").exists()
    (folder / "copy_rows.jsonl").write_text('{"task": "copy"}\n{"torn')
    with pytest.raises(ConfigError, match="raw rows copy_rows.jsonl cannot be read"):
        results.output_dirs(_rows(folder), tmp_path / "run", "copy_rows.jsonl")
    (folder / "copy_rows.jsonl").unlink()
    (folder / "notes.txt").write_text("a file no raw rows account for\n")
    with pytest.raises(ConfigError, match="holds files of another run \\(notes.txt\\) and no raw rows"):
        results.output_dirs(_rows(folder), tmp_path / "run", "copy_rows.jsonl")
    (folder / "notes.txt").unlink()  # command.txt and sub-folders alone (a GPU step's, before its jobs): open
    (folder / "jobs").mkdir()
    assert results.output_dirs(_rows(folder), tmp_path / "run", "copy_rows.jsonl")[1] == folder


# ----------------------------------------------------------------------------- every task's aggregate

def _benchmark(folder, attentions=("softmax", "linear"), **extra):
    return [{"task": "benchmark", "attention": a, "n": n, "batch": 4096 // n, "seed": 0, "status": "ok",
             "time_per_sample_ms": n / 100, "mem_per_sample_mb": n / 50, "saved_per_sample_mb": n / 60,
             "d_model": 64, "n_heads": 4, "dtype": "float32", "causal": True, "device": CPU, "command": COMMAND,
             "publish": str(folder), **extra} for a in attentions for n in (16, 32)]


def _throughput(folder, methods=("linear", "softmax"), **extra):
    return [{"task": "throughput", "size": "mnist", "method": m, "attention": m, "mode": "recurrent", "batch": 1,
             "seed": 0, "status": "oom", "reason": "over the limit", "command": COMMAND, "publish": str(folder),
             **extra} for m in methods]


def _kernels(folder, names=("chunked", "loop"), **extra):
    return [{"task": "kernels", "implementation": i, "n": 64, "batch": 1, "heads": 2, "d": 4, "m": 4, "seed": 0,
             "dtype": "float32", "device": CPU, "status": "ok", "forward_ms": 1.0, "forward_backward_ms": 2.0,
             "command": COMMAND, "publish": str(folder), **extra} for i in names]


def _image(folder, attentions=("softmax", "linear"), **extra):
    return [{"task": "image", "kind": "final", "dataset": "mnist", "attention": a, "seed": 0, "steps": 10,
             "train_loss": 1.0, "eval_bits_per_dim": 1.5, "time_per_step_ms": 5.0, "status": "ok",
             "command": COMMAND, "publish": str(folder), **extra} for a in attentions]


def _asr(folder, models=("bilstm", "linear"), **extra):
    return [{"task": "asr", "kind": "summary", "model": m, "seed": 0, "steps": 4, "epochs": 1.0, "valid_per": 0.9,
             "time_per_epoch_s": 2.0, "cpu_time_per_epoch_s": 2.0, "time_per_step_ms": 500.0, "n_params": 10,
             "mean_frames": 100.0, "max_frames": 120, "status": "ok", "data": "tts", "n_train": 4, "n_valid": 2,
             "n_test": 2, "batch_size": 2, "steps_per_epoch": 2, "precision": "fp32", "device": CPU,
             "command": COMMAND, "publish": str(folder), **extra} for m in models]


def _conformance(folder, attentions=("softmax", "linear"), **extra):
    return [{"task": "conformance", "attention": a, "target": f"repro.attention.{a}", "seed": 0, "d_model": 16,
             "n_heads": 2, "batch": 2, "length": 8, "device": CPU, "property": "causal", "result": "pass",
             "detail": "", "status": "ok", "command": COMMAND, "publish": str(folder), **extra} for a in attentions]


def _aggregate(task):
    from repro.tasks import asr, benchmark, conformance, image, kernels, throughput
    return {"benchmark": benchmark, "throughput": throughput, "kernels": kernels, "image": image, "asr": asr,
            "conformance": conformance}[task].aggregate


TASKS = [("benchmark", _benchmark, "benchmark_rows.jsonl", "benchmark.csv"),
         ("throughput", _throughput, "throughput_rows.jsonl", "throughput.csv"),
         ("kernels", _kernels, "kernels_rows.jsonl", "kernels.csv"),
         ("image", _image, "image_rows.jsonl", "bpd_final.csv"),
         ("asr", _asr, "asr_rows.jsonl", "asr_table.csv"),
         ("conformance", _conformance, "conformance_rows.jsonl", "conformance.csv")]


@pytest.mark.parametrize("task, make, raw, table", TASKS, ids=[t[0] for t in TASKS])
def test_every_task_publishes_through_the_guard(task, make, raw, table, tmp_path):
    """Each task's aggregate: publishes its files and raw rows into an empty folder; a run of fewer
    runs is refused with the folder untouched (command.txt included); so is a folder of files with
    no raw rows; publish_replace replaces both. (benchmark, throughput and kernels wrote straight
    into the folder before: a smoke run replaced the committed Figure 1.)"""
    aggregate, folder, bare = _aggregate(task), tmp_path / "pub", tmp_path / "bare"
    rows = make(folder)
    aggregate(rows, tmp_path / "run")
    assert (folder / table).is_file() and len(read_jsonl(folder / raw)) == len(rows)
    assert (folder / "command.txt").read_text() == COMMAND + "\n"
    before = snapshot(folder)
    fewer = [{**r, "command": "python run.py smoke"} for r in rows[: len(rows) // 2]]
    with pytest.raises(ConfigError, match=f"task.publish={folder}: it holds the results of"):
        aggregate(fewer, tmp_path / "run2")
    assert snapshot(folder) == before
    bare.mkdir()
    (bare / table).write_text("made by an earlier run\n")
    with pytest.raises(ConfigError, match="no raw rows .*task.publish_replace=true"):
        aggregate(make(bare), tmp_path / "run3")
    assert snapshot(bare) == {table: b"made by an earlier run\n"}
    aggregate([{**r, "publish_replace": True} for r in fewer], tmp_path / "run4")
    assert len(read_jsonl(folder / raw)) == len(fewer)
    assert (folder / "command.txt").read_text() == "python run.py smoke\n"


# ----------------------------------------------------------------------------- whole runs

TINY_BENCH = ["model=tiny", "task.tokens=64", "task.repeats=1", "task.warmup=0", "task.isolate=false"]


@pytest.mark.slow  # run.py runs
def test_a_smoke_benchmark_cannot_replace_a_published_figure(tmp_path):
    """python run.py experiment=smoke_benchmark ... task.publish=<the Figure 1 folder> exited 0 and
    replaced its CSV, summary, plot and table: now one line, exit 2, before measuring anything."""
    folder = tmp_path / "figure1-cpu"
    folder.mkdir()
    for name in ("benchmark.csv", "summary.json", "table.txt", "README.md"):
        (folder / name).write_text(f"the published {name}\n")
    before = snapshot(folder)
    proc = run_py("experiment=smoke_benchmark", "attention=linear", *TINY_BENCH, f"task.publish={folder}",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: task.publish={folder}: ") and \
        "task.publish_replace=true" in lines[0], proc.stderr
    assert snapshot(folder) == before and not (tmp_path / "run" / "results.jsonl").exists()
    proc = run_py("experiment=smoke_benchmark", "attention=linear", *TINY_BENCH, "task.lengths=[16,32]",
                  f"task.publish={folder}", "task.publish_replace=true", f"hydra.run.dir={tmp_path / 'run2'}")
    assert proc.returncode == 0, proc.stderr
    assert [r["n"] for r in read_jsonl(folder / "benchmark_rows.jsonl")] == [16, 32]
    assert (folder / "README.md").read_text() == "the published README.md\n"  # not the aggregate's: left alone


@pytest.mark.slow
def test_a_benchmark_sweep_publishes_once_at_its_end(tmp_path):
    """Each job of a sweep aggregates into its own folder only; the sweep's callback publishes all
    of its rows (each job publishing its own would be refused by the next one's guard)."""
    folder = tmp_path / "pub"
    proc = run_py("-m", *TINY_BENCH, "attention=softmax,linear", "task.lengths=16,32", f"task.publish={folder}",
                  f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 0, proc.stderr
    rows = read_jsonl(folder / "benchmark_rows.jsonl")
    assert sorted((r["attention"], r["n"]) for r in rows) == [("linear", 16), ("linear", 32), ("softmax", 16),
                                                               ("softmax", 32)]


@pytest.mark.slow
def test_a_conformance_sweep_publishes_once_at_its_end(tmp_path):
    """Conformance jobs published each their own table, so the second job was refused by the first
    one's rows; now the sweep's summary publishes both."""
    folder = tmp_path / "pub"
    proc = run_py("-m", "task=conformance", "model=tiny", "attention=softmax,linear", "task.length=9", "task.batch=2",
                  f"task.publish={folder}", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 0, proc.stderr
    assert {r["attention"] for r in read_jsonl(folder / "conformance_rows.jsonl")} == {"softmax", "linear"}


def test_kernels_and_throughput_refuse_before_measuring(compose_cfg, tmp_path):
    from repro.tasks import kernels, throughput

    folder = tmp_path / "pub"
    folder.mkdir()
    (folder / "kernels.csv").write_text("x\n")
    with pytest.raises(ConfigError, match="no raw rows"):
        kernels.run(compose_cfg("task=kernels", "task.lengths=[16]", f"task.publish={folder}", f"+run_dir={tmp_path}"))
    with pytest.raises(ConfigError, match="no raw rows"):
        throughput.run(compose_cfg("task=throughput", "model=tiny", "task.sizes=[mnist]", f"task.publish={folder}",
                                   f"+run_dir={tmp_path}"))
    assert snapshot(folder) == {"kernels.csv": b"x\n"} and not (tmp_path / "results.jsonl").exists()


# ----------------------------------------------------------------------------- copy, and repro.cli.publish

COPY = [*SMOKE_COPY, "model.n_layers=1", "trainer.max_steps=4", "trainer.log_every=2"]


@pytest.fixture(scope="module")
def copy_sweeps(tmp_path_factory):
    """Two finished tiny copy sweeps: seeds 0 and 1, and seed 2."""
    root = tmp_path_factory.mktemp("sweeps")
    for name, seeds in (("a", "0,1"), ("b", "2")):
        proc = run_py(*COPY, f"seed={seeds}", f"hydra.sweep.dir={root / name}", multirun=True)
        assert proc.returncode == 0, proc.stderr
    return root / "a", root / "b"


def publish_cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "repro.cli.publish", *map(str, args)], cwd=results.REPO, env=ENV,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # its fixture runs two run.py sweeps
def test_publish_cli_aggregates_finished_sweeps_through_the_guard(copy_sweeps, tmp_path):
    a, b = copy_sweeps
    folder = tmp_path / "copy" / "figure2"
    proc = publish_cli(a, "--to", folder)
    assert proc.returncode == 0, proc.stderr
    raw = read_jsonl(folder / "copy_rows.jsonl")
    assert {r["seed"] for r in raw} == {0, 1} and all(r["publish"] == str(folder) for r in raw)
    for name in ("copy_final.csv", "copy_curves.csv", "table.txt", "command.txt"):
        assert (folder / name).is_file(), name
    assert "seed=0,1" in (folder / "command.txt").read_text()  # the sweep's own command, from its rows
    before = snapshot(folder)
    proc = publish_cli(b, "--to", folder)  # seed 2 alone: not the runs the folder holds
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: --to={folder}: it holds the "
                                                                           "results of 2 run(s)"), proc.stderr
    assert "--replace" in lines[0] and snapshot(folder) == before
    assert publish_cli(a, b, "--to", folder).returncode == 0  # both sweeps: a superset
    assert {r["seed"] for r in read_jsonl(folder / "copy_rows.jsonl")} == {0, 1, 2}
    assert publish_cli(b, "--to", folder, "--replace").returncode == 0
    assert {r["seed"] for r in read_jsonl(folder / "copy_rows.jsonl")} == {2}


@pytest.mark.slow  # its fixture runs two run.py sweeps
def test_publish_cli_bad_input_is_one_line(copy_sweeps, tmp_path):
    a, _ = copy_sweeps
    other = tmp_path / "other"
    (other / "0").mkdir(parents=True)
    (other / "0" / "results.jsonl").write_text(json.dumps({"task": "nope", "seed": 0}) + "\n")
    for args, message in [((tmp_path / "missing", "--to", tmp_path / "x"), "no such directory"),
                          ((tmp_path, "--to", tmp_path / "x"), "rows are of 2 tasks"),
                          ((other, "--to", tmp_path / "x"), "rows of task 'nope': no task config runs it")]:
        if args[0] == tmp_path:
            (tmp_path / "copy_job").mkdir(exist_ok=True)
            (tmp_path / "copy_job" / "results.jsonl").write_bytes((a / "0" / "results.jsonl").read_bytes())
        proc = publish_cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


def test_the_publish_cli_finds_the_task_in_the_suites_configs_not_the_sweeps(copy_sweeps, tmp_path):
    """A job folder's .hydra/config.yaml naming another _target_ is not followed: files are data."""
    import shutil

    a, _ = copy_sweeps
    sweep = tmp_path / "sweep"
    shutil.copytree(a, sweep)
    for config in sweep.glob("*/.hydra/config.yaml"):
        config.write_text("task:\n  _target_: os.system\n")
    from repro.cli.publish import publish, task_module

    assert task_module("copy").__name__ == "repro.tasks.copy" and task_module("image").__name__ == "repro.tasks.image"
    folder = publish([sweep], str(tmp_path / "pub"))
    assert (folder / "copy_final.csv").is_file()


@pytest.mark.slow  # run.py runs
def test_a_copy_run_needs_publish_replace_to_replace_a_folder_without_raw_rows(tmp_path):
    """task.publish_replace=true on the command line reaches a task that takes it from no config of
    its own (copy): every row the run makes carries it (repro.common.results.provenance)."""
    folder = tmp_path / "pub"
    folder.mkdir()
    (folder / "copy_final.csv").write_text("old\n")
    proc = run_py(*COPY, f"task.publish={folder}", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        f"error: task.publish={folder}: the folder holds files of another run (copy_final.csv)"), proc.stderr
    assert snapshot(folder) == {"copy_final.csv": b"old\n"}
    proc = run_py(*COPY, f"task.publish={folder}", "task.publish_replace=true", f"hydra.run.dir={tmp_path / 'run2'}")
    assert proc.returncode == 0, proc.stderr
    assert (folder / "copy_final.csv").read_text() != "old\n" and (folder / "copy_rows.jsonl").is_file()
    assert all(r.get("publish_replace") is True for r in read_jsonl(folder / "copy_rows.jsonl"))
