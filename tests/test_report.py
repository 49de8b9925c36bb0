"""python -m repro.report: from a results tree with a few well-formed result files, every paper
table gets its row beside ours (value, hardware, command); tables with no result say so."""
import json
import re

import pandas as pd

from repro import paper
from repro.report import build, main
from repro.results import REPO

CPU, GPU = "AMD EPYC (2 cores, 1 threads)", "NVIDIA H100 80GB HBM3"


def row(md, first, section):
    """The cells of the table row starting with `first` inside `section` of the markdown."""
    part = md.split(section, 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    line = next(l for l in part.splitlines() if l.startswith(f"| {first} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def fake_results(root):
    bench = root / "fig1"
    bench.mkdir(parents=True)
    pd.DataFrame([{"attention": "linear", "n": 4096, "status": "ok", "time_per_sample_ms": 7.25, "mem_per_sample_mb": 91.5,
                   "causal": True, "device": GPU},
                  {"attention": "softmax", "n": 4096, "status": "oom", "time_per_sample_ms": None,
                   "mem_per_sample_mb": None, "causal": True, "device": GPU},
                  {"attention": "softmax-math", "n": 512, "status": "ok", "time_per_sample_ms": 3.5,
                   "mem_per_sample_mb": 20.0, "causal": True, "device": GPU}]).to_csv(bench / "benchmark.csv", index=False)
    (bench / "summary.json").write_text(json.dumps({"attentions": {
        "linear": {"time_slope_all": 1.04, "mem_slope_all": 0.98, "largest_n": 65536},
        "softmax-math": {"time_slope_all": 1.9, "mem_slope_all": 1.8, "largest_n": 4096}}}))
    (bench / "benchmark.png").write_bytes(b"\x89PNG fake")
    (bench / "command.txt").write_text("python run.py experiment=paper_benchmark \\\n  device=cuda\n")
    thr = root / "throughput" / "gpu"
    thr.mkdir(parents=True)
    pd.DataFrame([{"size": "mnist", "method": "linear", "batch": 1, "seconds_per_image": 0.123, "images_per_s": 8.1,
                   "extrapolated": False, "device": GPU},
                  {"size": "mnist", "method": "linear", "batch": 10, "seconds_per_image": 0.0125, "images_per_s": 80.0,
                   "extrapolated": False, "device": GPU},
                  {"size": "cifar", "method": "softmax", "batch": 1, "seconds_per_image": 9000.0, "images_per_s": 1 / 9000,
                   "extrapolated": True, "device": CPU}]).to_csv(thr / "throughput.csv", index=False)
    later = root / "throughput" / "zz_later"  # a later, smaller run: batch 1 only, extrapolated
    later.mkdir(parents=True)
    pd.DataFrame([{"size": "mnist", "method": "linear", "batch": 1, "seconds_per_image": 0.5, "images_per_s": 2.0,
                   "extrapolated": True, "device": CPU}]).to_csv(later / "throughput.csv", index=False)
    (root / "throughput" / "README.md").write_text("# t\n\n- `gpu/`: `python run.py task=throughput device=cuda`\n")
    img = root / "images" / "mnist"
    img.mkdir(parents=True)
    pd.DataFrame([{"dataset": "mnist", "attention": "linear", "bits_per_dim": 0.71, "device": CPU}]).to_csv(
        img / "image_final.csv", index=False)
    (img / "command.txt").write_text("python run.py task=mnist attention=linear\n")
    asr = root / "asr"
    asr.mkdir()
    pd.DataFrame([{"attention": "linear", "per": 0.2345, "seconds_per_epoch": 31.0, "device": CPU}]).to_csv(
        asr / "asr_final.csv", index=False)
    (asr / "README.md").write_text("Made by\n\n    python run.py task=asr attention=linear\n")
    table = root / "asr_table"  # the ASR task's own table: percentages, model names, device in its rows
    table.mkdir()
    pd.DataFrame([{"model": "bilstm", "valid_per_%": 0.8, "s_per_epoch": 12.5}]).to_csv(table / "asr_table.csv", index=False)
    (table / "asr_rows.jsonl").write_text(json.dumps({"task": "asr", "device": CPU}) + "\n")
    (table / "command.txt").write_text("python run.py -m experiment=asr_table_cpu\n")
    (root / "kernels").mkdir()
    (root / "kernels" / "README.md").write_text("    python -m repro.kernels.bench\n")


def test_report_puts_ours_beside_the_paper(tmp_path):
    root = tmp_path / "results"
    fake_results(root)
    main(["--results", str(root), "--out", str(tmp_path / "elsewhere" / "R.md")])
    md = (root / "REPORT.md").read_text()
    assert row(md, "linear | linear | 4096", "### fig1") == ["linear", "linear", "4096", "5", "7.25", "97", "91.5"]
    assert row(md, "softmax | softmax | 4096", "### fig1")[4] == "not measured"  # its point ran out of memory
    # the paper's softmax materialised the (N, N) matrix: our softmax-math is set beside it
    assert row(md, "softmax | softmax-math | 512", "### fig1")[3:5] == ["1.4", "3.5"]
    assert row(md, "linear", "Slopes")[1:4] == ["1", "1.04", "0.98"]
    assert row(md, "softmax-math", "Slopes")[1:3] == ["2", "1.9"]
    assert "Command: `python run.py experiment=paper_benchmark device=cuda`" in md and GPU in md
    assert "![Figure 1, fig1](fig1/benchmark.png)" in md
    t1 = row(md, "linear", "### Table 1: MNIST")
    assert t1[:5] == ["linear", "0.644", "0.71", "142.8", "80"] and CPU in t1[5] and GPU in t1[5]
    assert "task=mnist attention=linear" in t1[6] and "task=throughput device=cuda" in t1[6]
    assert row(md, "softmax", "### Table 1: MNIST")[2] == "not yet run"
    assert row(md, "linear", "### Table 4: MNIST")[3:5] == ["0.123", "GPU"]  # measured beats extrapolated
    assert row(md, "softmax", "### Table 5: CIFAR-10")[1:5] == ["8,651", "300.1", "9,000 (extrapolated)", "CPU"]
    assert row(md, "linear", "### asr\n")[1:5] == ["8.08", "23.45", "824", "31"]
    assert row(md, "softmax", "### asr\n")[2] == "not run here"
    assert row(md, "bilstm", "### asr_table")[1:5] == ["10.94", "0.8", "1047", "12.5"]  # 0.8 %, not 80 %
    assert f"Hardware: {CPU}" in md.split("### asr_table", 1)[1]
    assert "Figure 2: the copy task" in md and "not yet run" in md.split("## Figure 2", 1)[1].split("##", 1)[0]
    assert re.search(r"\[kernels\]\(kernels/README.md\): `python -m repro.kernels.bench`", md)
    others = md.split("## Other results", 1)[1]
    assert "[asr]" not in others and "[asr_table]" not in others  # tabled in Table 3, so not "other"
    other = (tmp_path / "elsewhere" / "R.md").read_text()
    assert "](../results/fig1/benchmark.png)" in other  # links relative to where the copy lies
    for ds, methods in paper.IMAGES.items():  # every method of the paper has its row
        for m in methods:
            row(md, m, "### Table 1" if ds == "mnist" else "### Table 2")


def test_the_committed_results_build(tmp_path):
    md = build(REPO / "results", tmp_path / "REPORT.md")
    for heading in ("## Figure 1", "## Figure 2", "## Tables 1 and 2", "## Tables 4 and 5", "## Table 3"):
        assert heading in md
    assert "figure1-family-cpu" in md and "copy/figure2_cpu" in md
