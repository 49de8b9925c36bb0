"""The report's Figure 1 section sets beside each time the kernel its run ran on, where the run
recorded it (repro.training.backends); runs from before the record show no such column."""
import pandas as pd


def test_the_report_sets_the_kernel_beside_each_figure1_time(tmp_path):
    from types import SimpleNamespace

    from repro.reproduction.report.figure1 import figure1

    cpu = "AMD EPYC (2 cores, 1 threads)"
    fig = pd.DataFrame([{"attention": a, "n": 512, "batch": 8, "repeats": 3, "status": "ok", "time_per_sample_ms": t,
                         "mem_per_sample_mb": 9.0, "causal": True, "device": cpu, "kernel_backend": "torch",
                         "kernel_backend_why": why, "kernel_fallback": fell}
                        for a, t, why, fell in (("linear", 1.0, "the fused CPU kernel is unavailable: no cc", True),
                                                ("softmax", 2.0, "SoftmaxAttention: PyTorch operations", False))])
    old = pd.DataFrame([{"attention": "linear", "n": 512, "status": "ok", "time_per_sample_ms": 3.0,
                         "mem_per_sample_mb": 9.0, "device": cpu}])  # a run from before the record
    csvs = [(tmp_path / "fig" / "benchmark.csv", fig), (tmp_path / "old" / "benchmark.csv", old)]
    md = figure1(SimpleNamespace(root=tmp_path, rel=str, named=lambda section, name, part=None: [
        (path.parent, df) for path, df in csvs if path.name == name]))
    part = md.split("### fig (causal)", 1)[1].split("\n### ", 1)[0]
    lines = [line for line in part.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    linear = dict(zip(header, [c.strip() for c in next(x for x in lines if x.startswith("| linear | linear"))
                                .strip("|").split("|")]))
    assert linear["our ms/sample"] == "1" and linear["our kernel"] == (
        "torch (fell back: the fused CPU kernel is unavailable: no cc)")
    assert "| softmax | softmax | 512 | " in part and "| torch |" in part
    assert "our kernel" not in md.split("### old (causal)", 1)[1]
    same = md.split("### The same point in several runs", 1)[1].split("\n### ", 1)[0]
    assert same.splitlines()[4].rstrip().endswith("| kernel |") and "| not recorded |" in same
