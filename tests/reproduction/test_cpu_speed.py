"""python -m repro.reproduction.cpu_speed end to end on tiny sizes (no timing asserted): every
measure of the CPU-speed targets' table gets a row in the CSV and JSON, the peer's row says why it is
missing when fast-transformers is not importable, and bad input is one line."""
import json
import sys

import pandas as pd
import pytest
import torch

from repro.kernels.causal_product import cpu_native
from repro.reproduction import cpu_speed

TINY = ["--threads", "1", "--rounds", "1", "--kernel-lengths", "40", "--pass-length", "64",
        "--layer-lengths", "16", "--layer-tokens", "32", "--generation-sizes", "mnist", "--generation-rounds", "1",
        "--generation-backend", "eager"]


@pytest.mark.slow  # every row of the benchmark, at small sizes
def test_every_row_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fast_transformers", None)  # not importable, whatever is installed
    monkeypatch.setitem(sys.modules, "fast_transformers.causal_product", None)
    threads = torch.get_num_threads()
    cpu_speed.main([*TINY, "--out-dir", str(tmp_path)])
    assert torch.get_num_threads() == threads  # set for the run only
    (csv,), (js,) = tmp_path.glob("cpu_speed_1t_*.csv"), tmp_path.glob("cpu_speed_1t_*.json")
    rows = pd.read_csv(csv)
    assert set(rows.measure) == {"kernel_vs_peer", "forward", "backward_dense", "backward_sum", "successors", "layer",
                                 "generation"}
    succ = rows[rows.measure == "successors"].set_index("method")
    fused = cpu_native.unavailable() is None  # then the PyTorch pieces are timed beside it, the targets' reference
    assert set(succ.index) == {"causal", "retention", "gla", "delta"} | ({"causal_torch"} if fused else set())
    assert succ.n.eq(64).all() and succ.x_causal["delta"] == pytest.approx(succ.ms["delta"] / succ.ms["causal"])
    if fused:
        assert succ.x_causal_torch["gla"] == pytest.approx(succ.ms["gla"] / succ.ms["causal_torch"])
        assert succ.target["gla"] == "<= 4x causal_torch"
        kernel = rows[rows.measure == "kernel_vs_peer"].set_index("method")
        assert kernel.backend["ours"] == "cpu" and kernel.backend["ours_torch"] == "torch"
        assert kernel.x_fused["ours_torch"] == pytest.approx(kernel.ms["ours_torch"] / kernel.ms["ours"])
    fwd = rows[rows.measure == "forward"].iloc[0]
    assert fwd.needed_gflops == pytest.approx(4 * 8 * fwd.n * 64 * 64 / (fwd.ms / 1e3) / 1e9)
    peer = rows[rows.method == "fast_transformers"].iloc[0]
    assert peer.status.startswith("missing: fast_transformers not importable")
    ok = rows[rows.status == "ok"]
    layers = ok[ok.measure == "layer"].set_index("method")
    assert (ok.ms > 0).all() and set(layers.index) == {"linear", "softmax", "retention", "gla", "delta"}
    assert layers.x_linear["gla"] == pytest.approx(layers.ms["gla"] / layers.ms["linear"])
    gen = ok[ok.measure == "generation"].set_index("method")
    assert set(gen.index) == {"linear-compiled", "matvec-floor"} and (gen.n == 784).all()
    assert gen.x_floor["linear-compiled"] == pytest.approx(gen.ms["linear-compiled"] / gen.ms["matvec-floor"])
    doc = json.loads(js.read_text())
    assert doc["command"].startswith("python -m repro.reproduction.cpu_speed")
    assert all(len(r["load_avg_1_5_15"]) == 3 and r["threads"] == 1 and r["git_sha"] for r in doc["rows"])
    assert "speedup_vs_softmax" in capsys.readouterr().out


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="--rounds=0: must be >= 1"):
        cpu_speed.main(["--rounds", "0", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--generation-backend='nope'; valid: .*inductor"):
        cpu_speed.main(["--generation-backend", "nope", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--peer-sdist .*nope.tar.gz: no such file"):
        cpu_speed.main([*TINY, "--peer-sdist", str(tmp_path / "nope.tar.gz"), "--out-dir", str(tmp_path)])


def test_each_timed_call_follows_its_settle_calls(tmp_path):
    """--settle N runs each method N times, untimed, right before each timed call (at T > 1
    threads the previous method's OpenMP threads would otherwise still be spinning)."""
    from repro.common import timing

    order = []
    timing.interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, rounds=2, warmup=0,
                          settle=1)
    assert "".join(order) == "aabbaabb"
    with pytest.raises(SystemExit, match="--settle=-1: must be >= 0"):
        cpu_speed.main(["--settle", "-1", "--out-dir", str(tmp_path)])


def test_a_run_of_some_rows_is_named_after_them(tmp_path):
    """--rows: the files carry the rows' names, so the report (which shows the newest run of
    every row per thread count, cpu_speed_<T>t_<time>.csv) never takes a partial run for it."""
    from repro.reproduction.report.cpu_speed import CPU_SPEED

    cpu_speed.main([*TINY, "--rows", "successors", "--out-dir", str(tmp_path)])
    (csv,) = tmp_path.glob("*.csv")
    assert csv.name.startswith("cpu_speed_1t_") and csv.name.endswith("_successors.csv")
    assert CPU_SPEED.fullmatch(csv.name) is None
    assert set(pd.read_csv(csv).measure) == {"successors"}
