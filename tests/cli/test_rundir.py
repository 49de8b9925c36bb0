"""One run per directory (repro.cli.rundir): a run or sweep into a directory that another process
holds, or into a finished run's directory, exits 2 with one line before Hydra writes anything;
a lock whose owner is gone does not block."""
import json
import os

import pytest
from run_cli import ENV, SMOKE_COPY, run_py

from repro.cli import rundir

ARGS = [*SMOKE_COPY, "trainer.max_steps=6"]


def run(*args, multirun=False):
    return run_py(*ARGS, *args, multirun=multirun)


def tree(d):
    return sorted((str(p.relative_to(d)), p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*"))


def one_error_line(res):
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    return errors[0]


@pytest.mark.slow  # run.py runs
def test_a_run_into_a_directory_held_by_another_exits_2_and_touches_nothing(tmp_path):
    held = tmp_path / "run"
    rundir.lock(held, "run")  # this process owns it, as a running run would
    (held / "results.jsonl").write_text('{"kind": "train"}\n')
    before = tree(held)
    res = run(f"hydra.run.dir={held}")
    assert res.returncode == 2
    line = one_error_line(res)
    assert str(held) in line and f"pid {os.getpid()}" in line and "in use by another run" in line
    assert tree(held) == before  # no .hydra/, no run.log, the rows as they were
    sweep = tmp_path / "sweep"
    rundir.lock(sweep, "sweep")
    res = run("trainer.max_steps=3,4", f"hydra.sweep.dir={sweep}", multirun=True)
    assert res.returncode == 2 and "in use by another run" in one_error_line(res)
    assert [p.name for p in sweep.iterdir()] == [rundir.LOCK]


@pytest.mark.slow  # run.py runs
def test_a_lock_left_by_a_dead_process_does_not_block(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / rundir.LOCK).write_text(json.dumps({"pid": 999999, "host": "gone", "started": "long ago"}) + "\n")
    res = run(f"hydra.run.dir={d}", "trainer.checkpoint=false")
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((d / rundir.LOCK).read_text())["pid"] != 999999  # the new owner's


@pytest.mark.slow  # run.py runs
def test_a_run_into_a_finished_runs_directory_is_refused_before_hydra_rewrites_its_record(tmp_path):
    d = tmp_path / "run"
    assert run(f"hydra.run.dir={d}").returncode == 0
    assert (d / "checkpoints" / "last.pt").is_file()
    before = tree(d)
    res = run(f"hydra.run.dir={d}", "seed=1")
    assert res.returncode == 2 and "already holds a run's checkpoint" in one_error_line(res)
    assert tree(d) == before  # .hydra/overrides.yaml and run.log untouched


@pytest.mark.slow  # run.py runs
def test_a_full_disk_and_a_run_dir_under_a_file_are_one_line(tmp_path):
    """ENOSPC while writing the rows (simulated: os.replace refuses results.jsonl) used to end in
    a traceback; a run dir named under a file too. Each is one line; nothing half-written stays."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import errno, os\n"
        "_replace = os.replace\n"
        "def replace(src, dst, *a, **k):\n"
        "    if str(dst).endswith('results.jsonl'):\n"
        "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))\n"
        "    return _replace(src, dst, *a, **k)\n"
        "os.replace = replace\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(site), ENV.get("PYTHONPATH", "")])}
    d = tmp_path / "run"
    res = run_py(*ARGS, f"hydra.run.dir={d}", env=env)
    assert res.returncode == 1, res.stderr[-2000:]
    line = one_error_line(res)
    assert "No space left on device" in line and "results.jsonl" in line
    assert not list(d.glob(".results.jsonl.*.tmp"))  # the temporary file went with the failed write
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    res = run(f"hydra.run.dir={blocker / 'run'}")
    assert res.returncode == 2 and str(blocker) in one_error_line(res)


def test_printing_the_config_takes_no_lock_and_makes_no_directory(tmp_path):
    d = tmp_path / "run"
    res = run(f"hydra.run.dir={d}", "--cfg", "job")
    assert res.returncode == 0 and "attention:" in res.stdout and not d.exists()


@pytest.mark.slow  # run.py runs
def test_a_run_inside_a_running_sweep_is_refused(tmp_path):
    """A single run named into a job directory of a sweep that is running (the sweep holds its
    sweep dir) is refused before it writes there; so is a sweep pinned inside it."""
    sweep = tmp_path / "sweep"
    rundir.lock(sweep, "sweep")  # this process runs the sweep
    (sweep / "0").mkdir()
    res = run(f"hydra.run.dir={sweep / '0'}")
    assert res.returncode == 2
    line = one_error_line(res)
    assert f"is inside {sweep}, which is in use by another run (pid {os.getpid()}" in line
    assert [p.name for p in (sweep / "0").iterdir()] == []
    res = run("trainer.max_steps=3,4", f"hydra.sweep.dir={sweep / 'inner'}", multirun=True)
    assert res.returncode == 2 and "is inside" in one_error_line(res) and not (sweep / "inner").exists()


@pytest.mark.slow
def test_torchrun_ranks_share_one_lock_taken_by_rank_0(tmp_path):
    """Under torchrun rank 0 takes the shared run dir's lock for every rank: a torchrun into a held
    directory fails (every rank exits 2) with one line from rank 0 and writes nothing there."""
    import subprocess
    import sys

    from run_cli import REPO

    held = tmp_path / "run"
    rundir.lock(held, "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / "run.py"),
           *ARGS, f"hydra.run.dir={held}"]
    res = subprocess.run(cmd, cwd=tmp_path, env={**ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=240)
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "in use by another run" in errors[0], res.stderr
    # torchrun's launcher reports a failed child with its own traceback; no frame of ours is in it
    assert f'File "{REPO / "run.py"}"' not in res.stderr and "repro/" not in res.stderr.split("Traceback", 1)[-1]
    assert [p.name for p in held.iterdir()] == [rundir.LOCK]


def test_a_directory_named_through_an_environment_variable_is_locked_too(tmp_path):
    """hydra.run.dir=${oc.env:RUNDIR}: resolved before the lock (it used to be skipped as if it
    were a fresh ${now:} directory, and two such runs wrote one folder)."""
    held = tmp_path / "envrun"
    rundir.lock(held, "run")
    res = run_py(*ARGS, "hydra.run.dir=${oc.env:RUNDIR}", env={**ENV, "RUNDIR": str(held)})
    assert res.returncode == 2 and "in use by another run" in one_error_line(res)
    assert [p.name for p in held.iterdir()] == [rundir.LOCK]


@pytest.mark.slow  # run.py runs
def test_a_refused_resume_in_place_leaves_the_runs_record_as_it_was(tmp_path):
    """trainer.resume=D hydra.run.dir=D with another seed: refused by the checkpoint's fingerprint
    before Hydra rewrites D/.hydra (it used to record seed=5 there, then refuse)."""
    d = tmp_path / "run"
    assert run(f"hydra.run.dir={d}").returncode == 0
    before = tree(d)
    res = run(f"hydra.run.dir={d}", f"trainer.resume={d}", "seed=5")
    assert res.returncode == 2 and "does not match this run: seed is 0 there, 5 here" in one_error_line(res)
    assert tree(d) == before
    res = run(f"hydra.run.dir={d}", f"trainer.resume={d}", "trainer.max_steps=8")  # an allowed change goes on
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.slow  # run.py runs
def test_a_finished_run_without_a_checkpoint_is_not_overwritten(tmp_path):
    d = tmp_path / "run"
    assert run(f"hydra.run.dir={d}", "trainer.checkpoint=false").returncode == 0
    before = tree(d)
    res = run(f"hydra.run.dir={d}", "trainer.checkpoint=false", "trainer.max_steps=7")
    assert res.returncode == 2 and "already holds a run's results" in one_error_line(res)
    assert tree(d) == before


@pytest.mark.slow  # run.py runs
def test_a_measuring_task_resumes_into_its_own_directory(tmp_path):
    """task=benchmark resumes from its rows when run again with hydra.run.dir=<its directory>
    (docs/benchmark.md): the refusal of a finished training run without a checkpoint does not
    touch it."""
    d = tmp_path / "bench"
    args = ["experiment=smoke_benchmark", "attention=linear", "task.lengths=[64]", "task.repeats=1",
            "task.warmup=0", f"hydra.run.dir={d}"]
    assert run_py(*args).returncode == 0
    res = run_py(*args)
    assert res.returncode == 0, res.stderr[-2000:]
