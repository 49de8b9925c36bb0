"""python -m repro.reproduce_gpu: the seven GPU steps, run here at tiny sizes on the CPU
(--smoke), so the script cannot rot; its resume logic and wall-clock cap on small jobs."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pandas as pd
import pytest
from report_manifest import write_manifest

from repro.common.results import read_jsonl
from repro.reproduction import gpu_pack, gpu_steps, report, reproduce_gpu
from repro.reproduction.jobs import Job, run_job
from repro.reproduction.reproduce_gpu import Ctx, Step, run_step

REPO = reproduce_gpu.REPO


def documented_windows() -> list[list[str]]:
    """The reproduce_gpu arguments of each command in docs/gpu.md's `<!-- gpu-window -->` blocks."""
    text = (REPO / "docs" / "gpu.md").read_text()
    blocks = re.findall(r"<!-- gpu-window -->\n```\n(.*?)```", text, re.S)
    assert blocks, "docs/gpu.md has no <!-- gpu-window --> block"
    return [shlex.split(line.split("repro.reproduce_gpu", 1)[1]) for block in blocks
            for line in block.splitlines() if "repro.reproduce_gpu" in line]


def returned_files(out: Path) -> list[Path]:
    """What a remote node returns from $OUT: every file, checked against limits such a node may
    set (at most 8 files of at most 16 MiB, no more than 2 folders down, plain names)."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    for f in files:
        rel = f.relative_to(out)
        assert len(rel.parts) <= 3, f"{rel} is more than 2 folders down"
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
        assert f.stat().st_size <= 16 << 20, rel
    return files


@pytest.mark.slow
def test_smoke_runs_every_step_and_the_report_reads_it(tmp_path):
    """docs/gpu.md's window commands, each as one remote-node command (--smoke here, on the CPU,
    with $OUT set): each returns its results as at most 8 files, and what they carry, unpacked
    into a fresh folder, is every step's results, which the report reads."""
    smoke_dir = REPO / "outputs" / "gpu-smoke"
    shutil.rmtree(smoke_dir, ignore_errors=True)
    clone = tmp_path / "clone"
    # GPU_BUNDLE_DIR: a gpu_bundle/ built here for a GPU machine holds Python 3.12 wheels; not for this run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PY": sys.executable, "REPRO_GIT_SHA": "0123abcd4567",
           "GPU_BUNDLE_DIR": str(tmp_path / "no_bundle")}
    commands = documented_windows()
    assert sorted(int(a[a.index("--steps") + 1]) for a in commands) == list(reproduce_gpu.STEPS)
    for i, args in enumerate(commands):
        out = tmp_path / f"OUT{i}"
        res = subprocess.run(["bash", "scripts/with_gpu_bundle.sh", sys.executable, "-m",
                              "repro.reproduction.reproduce_gpu", *args, "--smoke"],
                             cwd=REPO, capture_output=True, text=True, env={**env, "OUT": str(out)})
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
        files = returned_files(out)
        assert {f.name for f in files} == {"command.log", reproduce_gpu.PACK_NAME}, files
        reproduce_gpu.unpack([out / reproduce_gpu.PACK_NAME], into=clone)
    out, runs = clone / "outputs" / "gpu-smoke" / "results", smoke_dir / "runs"
    for step in reproduce_gpu.STEPS.values():
        assert json.loads((out / step / "status.json").read_text())["status"] == "done", step
    env = json.loads((out / "env" / "status.json").read_text())["jobs"]
    assert all(j["status"] == "skipped" and "GPU" in j["reason"] for j in env.values())  # GPU-only: say why
    assert json.loads((out / "env" / "env.json").read_text())["cuda_available"] in (True, False)
    for f in ("kernels/bench.csv", "figure1/benchmark.csv", "generation/throughput.csv", "copy/copy_final.csv",
              "mnist/bpd_final.csv", "mnist/bpd_vs_time.csv", "speech/asr_table.csv"):
        assert (out / f).is_file(), f
    # the fixed-time MNIST run ended itself at trainer.max_time_s (exit 0, done), and bits/dim
    # against time is its evaluations at their rows' elapsed_s
    assert "stopped: time limit" in (out / "mnist" / "bpd_final.csv").read_text()
    rows = read_jsonl(runs / "mnist" / "linear" / "results.jsonl")
    evals = [(r["step"], r["elapsed_s"], r["bits_per_dim"]) for r in rows if r["kind"] == "eval"]
    vs_time = pd.read_csv(out / "mnist" / "bpd_vs_time.csv")
    assert set(vs_time.attention) == {"softmax", "linear"}
    vs_time = vs_time[vs_time.attention == "linear"]
    assert list(vs_time.columns) == ["attention", "step", "elapsed_s", "eval_bpd", "device"]
    assert vs_time.step.tolist() == [e[0] for e in evals] and evals[-1][1] > 3
    assert vs_time.elapsed_s.tolist() == pytest.approx([e[1] for e in evals], rel=1e-9)
    assert vs_time.eval_bpd.tolist() == pytest.approx([e[2] for e in evals], rel=1e-9)
    assert (out / "figure1" / "command.txt").read_text().startswith("python run.py experiment=paper_benchmark")
    # two runs per training step, each publishing nothing itself (the second once replaced the
    # first's rows, or was refused): their rows kept as runs/<run>.jsonl, the aggregate over both.
    # A later window has no folders of finished runs (only a cut run's travel back): the aggregate
    # is made again from the kept rows, with a run from an earlier window in it
    for step, raw, kept in (("mnist", "image_rows.jsonl", ["linear.jsonl", "softmax.jsonl"]),
                            ("copy", "copy_rows.jsonl", ["linear-seed0.jsonl", "softmax-seed0.jsonl"])):
        assert sorted(p.name for p in (out / step / "runs").iterdir()) == kept
        assert {r["attention"] for r in read_jsonl(out / step / raw)} == {"softmax", "linear"}
    assert set(pd.read_csv(out / "mnist" / "bpd_final.csv").attention) == {"softmax", "linear"}
    shutil.rmtree(runs / "mnist")
    (out / "mnist" / "bpd_final.csv").unlink()
    reproduce_gpu.mnist_finish(Ctx(out, runs, smoke=True, device="cpu"))
    assert set(pd.read_csv(out / "mnist" / "bpd_final.csv").attention) == {"softmax", "linear"}
    # a rerun skips what is done, without starting anything
    assert reproduce_gpu.main(["--smoke", "--steps", "kernels,3", "--out", str(out), "--runs", str(runs)]) == 0
    assert all(r["git_sha"] == "0123abcd4567" for r in read_jsonl(out / "kernels" / "bench.jsonl")) or \
        (REPO / ".git").exists()  # where the tree has no .git, rows take the commit passed in
    # the report's readers take the GPU folders as they take the CPU ones
    write_manifest(out, figure1=["figure1"], figure2=["copy"], table_3=["speech"],
                   tables_1_2={"bits_per_dim": ["mnist"], "bpd_vs_time": ["mnist"]})
    text = report.build(out, tmp_path / "REPORT.md")
    assert "### figure1" in text and "### copy" in text and "### speech" in text
    assert "### Table 1, MNIST: held-out bits/dim against training time (mnist)" in text  # step 6's bpd_vs_time.csv
    table1 = text[text.index("### Table 1"):text.index("### Table 2")]
    # our bits/dim beside the paper's (the value moves with how far 3 s of training gets)
    assert re.search(r"\| linear \| 0\.644 \| \d+\.\d+ \|", table1), table1


