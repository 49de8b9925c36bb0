"""task=benchmark end to end at tiny sizes: rows, failure rows, aggregation, multirun."""
import json
import re
import subprocess
import sys

import pandas as pd
import pytest

from repro.common.errors import ConfigError, RunFailed
from repro.common.results import REPO, read_jsonl
from repro.tasks import benchmark
from repro.tasks.benchmark_point import measure_safely

TINY = ["model=tiny", "task.tokens=64", "task.repeats=1", "task.warmup=0", "task.lengths=[16,32]"]


def run_py(*args, timeout=240, umask=-1):
    return subprocess.run([sys.executable, "run.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, umask=umask)


def test_in_process_run_writes_rows_table_and_plot(compose_cfg, tmp_path):
    cfg = compose_cfg(*TINY, "task.isolate=false", "task.attentions=[softmax,linear]", f"+run_dir={tmp_path}")
    benchmark.run(cfg)
    rows = read_jsonl(tmp_path / "results.jsonl")
    assert [(r["attention"], r["n"], r["batch"]) for r in rows] == [
        ("softmax", 16, 4), ("softmax", 32, 2), ("linear", 16, 4), ("linear", 32, 2)]
    for r in rows:
        assert r["status"] == "ok" and r["time_per_sample_ms"] > 0 and r["mem_per_sample_mb"] >= 0
        assert {"device", "versions", "git_sha", "dtype", "seed"} <= r.keys()
    for f in ("benchmark.csv", "benchmark.png", "summary.json", "table.txt"):
        assert (tmp_path / f).stat().st_size > 0
    assert len(pd.read_csv(tmp_path / "benchmark.csv")) == 4


def test_every_point_records_the_load_over_its_measurement(compose_cfg, tmp_path, monkeypatch):
    """Each point's row carries the 1-minute load average read before and after it is measured
    (a time measured with more runnable processes than cores is marked by the scorecard)."""
    reads = iter(range(100))
    monkeypatch.setattr(benchmark.os, "getloadavg", lambda: (float(next(reads)), 0.0, 0.0))
    benchmark.run(compose_cfg(*TINY, "task.isolate=false", "task.attentions=[softmax,linear]", f"+run_dir={tmp_path}"))
    rows = read_jsonl(tmp_path / "results.jsonl")
    starts, ends = [r["loadavg_1min_start"] for r in rows], [r["loadavg_1min_end"] for r in rows]
    assert len(rows) == 4 and all(b == a + 1 for a, b in zip(starts, ends))  # one read each side of a point
    assert starts == sorted(starts) and len(set(starts + ends)) == 8
    assert {"loadavg_1min_start", "loadavg_1min_end"} <= set(pd.read_csv(tmp_path / "benchmark.csv"))


def test_timeout_is_a_row_and_longer_lengths_are_skipped(compose_cfg, tmp_path):
    cfg = compose_cfg(*TINY, "task.isolate=false", "task.attentions=[linear]", "task.time_budget_s=1e-6",
                      f"+run_dir={tmp_path}")
    with pytest.raises(RunFailed, match="no benchmark point succeeded"):
        benchmark.run(cfg)
    rows = read_jsonl(tmp_path / "results.jsonl")
    assert [r["status"] for r in rows] == ["timeout", "timeout"]
    assert rows[1]["reason"] == "skipped: timeout at N=16"


@pytest.mark.slow  # run.py in a subprocess
def test_a_benchmark_whose_every_point_failed_says_why_and_exits_nonzero(tmp_path):
    proc = run_py(*TINY, "task.isolate=false", "task.attentions=[linear]", "task.time_budget_s=1e-6",
                  f"hydra.run.dir={tmp_path}", umask=0o002)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert any(line.startswith("linear N=16: timeout: one pass took ") for line in lines), proc.stderr
    assert "linear N=32: timeout: skipped: timeout at N=16" in lines
    assert lines[-1].startswith("error: no benchmark point succeeded (2 failed, reasons above)")
    assert [r["status"] for r in read_jsonl(tmp_path / "results.jsonl")] == ["timeout", "timeout"]  # still written
    # summary.json is strict JSON (no bare NaN: null), and every file is as the umask says (not mkstemp's 0600)
    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert summary["headline"] is None
    for name in ("results.jsonl", "summary.json", "benchmark.csv", "benchmark.png", "table.txt"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o664, name


def test_out_of_memory_in_process_is_a_row():
    spec = {"attention": {"_target_": "repro.attention.LinearAttention", "_partial_": True}, "d_model": 256,
            "n_heads": 8, "n": 2**20, "batch": 2**20, "causal": True, "dtype": "float32", "device": "cpu",
            "warmup": 0, "repeats": 1, "time_budget_s": 10, "seed": 0}
    result = measure_safely(spec)  # a petabyte input: the allocator refuses at once
    assert result["status"] == "oom" and "allocate" in result["reason"]


@pytest.mark.slow  # run.py in a subprocess
def test_isolated_point_past_the_memory_limit_is_an_oom_row_and_the_sweep_goes_on(tmp_path):
    # 1.2 GiB: a fresh process with torch fits; softmax's (N, N) matrices at N=4096 do not.
    proc = run_py("task.attentions=[softmax-math,linear]", "task.lengths=[64,4096]", "task.tokens=4096",
                  "task.repeats=1", "task.warmup=0", "task.memory_limit_gb=1.2", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    rows = {(r["attention"], r["n"]): r for r in read_jsonl(tmp_path / "results.jsonl")}
    assert rows["softmax-math", 64]["status"] == "ok"
    assert rows["softmax-math", 4096]["status"] == "oom"
    assert rows["linear", 4096]["status"] == "ok"
    assert "largest N 64 (oom at N=4096)" in proc.stdout


@pytest.mark.slow  # run.py in a subprocess
def test_multirun_over_attention_and_length_aggregates_into_one_csv(tmp_path):
    proc = run_py("-m", *TINY[:-1], "task.isolate=false", "attention=softmax,linear", "task.lengths=16,32",
                  f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    df = pd.read_csv(tmp_path / "benchmark.csv")
    assert sorted(zip(df.attention, df.n)) == [("linear", 16), ("linear", 32), ("softmax", 16), ("softmax", 32)]
    assert (df.status == "ok").all()
    assert (tmp_path / "benchmark.png").exists()


def test_summary_slopes_and_crossover():
    rows = []
    for n in (256, 512, 1024, 2048):
        rows.append({"attention": "softmax", "n": n, "status": "ok", "time_per_sample_ms": (n / 256) ** 2,
                     "mem_per_sample_mb": (n / 256) ** 2})
        rows.append({"attention": "linear", "n": n, "status": "ok", "time_per_sample_ms": 3 * n / 256,
                     "mem_per_sample_mb": n / 256})
    rows.append({"attention": "softmax", "n": 4096, "status": "oom"})
    s = benchmark.summarize(rows)
    assert s["attentions"]["softmax"]["time_slope_all"] == pytest.approx(2.0)
    assert s["attentions"]["linear"]["mem_slope_all"] == pytest.approx(1.0)
    assert s["attentions"]["softmax"]["largest_n"] == 2048
    assert s["attentions"]["softmax"]["first_failure"] == "oom at N=4096"
    # linear: 3, 6, 12, 24 vs softmax 1, 4, 16, 64: faster from 1024 on
    assert s["crossovers"]["linear vs softmax"]["linear_faster_from_n"] == 1024


@pytest.mark.parametrize("args, message", [
    (["attention=foo"], "error: unknown attention 'foo'; valid: "),
    (["-m", "attention=softmax,nope"], "error: unknown attention 'nope'; valid: "),
    (["task=nope"], "error: unknown task 'nope'; valid: asr, benchmark, cifar, conformance, copy, kernels, mnist, "
                    "scorecard, throughput"),
    (["task.lengths=[0]"], "error: task.lengths must be positive integers; got"),
    (["task.dtype=float8"], "error: unknown dtype 'float8'; valid: float32"),
    (["attention=softmax", "attention.sdpa_backend=fast"], "error: softmax: unknown sdpa_backend 'fast'"),
    (["device=cuda:0"] if not __import__("torch").cuda.is_available() else ["device=tpu"], "error: "),
])
def test_bad_config_is_one_clear_line(args, message, tmp_path):
    proc = run_py(*args, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.slow  # a benchmark run twice
def test_rerun_in_the_same_dir_resumes_without_measuring_again(compose_cfg, tmp_path):
    cfg = compose_cfg(*TINY, "task.isolate=false", "task.attentions=[linear]", f"+run_dir={tmp_path}")
    benchmark.run(cfg)
    rows = read_jsonl(tmp_path / "results.jsonl")
    # an interrupted run: only the first point made it to disk
    (tmp_path / "results.jsonl").write_text(json.dumps(rows[0]) + "\n")
    benchmark.run(cfg)
    again = read_jsonl(tmp_path / "results.jsonl")
    assert again[0] == rows[0]  # kept as it was, not re-measured
    assert [r["n"] for r in again] == [16, 32] and again[1]["status"] == "ok"
    assert again[1]["time"] >= rows[1]["time"]


@pytest.mark.slow  # a benchmark run twice
@pytest.mark.parametrize("change, named", [
    ("model.d_model=32", "model.d_model=64 (now 32)"),
    ("task.tokens=128", "task.tokens=64 (now 128)"),
    ("attention.eps=1e-3", "eps=1e-06 (now 0.001)"),
])
def test_rerun_in_the_same_dir_with_other_settings_is_refused(compose_cfg, tmp_path, change, named):
    base = (*TINY, "task.isolate=false", "task.lengths=[16]", "attention=linear", f"+run_dir={tmp_path}")
    benchmark.run(compose_cfg(*base))
    before = (tmp_path / "results.jsonl").read_text()
    with pytest.raises(ConfigError,
                       match=r"results.jsonl holds rows measured with other settings: .*" + re.escape(named)):
        benchmark.run(compose_cfg(*base, change))
    assert (tmp_path / "results.jsonl").read_text() == before  # the old rows untouched


@pytest.mark.slow  # run.py in a subprocess
def test_a_killed_benchmark_leaves_no_point_running(tmp_path):
    """SIGKILL to run.py (no chance to clean up): the isolated point's process goes too."""
    import os
    import signal
    import time

    import psutil

    parent = subprocess.Popen([sys.executable, "run.py", "task.attentions=[softmax-math]", "task.lengths=[2048]",
                               "task.tokens=4096", "task.warmup=0", "task.repeats=100", "task.time_budget_s=600",
                               "task.isolate=true", f"hydra.run.dir={tmp_path}"], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    point = None
    try:
        for _ in range(600):  # the point's process appears once run.py has started (a few seconds)
            kids = [p for p in psutil.Process(parent.pid).children() if "repro.tasks.benchmark_point" in p.cmdline()]
            if kids:
                point = kids[0]
                break
            time.sleep(0.05)
        assert point is not None, "the benchmark started no point process"
        time.sleep(0.5)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        gone, alive = psutil.wait_procs([point], timeout=10)
        assert not alive, "the point outlived its benchmark"
    finally:
        if parent.poll() is None:
            parent.kill()
        if point is not None and point.is_running():
            point.kill()


def test_gpu_memory_cap_sets_the_fraction_of_the_gpu(monkeypatch):
    """task.gpu_memory_gb: the paper's 11 GB card on an 80 GiB GPU is a fraction of 11/80 of it
    (the CUDA calls mocked); a CPU run, a bad value or more than the GPU has is one line."""
    import torch

    from repro.common.errors import ConfigError
    from repro.training.memory import cap_gpu_memory

    set_to = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 80 * 2**30}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: set_to.append((f, d)))
    gpu = torch.device("cuda", 0)
    assert cap_gpu_memory(gpu, 11) == pytest.approx(11 / 80) and set_to == [(pytest.approx(11 / 80), gpu)]
    assert cap_gpu_memory(gpu, None) is None and len(set_to) == 1
    for bad, why in ((0, "positive number"), (-1, "positive number"), (float("inf"), "positive number"),
                     (96, "the GPU has 80.0 GiB")):
        with pytest.raises(ConfigError, match=why):
            cap_gpu_memory(gpu, bad)
    with pytest.raises(ConfigError, match="this run is on cpu"):
        cap_gpu_memory(torch.device("cpu"), 11)


def _linear_rows(ns, seed=0, scale=1.0, noise=()):
    """Linear-time synthetic rows: time and memory per sample proportional to N (times noise[i])."""
    return [{"attention": "linear", "n": n, "seed": seed, "status": "ok",
             "time_per_sample_ms": scale * n / 128 * (noise[i] if i < len(noise) else 1.0),
             "mem_per_sample_mb": scale * n / 128} for i, n in enumerate(ns)]


def test_slopes_are_fitted_over_distinct_lengths():
    """task.lengths=[128,128] wrote a time slope of 0.33 (a fit over two rows of one N); repeated
    lengths are averaged first: one distinct N has no slope, and repeats around a linear trend
    give 1."""
    s = benchmark.summarize(_linear_rows([128, 128], noise=(1.0, 1.3)))["attentions"]["linear"]
    assert s["time_slope_all"] is None and s["time_slope_top3"] is None
    rows = _linear_rows([128, 256, 512, 512, 512], noise=(1.0, 1.0, 0.8, 1.0, 1.2))  # 512: mean 1.0 of the trend
    s = benchmark.summarize(rows)["attentions"]["linear"]
    assert s["time_slope_all"] == pytest.approx(1.0) and s["time_slope_top3"] == pytest.approx(1.0)
    assert s["mem_slope_top3"] == pytest.approx(1.0)


def test_a_seed_sweep_is_summarised_per_seed_then_across_seeds():
    """A seed sweep's summary read 0.36 for time_slope_top3 while each job's slope was about 1:
    its three largest rows were one N's three seeds. Each seed's slope, then their mean."""
    rows = [r for seed, scale in ((0, 1.0), (1, 1.5), (2, 0.7))
            for r in _linear_rows([128, 256, 512], seed=seed, scale=scale)]
    scale = {0: 1.0, 1: 1.5, 2: 0.7}
    rows += [{**r, "attention": "softmax", "time_per_sample_ms": 0.6 * scale[r["seed"]] * (r["n"] / 128) ** 2}
             for r in rows]
    s = benchmark.summarize(rows)["attentions"]
    assert s["linear"]["time_slope_top3"] == pytest.approx(1.0) and s["linear"]["time_slope_all"] == pytest.approx(1.0)
    assert s["linear"]["seeds"] == [0, 1, 2]
    assert [v["time_slope_all"] for v in s["linear"]["slopes_per_seed"].values()] == pytest.approx([1.0] * 3)
    assert s["softmax"]["time_slope_all"] == pytest.approx(2.0)
    crossing = benchmark.summarize(rows)["crossovers"]["linear vs softmax"]
    assert crossing["faster_at"] == [256, 512]  # from the per-N means, not from one seed's row


def test_a_repeated_length_run_writes_one_point_per_length(compose_cfg, tmp_path):
    cfg = compose_cfg(*TINY[:-1], "task.lengths=[16,16,32]", "task.isolate=false", "task.attentions=[linear]",
                      f"+run_dir={tmp_path}")
    benchmark.run(cfg)
    summary = json.loads((tmp_path / "summary.json").read_text())["attentions"]["linear"]
    assert summary["time_slope_top3"] == summary["time_slope_all"]  # two distinct N: one line through both
    assert "(each value: the mean of the point's rows" in (tmp_path / "table.txt").read_text()
