"""python -m repro.reproduce_gpu: the seven GPU steps, run here at tiny sizes on the CPU
(--smoke), so the script cannot rot; its resume logic and wall-clock cap on small jobs."""
import json
import re
import subprocess
import sys

import pandas as pd
import pytest

from repro import report, reproduce_gpu
from repro.results import read_jsonl
from repro.reproduce_gpu import Ctx, Job, Step, run_job, run_step

REPO = reproduce_gpu.REPO


def test_smoke_runs_every_step_and_the_report_reads_it(tmp_path):
    out, runs = tmp_path / "results", tmp_path / "runs"
    res = subprocess.run([sys.executable, "-m", "repro.reproduce_gpu", "--smoke", "--out", str(out), "--runs", str(runs)],
                         cwd=REPO, capture_output=True, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
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
    assert list(vs_time.columns) == ["attention", "step", "elapsed_s", "eval_bpd", "device"]
    assert vs_time.step.tolist() == [e[0] for e in evals] and evals[-1][1] > 3
    assert vs_time.elapsed_s.tolist() == pytest.approx([e[1] for e in evals], rel=1e-9)
    assert vs_time.eval_bpd.tolist() == pytest.approx([e[2] for e in evals], rel=1e-9)
    assert (out / "figure1" / "command.txt").read_text().startswith("python run.py experiment=paper_benchmark")
    # a rerun skips what is done, without starting anything
    assert reproduce_gpu.main(["--smoke", "--steps", "kernels,3", "--out", str(out), "--runs", str(runs)]) == 0
    # the report's readers take the GPU folders as they take the CPU ones
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
    for step, jobs in (("copy", reproduce_gpu.copy_jobs), ("mnist", reproduce_gpu.mnist_jobs)):
        run_dir = tmp_path / "runs" / step / "linear"
        for force in (False, True):
            ctx = Ctx(tmp_path / "out", tmp_path / "runs", smoke=True, device="cpu", force=force)
            job = jobs(ctx)[0]
            assert (f"trainer.resume={run_dir}" in job.argv, job.fresh) == (False, run_dir)  # nothing to resume
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            (run_dir / "checkpoints" / "last.pt").touch()
            job = jobs(ctx)[0]
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