def test_steps_are_parsed_and_a_bad_one_is_one_line(capsys):
    assert reproduce_gpu.parse_steps("1,3-5") == [1, 3, 4, 5]
    assert reproduce_gpu.parse_steps("env,kernels,7") == [1, 2, 7]
    with pytest.raises(SystemExit):
        reproduce_gpu.main(["--smoke", "--steps", "8"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--steps '8'" in err and "valid: 1-7" in err


def test_wall_cap_stops_a_job_with_sigterm(tmp_path):
    """The cap sends SIGTERM (the training loop's signal to checkpoint and write its final row)."""
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(3)); time.sleep(60)"
    status, rc, seconds = run_job(Job("j", [sys.executable, "-c", code], wall_s=0.5), tmp_path / "j.log")
    assert status == "stopped at wall" and rc == 3 and seconds < 30


def test_a_cut_training_run_resumes_and_force_starts_it_afresh(tmp_path):
    """A copy or MNIST run cut by its cap left a checkpoint: the next run resumes it (the MNIST
    run's time limit then counts on from the checkpoint's elapsed_s); --force starts it again."""
    for step, jobs, name in (("copy", reproduce_gpu.copy_jobs, "linear-seed0"),
                             ("mnist", reproduce_gpu.mnist_jobs, "linear")):
        run_dir = tmp_path / "runs" / step / name
        for force in (False, True):
            ctx = Ctx(tmp_path / "out", tmp_path / "runs", smoke=True, device="cpu", force=force)
            job = jobs(ctx)[1]  # linear (softmax first)
            assert (f"trainer.resume={run_dir}" in job.argv, job.fresh) == (False, run_dir)  # nothing to resume
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            (run_dir / "checkpoints" / "last.pt").touch()
            job = jobs(ctx)[1]  # linear (softmax first)
            resumed = f"trainer.resume={run_dir}" in job.argv
            assert (resumed, job.fresh) == ((False, run_dir) if force else (True, None)), (step, force)
            (run_dir / "checkpoints" / "last.pt").unlink()


def test_a_rerun_runs_only_what_did_not_finish(tmp_path, monkeypatch):
    counter, gate = tmp_path / "count", tmp_path / "gate"
    ok = [sys.executable, "-c", f"open({str(counter)!r}, 'a').write('a')"]
    gated = [sys.executable, "-c", f"import os, sys; sys.exit(0 if os.path.exists({str(gate)!r}) else 1)"]
    monkeypatch.setitem(reproduce_gpu.STEP_DEFS, 2, Step(2, lambda ctx: [Job("a", ok), Job("b", gated)]))
    ctx = Ctx(tmp_path / "out", tmp_path / "runs", smoke=True, device="cpu")
    assert not run_step(ctx, 2)  # b failed: the step is incomplete
    status = json.loads((ctx.out / "kernels" / "status.json").read_text())
    assert status["status"] == "incomplete" and status["jobs"]["b"]["status"] == "failed (exit 1)"
    gate.touch()
    assert run_step(ctx, 2) and counter.read_text() == "a"  # a was not run again
    assert run_step(ctx, 2) and counter.read_text() == "a"  # the step is done: nothing runs
    assert run_step(ctx, 2, force=True) and counter.read_text() == "aa"


def test_runs_that_finished_are_kept_and_aggregated_before_the_step_is_done(tmp_path, monkeypatch):
    """A training run that ends ok has its rows kept (runs/<name>.jsonl) and the aggregate made
    over the runs kept so far, while another run failed; one that ends ok without rows fails."""
    runs = tmp_path / "runs"
    write = "import json, sys, pathlib; p = pathlib.Path(sys.argv[1]); p.parent.mkdir(parents=True); " \
            "p.write_text(json.dumps({'attention': p.parent.name}) + '\\n')"
    a_rows = runs / "a" / "results.jsonl"
    jobs = [Job("a", [sys.executable, "-c", write, str(a_rows)], rows=a_rows),
            Job("b", [sys.executable, "-c", "import sys; sys.exit(1)"], rows=runs / "b" / "results.jsonl"),
            Job("c", [sys.executable, "-c", "pass"], rows=runs / "c" / "results.jsonl")]
    seen = []
    finish = lambda ctx: seen.append(sorted(p.name for p in (ctx.out / "copy" / "runs").iterdir()))
    monkeypatch.setitem(reproduce_gpu.STEP_DEFS, 5, Step(5, lambda ctx: jobs, finish=finish))
    ctx = Ctx(tmp_path / "out", runs, smoke=True, device="cpu")
    assert not run_step(ctx, 5)
    assert seen == [["a.jsonl"]]
    assert read_jsonl(ctx.out / "copy" / "runs" / "a.jsonl") == [{"attention": "a"}]
    status = json.loads((ctx.out / "copy" / "status.json").read_text())["jobs"]
    assert status["b"]["status"] == "failed (exit 1)" and status["c"]["status"] == "failed: it wrote no results.jsonl"
    assert not run_step(ctx, 5) and seen == [["a.jsonl"]]  # a is kept and not run again: nothing new to aggregate


def test_budget_stops_the_job_in_flight_and_starts_no_other(tmp_path, monkeypatch):
    """--budget-s: the job running near the deadline gets SIGTERM before it, the next one is not
    started, and the step is left incomplete for the next command."""
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(3)); time.sleep(60)"
    jobs = [Job("slow", [sys.executable, "-c", code], wall_s=400), Job("next", [sys.executable, "-c", "pass"])]
    monkeypatch.setitem(reproduce_gpu.STEP_DEFS, 2, Step(2, lambda ctx: jobs))
    monkeypatch.setattr(reproduce_gpu, "MIN_JOB_S", 1.5)  # 30 s at real budgets
    began = time.monotonic()
    rc = reproduce_gpu.main(["--smoke", "--steps", "2", "--budget-s", "4", "--out", str(tmp_path / "o"),
                             "--runs", str(tmp_path / "r")])
    assert rc == 1 and time.monotonic() - began < 8
    status = json.loads((tmp_path / "o" / "kernels" / "status.json").read_text())["jobs"]
    assert status["slow"]["status"] == "stopped at wall" and status["next"]["status"].startswith("not started")


def test_a_bad_budget_is_one_line(capsys):
    for bad in ("0", "-5", "inf", "nan"):
        with pytest.raises(SystemExit):
            reproduce_gpu.main(["--smoke", "--steps", "1", "--budget-s", bad])
        assert "--budget-s" in capsys.readouterr().err.strip().splitlines()[-1]


def test_sigterm_reaches_the_jobs_whole_process_group(tmp_path):
    """SIGTERM to reproduce_gpu stops the job in flight and the processes that job started (a job
    runs in a session of its own and would outlive its parent), and exits 143."""
    pidfile = tmp_path / "grandchild.pid"
    job = ("import subprocess, sys, time; "
           "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
           f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    script = (f"import sys; from repro.reproduction import reproduce_gpu as r; "
              f"from repro.reproduction.jobs import Job; "
              f"r.STEP_DEFS[2] = r.Step(2, lambda ctx: [Job('j', [sys.executable, '-c', {job!r}])]); "
              f"sys.exit(r.main(['--smoke', '--steps', '2', '--out', {str(tmp_path / 'o')!r}, "
              f"'--runs', {str(tmp_path / 'r')!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    for _ in range(300):
        if pidfile.is_file() and pidfile.read_text():
            break
        time.sleep(0.1)
    grandchild = int(pidfile.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143, proc.stdout.read()
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(grandchild, signal.SIGKILL)
        pytest.fail("the job's child outlived reproduce_gpu's SIGTERM")
    status = json.loads((tmp_path / "o" / "kernels" / "status.json").read_text())
    assert status["status"] == "incomplete"


def test_pack_splits_a_large_archive_and_unpack_rebuilds_it(tmp_path):
    repo = tmp_path / "repo"
    step = repo / "results" / "gpu" / "H100" / "kernels"
    (step / "logs").mkdir(parents=True)
    (step / "bench.jsonl").write_bytes(os.urandom(300_000))  # incompressible: the archive needs parts
    (step / "logs" / "bench.log").write_text("log\n")
    (repo / "outputs" / "gpu-smoke" / "results" / "copy").mkdir(parents=True)
    (repo / "outputs" / "gpu-smoke" / "results" / "copy" / "last.pt").write_bytes(b"weights")  # never packed
    parts = reproduce_gpu.pack(tmp_path / "OUT", repo=repo, part_bytes=100_000)
    assert len(parts) == 4 and all(p.stat().st_size <= 100_000 for p in parts)
    returned_files(tmp_path / "OUT")
    names = reproduce_gpu.unpack(reversed(parts), into=tmp_path / "here")
    assert ((tmp_path / "here" / "results/gpu/H100/kernels/bench.jsonl").read_bytes()
            == (step / "bench.jsonl").read_bytes())
    assert (tmp_path / "here" / "results/gpu/H100/kernels/logs/bench.log").read_text() == "log\n"
    assert not any(n.endswith(".pt") for n in names)


def test_unpack_refuses_a_member_outside_the_results(tmp_path, capsys):
    bad = tmp_path / "gpu_results.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        src = tmp_path / "x"
        src.write_text("x")
        tar.add(src, arcname="results/gpu/../../etc/x")
    with pytest.raises(SystemExit):
        reproduce_gpu.main(["--unpack", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "results/gpu/../../etc/x" in err and "not a file or folder under" in err
    with pytest.raises(SystemExit):
        reproduce_gpu.main(["--unpack", str(tmp_path / "none.tar.gz")])
    assert "no such file" in capsys.readouterr().err


def test_sanitizer_ignores_start_up_api_errors():
    """torch's and CuPy's start-up probes fail some CUDA API calls by design: compute-sanitizer
    must not count them, or every launch fails."""
    ctx = Ctx(Path("o"), Path("r"), smoke=False, device="cuda")
    for job in reproduce_gpu.env_jobs(ctx)[1:]:
        i = job.argv.index("--report-api-errors")
        assert job.argv[i + 1] == "no", job.argv


def test_every_step_fits_one_budgeted_command():
    """Each step's job caps add up to under the 500 s the documented commands give it, but the
    copy step's: its twelve runs at the paper's size take several commands, each run's cap under
    that budget (a run cut by it resumes in the next command)."""
    ctx = Ctx(Path("o"), Path("r"), smoke=False, device="cuda")
    for number, spec in reproduce_gpu.STEP_DEFS.items():
        caps = [j.wall_s or 0 for j in spec.jobs(ctx)]
        if number == 5:
            assert len(caps) == 12 and 0 < max(caps) <= 500, caps
        else:
            assert 0 < sum(caps) <= 500, (number, caps)


def test_a_passed_commit_beats_the_trees_git(monkeypatch):
    """On a remote node the tree's .git may be older than the commit sent: REPRO_GIT_SHA, when
    passed, is what rows record; without it the checkout's own commit."""
    from repro.common import results

    monkeypatch.delenv("REPRO_GIT_SHA", raising=False)
    results.git_sha.cache_clear()
    try:
        own = results.git_sha()
        assert own != "0123abcd4567" and (own == "unknown" or re.fullmatch(r"[0-9a-f]{12}(-dirty)?", own))
        monkeypatch.setenv("REPRO_GIT_SHA", "0123abcd4567")
        results.git_sha.cache_clear()
        assert results.git_sha() == "0123abcd4567"
    finally:
        results.git_sha.cache_clear()


def test_force_lets_a_step_replace_its_published_rows(tmp_path):
    """--force redoes a step whose folder already holds results (which the publish guard would
    keep): its jobs and its aggregate carry task.publish_replace, a plain rerun does not."""

    plain, forced = (Ctx(tmp_path, tmp_path / "runs", smoke=True, device="cpu", force=f) for f in (False, True))
    assert not any("publish_replace" in a for a in gpu_steps._run(plain, "copy", {"task": "copy"}, {}))
    assert "task.publish_replace=true" in gpu_steps._run(forced, "copy", {"task": "copy"}, {})
    assert not any("publish_replace" in a for a in gpu_steps._run(forced, "copy", {}, {}, publish=False))
    (tmp_path / "copy" / "runs").mkdir(parents=True)
    (tmp_path / "copy" / "runs" / "linear.jsonl").write_text('{"attention": "linear"}\n')
    runs = [("linear", 0, "linear")]
    assert [r.get("publish_replace") for r in gpu_steps.kept_rows(forced, "copy", runs)] == [True]
    assert [r.get("publish_replace") for r in gpu_steps.kept_rows(plain, "copy", runs)] == [None]


def test_the_copy_step_runs_pairs_first_then_the_others():
    """Step 5: softmax and linear seed by seed, then each other attention's seeds, one job a run
    with its seed and wall cap; the options are checked, a bad one is one line."""
    ctx = Ctx(Path("o"), Path("r"), smoke=False, device="cuda", copy_wall_s=300)
    jobs = gpu_steps.copy_jobs(ctx)
    assert [j.name for j in jobs] == ["softmax-seed0", "linear-seed0", "softmax-seed1", "linear-seed1",
                                      "softmax-seed2", "linear-seed2", "lsh-4-seed0", "lsh-4-seed1", "lsh-4-seed2",
                                      "delta-seed0", "delta-seed1", "delta-seed2"]
    assert all(j.wall_s == 300 for j in jobs)
    assert "attention=lsh-4" in jobs[7].argv and "seed=1" in jobs[7].argv and "experiment=paper_copy" in jobs[7].argv
    assert f"hydra.run.dir={Path('r/copy/lsh-4-seed1')}" in jobs[7].argv
    one = Ctx(Path("o"), Path("r"), smoke=False, device="cuda", copy_attentions=("linear", "delta"), copy_seeds=(4,))
    assert [(j.name, "seed=4" in j.argv) for j in gpu_steps.copy_jobs(one)] == [("linear-seed4", True),
                                                                               ("delta-seed4", True)]
    assert reproduce_gpu.parse_copy("linear,delta", "0, 2", 60) == {
        "copy_attentions": ("linear", "delta"), "copy_seeds": (0, 2), "copy_wall_s": 60}
    for args, says in ((("linear,nope", "0", 60), "--copy-attentions 'linear,nope': ['nope']; valid: "),
                       (("linear", "0,x", 60), "--copy-seeds '0,x': give seeds"),
                       (("linear", "0", 0), "--copy-wall-s 0: give a positive")):
        with pytest.raises(ValueError, match=re.escape(says)):
            reproduce_gpu.parse_copy(*args)


def test_a_step_done_earlier_runs_a_job_added_since(tmp_path, monkeypatch):
    """A step whose status says done is skipped only while every job it now has finished: a job
    added later (a new method, more seeds) runs, and the finished ones are not repeated."""
    ran = []

    def run_job(job, log, deadline=None):
        ran.append(job.name)
        return "ok", 0, 0.1
    monkeypatch.setattr(reproduce_gpu, "run_job", run_job)
    jobs = [Job("a", ["true"])]
    monkeypatch.setitem(reproduce_gpu.STEP_DEFS, 4, Step(4, lambda ctx: jobs))
    ctx = Ctx(tmp_path / "out", tmp_path / "runs", smoke=True, device="cpu")
    assert run_step(ctx, 4) and ran == ["a"]
    assert run_step(ctx, 4) and ran == ["a"]  # done: nothing runs
    jobs.append(Job("b", ["true"]))
    assert run_step(ctx, 4) and ran == ["a", "b"]


def test_a_cut_run_travels_in_the_pack_and_a_finished_one_does_not(tmp_path):
    """The pack takes the checkpoint and rows of a run its cap cut (no `ok` in its job file), so
    the next command resumes it on another node; a finished run's stay behind; unpacking puts
    them back where the step looks, and refuses any other file under outputs/."""
    repo = tmp_path / "repo"
    runs, results = repo / "outputs/gpu/GPU_X/copy", repo / "results/gpu/GPU_X/copy"
    for name in ("linear-seed0", "softmax-seed0"):
        (runs / name / "checkpoints").mkdir(parents=True)
        (runs / name / "checkpoints" / "last.pt").write_bytes(b"state of " + name.encode())
        (runs / name / "results.jsonl").write_text('{"step": 10}\n')
        (runs / name / "run.log").write_text("log")
    (results / "jobs").mkdir(parents=True)
    (results / "jobs" / "softmax-seed0.json").write_text('{"status": "ok"}')
    (results / "jobs" / "linear-seed0.json").write_text('{"status": "stopped at wall"}')
    cut = [f"outputs/gpu/GPU_X/copy/linear-seed0/{f}" for f in ("checkpoints/last.pt", "results.jsonl")]
    assert [p.as_posix() for p in gpu_pack.cut_runs(repo)] == cut
    files = gpu_pack.pack(tmp_path / "out", repo=repo)
    fresh = tmp_path / "fresh"
    names = gpu_pack.unpack(files, into=fresh)
    assert [n for n in names if n.startswith("outputs/")] == cut  # not the finished run, not a log
    assert (fresh / cut[0]).read_bytes() == b"state of linear-seed0"
    ctx = Ctx(fresh / "results/gpu/GPU_X", fresh / "outputs/gpu/GPU_X", smoke=False, device="cuda")
    linear = gpu_steps.copy_jobs(ctx)[1]
    assert linear.name == "linear-seed0" and linear.fresh is None
    assert f"trainer.resume={fresh / 'outputs/gpu/GPU_X/copy/linear-seed0'}" in linear.argv
    # the run finishes on the next node: unpacking its results forgets the local copy of the cut run
    (results / "jobs" / "linear-seed0.json").write_text('{"status": "ok"}')
    (runs / "linear-seed0" / "results.jsonl").unlink()
    gpu_pack.unpack(gpu_pack.pack(tmp_path / "out2", repo=repo), into=fresh)
    assert not (fresh / "outputs/gpu/GPU_X/copy/linear-seed0").exists()
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        tar.add(runs / "linear-seed0" / "run.log", arcname="outputs/gpu/GPU_X/copy/linear-seed0/run.py")
    with pytest.raises(ValueError, match="nor a cut run's checkpoint or rows"):
        gpu_pack.unpack([evil], into=fresh)
