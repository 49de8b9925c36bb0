"""python -m repro.report: from a results tree with a few well-formed result files and the manifest
naming them (claims.yaml, written by report_manifest.write_manifest), every paper table gets its
row beside ours (value, hardware, command); tables with no result say so."""
import json
import re
import shutil

import pandas as pd
import pytest
from report_manifest import write_manifest

from repro.common import paper
from repro.common.results import REPO, run_load
from repro.reproduction.report import build, main

CPU, GPU = "AMD EPYC (2 cores, 1 threads)", "NVIDIA H100 80GB HBM3"


def row(md, first, section):
    """The cells of the table row starting with `first` inside `section` of the markdown."""
    part = md.split(section, 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    line = next(ln for ln in part.splitlines() if ln.startswith(f"| {first} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def cells(md, first, section) -> dict:
    """{column header: cell} of the table row starting with `first` inside `section`."""
    part = md.split(section, 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    lines = [ln for ln in part.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return dict(zip(header, row(md, first, section)))


def fake_results(root):
    bench = root / "fig1"
    bench.mkdir(parents=True)
    pd.DataFrame([{"attention": "linear", "n": 4096, "status": "ok", "time_per_sample_ms": 7.25,
                   "mem_per_sample_mb": 91.5, "causal": True, "device": GPU},
                  {"attention": "softmax", "n": 4096, "status": "oom", "time_per_sample_ms": None,
                   "mem_per_sample_mb": None, "causal": True, "device": GPU},
                  {"attention": "softmax-math", "n": 512, "status": "ok", "time_per_sample_ms": 3.5,
                   "mem_per_sample_mb": 20.0, "causal": True, "device": GPU}]).to_csv(
        bench / "benchmark.csv", index=False)
    (bench / "summary.json").write_text(json.dumps({"attentions": {
        "linear": {"time_slope_all": 1.04, "mem_slope_all": 0.98, "largest_n": 65536},
        "softmax-math": {"time_slope_all": 1.9, "mem_slope_all": 1.8, "largest_n": 4096}}}))
    (bench / "benchmark.png").write_bytes(b"\x89PNG fake")
    (bench / "command.txt").write_text("python run.py experiment=paper_benchmark \\\n  device=cuda\n")
    thr = root / "throughput" / "gpu"
    thr.mkdir(parents=True)
    pd.DataFrame([{"size": "mnist", "method": "linear", "batch": 1, "seconds_per_image": 0.123, "images_per_s": 8.1,
                   "extrapolated": False, "device": GPU, "status": "ok"},
                  {"size": "mnist", "method": "linear", "batch": 10, "seconds_per_image": 0.0125, "images_per_s": 80.0,
                   "extrapolated": False, "device": GPU, "status": "ok"}]).to_csv(thr / "throughput.csv", index=False)
    measured = root / "throughput" / "cpu_measured"  # a measured CPU run at batch 1
    measured.mkdir(parents=True)
    pd.DataFrame([{"size": "mnist", "method": "linear", "batch": 1, "seconds_per_image": 0.4, "images_per_s": 2.5,
                   "extrapolated": False, "device": CPU, "status": "ok"}]).to_csv(measured / "throughput.csv",
                                                                                  index=False)
    later = root / "throughput" / "zz_later"  # a later run the manifest does not name: never shown
    later.mkdir(parents=True)
    pd.DataFrame([{"size": "mnist", "method": "linear", "batch": 1, "seconds_per_image": 0.5, "images_per_s": 2.0,
                   "extrapolated": True, "device": CPU, "status": "ok"}]).to_csv(later / "throughput.csv", index=False)
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
    pd.DataFrame([{"model": "bilstm", "valid_per_%": 0.8, "s_per_epoch": 12.5, "steps": 40, "status": "ok"}]).to_csv(
        table / "asr_table.csv", index=False)
    (table / "asr_rows.jsonl").write_text(json.dumps({"task": "asr", "device": CPU}) + "\n")
    (table / "command.txt").write_text("python run.py -m experiment=asr_table_cpu\n")
    timing = root / "asr_timing"  # a timing run: 20 updates of an untrained model, its label says so
    timing.mkdir()
    pd.DataFrame([{"model": "linear", "valid_per_%": 98.5, "s_per_epoch": 44.5, "steps": 20, "status": "ok"}]).to_csv(
        timing / "asr_table.csv", index=False)
    (timing / "asr_rows.jsonl").write_text(json.dumps({"task": "asr", "device": CPU, "label": "CPU timing run"}) + "\n")
    (root / "kernels").mkdir()
    (root / "kernels" / "README.md").write_text("    python -m repro.reproduction.bench\n")
    fake_manifest(root)


def fake_manifest(root, **more):
    """The manifest of fake_results's tree (and of `more` sections): each table's folders, one run
    at one batch a column of Tables 1, 2, 4 and 5."""
    images_per_s = [{"folder": "throughput/cpu_measured", "batch": 1}, {"folder": "throughput/gpu", "batch": 10}]
    write_manifest(root, **{"figure1": ["fig1"], "table_3": ["asr", "asr_table", "asr_timing"], "others": ["kernels"],
                            "tables_1_2": {"bits_per_dim": ["images/mnist"], "images_per_s": images_per_s},
                            "table_4": images_per_s,
                            "table_5": [{"folder": "throughput/cpu_measured", "batch": 1},
                                        {"folder": "throughput/gpu", "batch": 1}], **more})


def test_report_puts_ours_beside_the_paper(tmp_path):
    root = tmp_path / "results"
    fake_results(root)
    main(["--results", str(root), "--out", str(tmp_path / "elsewhere" / "R.md")])
    md = (root / "REPORT.md").read_text()
    assert row(md, "linear | linear | 4096", "### fig1") == ["linear", "linear", "4096", "5", "7.25", "97", "91.5"]
    assert row(md, "softmax | softmax | 4096", "### fig1")[4] == "oom"  # its point ran out of memory: says so
    assert "| linear | linear | 512 |" not in md  # a length the run never tried has no row
    # the paper's softmax materialised the (N, N) matrix: our softmax-math is set beside it
    assert row(md, "softmax | softmax-math | 512", "### fig1")[3:5] == ["1.4", "3.5"]
    assert row(md, "linear", "Slopes")[1:4] == ["1", "1.04", "0.98"]
    assert row(md, "softmax-math", "Slopes")[1:3] == ["2", "1.9"]
    assert "Command: `python run.py experiment=paper_benchmark device=cuda`" in md and GPU in md
    assert "![Figure 1, fig1](fig1/benchmark.png)" in md
    # CPU and GPU values each in their own column: CPU bits/dim beside CPU images/s, the GPU's apart
    t1 = cells(md, "linear", "### Table 1: MNIST")
    assert (t1["paper bits/dim"], t1["our bits/dim, CPU"], t1[f"our bits/dim, {GPU}"]) == (
        "0.644", "0.71", "not yet run")
    # one run at one batch per column, the batch in its header: the one the manifest names (zz_later: none)
    assert (t1["paper images/s"], t1["our images/s, CPU, batch 1"], t1[f"our images/s, {GPU}, batch 10"]) == (
        "142.8", "2.5", "80")
    t1_notes = md.split("### Table 1: MNIST", 1)[1].split("\n### ", 1)[0]
    assert "Our bits/dim, CPU: one run, `images/mnist`" in t1_notes and "task=mnist attention=linear" in t1_notes
    assert "Our images/s, CPU, batch 1: one run, `throughput/cpu_measured`" in t1_notes
    assert "zz_later" not in md and "left out" not in md
    assert f"Our images/s, {GPU}, batch 10: one run, `throughput/gpu`" in t1_notes
    assert "task=throughput device=cuda" in t1_notes
    assert cells(md, "softmax", "### Table 1: MNIST")["our bits/dim, CPU"] == "not yet run"
    # a value from another run on the same hardware is not mixed into the column
    assert cells(md, "softmax", "### Table 2: CIFAR-10")["our images/s, CPU, batch 1"] == "not in this run"
    t4 = cells(md, "softmax", "### Table 4, CIFAR-10")
    assert (t4["paper images/s"], t4["our images/s, CPU, batch 1"], t4[f"our images/s, {GPU}, batch 10"]) == (
        "0.004", "not in this run", "not in this run")
    t4 = cells(md, "linear", "### Table 4, MNIST")
    assert (t4["paper images/s"], t4["our images/s, CPU, batch 1"], t4[f"our images/s, {GPU}, batch 10"]) == (
        "142.8", "2.5", "80")
    assert row(md, "stateful-softmax", "### Table 4, MNIST")[1:3] == ["7.56", "not in this run"]
    assert "stateful-softmax" not in md.split("### Table 1: MNIST", 1)[1].split("\n## ", 1)[0]  # not in Tables 1/2
    t5 = cells(md, "linear", "### Table 5, MNIST")
    assert (t5["paper CPU s"], t5["paper GPU s"], t5["our s/image, CPU, batch 1"],
            t5[f"our s/image, {GPU}, batch 1"]) == ("5.5", "7.3", "0.4", "0.123")
    t5 = cells(md, "softmax", "### Table 5, CIFAR-10")
    assert (t5["paper CPU s"], t5["paper GPU s"], t5["our s/image, CPU, batch 1"],
            t5[f"our s/image, {GPU}, batch 1"]) == ("8,651", "300.1", "not in this run", "not in this run")
    # a timing run's PER (an untrained model's) is no result: left out, its seconds per epoch kept
    assert row(md, "linear", "### asr_timing (timing run)")[2:6] == ["8.08", "timing run", "824",
                                                                      "44.5 (from 20 updates)"]
    assert row(md, "linear", "### asr\n")[2:6] == ["8.08", "23.45", "824", "31"]
    assert row(md, "softmax", "### asr\n")[3] == "not run here"
    assert row(md, "bilstm", "### asr_table")[2:6] == ["10.94", "0.8", "1047",  # 0.8 %, not 80 %
                                                       "12.5 (from 40 updates)"]
    assert f"Hardware: {CPU}" in md.split("### asr_table", 1)[1]
    assert "Figure 2: the copy task" in md and "not yet run" in md.split("## Figure 2", 1)[1].split("##", 1)[0]
    assert re.search(r"\[kernels\]\(kernels/README.md\): `python -m repro.reproduction.bench`", md)
    others = md.split("## Other results", 1)[1]
    assert "[asr]" not in others and "[asr_table]" not in others  # tabled in Table 3, so not "other"
    other = (tmp_path / "elsewhere" / "R.md").read_text()
    assert "](../results/fig1/benchmark.png)" in other  # links relative to where the copy lies
    for ds, name in (("mnist", "MNIST"), ("cifar10", "CIFAR-10")):  # every method of the paper has its row
        for m in paper.BITS_PER_DIM[ds]:
            row(md, m, f"### {paper.TABLES_1_2[ds]}: {name}")
        for m in paper.IMAGES_PER_S[ds]:
            row(md, m, f"### Table 4, {name}")
        for m in paper.SECONDS_PER_IMAGE[ds]:
            row(md, m, f"### Table 5, {name}")


def test_the_committed_results_build(tmp_path):
    md = build(REPO / "results", tmp_path / "REPORT.md")
    for heading in ("## Figure 1", "## Figure 2", "## Tables 1 and 2", "## Table 4", "## Table 5", "## Table 3",
                    "## Kernel benchmark", "## GPU runs"):
        assert heading in md
    assert "figure1-family-cpu" in md and "copy/figure2_cpu" in md


# Values printed in only one table of the paper (arXiv 2006.16236 v3), written out by hand here
# (not taken from repro.common.paper): a report section showing one of them must name that table.
ONLY_IN = {"Table 1": {"0.621", "0.745", "0.676", "0.644"},          # MNIST bits/dim
           "Table 2": {"3.47", "3.39", "3.51", "3.4"},               # CIFAR-10 bits/dim
           "Table 4": {"7.56", "0.32"},                              # stateful softmax images/s
           "Table 5": {"72.6", "10.2", "46", "112", "8,651", "300.1", "2,319", "5,264"},  # seconds per image
           "Table 3": {"10.94", "5.12", "9.33", "8.08"}}                # WSJ PER %


def sections(md):
    """(the '## ' title, the '### ' title or '', the cells of its tables' paper columns) of every
    innermost section."""
    out, top = [], ""
    for part in re.split(r"\n(?=##+ )", md):
        title, _, body = part.partition("\n")
        if title.startswith("## "):
            top, sub = title, ""
        elif title.startswith("### "):
            sub = title
        else:
            continue
        cells, columns = set(), []
        for line in body.splitlines():
            if not line.startswith("|"):
                columns = []  # a table ends
                continue
            row = [c.strip() for c in line.strip("|").split("|")]
            if not columns:
                columns = [i for i, h in enumerate(row) if h.startswith("paper")]
            else:
                cells |= {row[i] for i in columns}
        out.append((top, sub, cells))
    return out


def test_every_section_names_the_paper_table_that_holds_its_numbers(tmp_path):
    for md in (build(REPO / "results", tmp_path / "REPORT.md"), build(fake(tmp_path), tmp_path / "R.md")):
        checked = set()
        for top, sub, cells in sections(md):
            for table, values in ONLY_IN.items():
                if cells & values:
                    assert re.search(rf"\b{table}\b", f"{top} {sub}"), f"{top} / {sub} shows {table}'s numbers"
                    for other in set(ONLY_IN) - {table}:  # and no other table's name
                        assert not re.search(rf"\b{other}\b", f"{sub or top}"), f"{top} / {sub} names {other}"
                    checked.add(table)
        assert checked == set(ONLY_IN)


def fake(tmp_path):
    root = tmp_path / "fake"
    fake_results(root)
    return root


# ---------------------------------------------------------------------- GPU results (repro.reproduction.reproduce_gpu)

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def gpu_results(root):
    """A results tree laid out as `python -m repro.reproduce_gpu` writes it (formats as its --smoke
    run writes them), beside a CPU run of the same attentions that sorts after results/gpu/."""
    cpu_img = root / "images" / "mnist_cpu"  # "images" sorts after "gpu": it used to overwrite the GPU value
    cpu_img.mkdir(parents=True)
    pd.DataFrame([{"dataset": "mnist", "attention": "linear", "eval_bits_per_dim": 1.69, "status": "ok"}]).to_csv(
        cpu_img / "bpd_final.csv", index=False)
    (cpu_img / "image_rows.jsonl").write_text(json.dumps({"attention": "linear", "device": CPU, "kind": "final"})
                                              + "\n")
    pd.DataFrame([{"size": "mnist", "method": "linear", "batch": 1, "seconds_per_image": 5.0, "images_per_s": 0.2,
                   "extrapolated": False, "device": CPU, "status": "ok"}]).to_csv(cpu_img / "throughput.csv",
                                                                                  index=False)
    for gpu, folder, bpd, ips, spi in ((H100, "NVIDIA_H100_80GB_HBM3", 0.91, 300.0, 0.7),
                                       (H200, "NVIDIA_H200", 0.93, 350.0, 0.6)):
        step = root / "gpu" / folder
        mnist = step / "mnist"
        mnist.mkdir(parents=True)
        pd.DataFrame([{"dataset": "mnist", "attention": "linear", "eval_bits_per_dim": bpd, "status": "ok"}]).to_csv(
            mnist / "bpd_final.csv", index=False)
        (mnist / "image_rows.jsonl").write_text(json.dumps({"attention": "linear", "device": gpu, "kind": "final"})
                                                + "\n")
        pd.DataFrame([{"attention": a, "step": s, "elapsed_s": s * 0.01, "eval_bpd": b, "device": gpu}
                      for a, s, b in (("linear", 250, 1.4), ("linear", 500, 1.1), ("softmax", 250, 1.6))]).to_csv(
            mnist / "bpd_vs_time.csv", index=False)
        (mnist / "bpd_vs_time.png").write_bytes(b"\x89PNG fake")
        gen = step / "generation"
        gen.mkdir()
        pd.DataFrame([{"size": "mnist", "method": "linear", "batch": b, "seconds_per_image": s, "images_per_s": i,
                       "extrapolated": False, "device": gpu, "status": "ok"}
                      for b, s, i in ((1, spi, 1 / spi), (256, 1 / ips, ips))]
                     ).to_csv(gen / "throughput.csv", index=False)
        (gen / "command.txt").write_text("python run.py task=throughput device=cuda\n")
        for name, status in (("env", "done"), ("mnist", "done"), ("generation", "done"), ("kernels", "incomplete")):
            (step / name).mkdir(exist_ok=True)
            (step / name / "status.json").write_text(json.dumps({"status": status, "jobs": {
                "job": {"status": "ok" if status == "done" else "failed (exit 1)", "seconds": 12.0}}}))
        (step / "env" / "env.json").write_text(json.dumps({"device": gpu, "cuda_available": True, "cupy": "14.2.0",
                                                           "nvcc": ["release 13.0", "V13.0.88"]}))
    gpus = ("NVIDIA_H100_80GB_HBM3", "NVIDIA_H200")
    mnist = [f"gpu/{g}/mnist" for g in gpus]
    write_manifest(root, tables_1_2={"bits_per_dim": ["images/mnist_cpu", *mnist], "images_per_s": image_columns(256),
                                     "bpd_vs_time": mnist},
                   table_4=image_columns(256), table_5=image_columns(1), gpu_runs=[f"gpu/{g}" for g in gpus])
    # a JUnit XML as pytest writes it: 5 tests, 1 failed, 2 skipped
    (root / "gpu" / "NVIDIA_H100_80GB_HBM3" / "env" / "kernel_tests.xml").write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1" '
        'skipped="2" tests="5"><testcase classname="tests.test_cupy_kernels" name="test_a"/>'
        '<testcase classname="tests.test_cupy_kernels" name="test_b"><failure message="x"/></testcase>'
        '</testsuite></testsuites>')


def image_columns(batch, gpus=("NVIDIA_H100_80GB_HBM3", "NVIDIA_H200")):
    """The CPU run at batch 1 and each GPU's generation step at `batch`: one column each."""
    return [{"folder": "images/mnist_cpu", "batch": 1}, *({"folder": f"gpu/{g}/generation", "batch": batch}
                                                         for g in gpus)]


def test_cpu_and_gpu_values_land_in_their_own_columns(tmp_path):
    root = tmp_path / "results"
    gpu_results(root)
    md = build(root, root / "REPORT.md")
    t1 = cells(md, "linear", "### Table 1: MNIST")
    assert (t1["our bits/dim, CPU"], t1[f"our bits/dim, {H100}"], t1[f"our bits/dim, {H200}"]) == (
        "1.69", "0.91", "0.93")
    assert (t1["our images/s, CPU, batch 1"], t1[f"our images/s, {H100}, batch 256"],
            t1[f"our images/s, {H200}, batch 256"]) == ("0.2", "300", "350")
    assert "Our bits/dim, CPU: one run, `images/mnist_cpu`" in md  # the GPUs are named by their columns
    t4 = cells(md, "linear", "### Table 4, MNIST")
    assert (t4["our images/s, CPU, batch 1"], t4[f"our images/s, {H100}, batch 256"]) == ("0.2", "300")
    t5 = cells(md, "linear", "### Table 5, MNIST")
    assert (t5["paper CPU s"], t5["paper GPU s"], t5["our s/image, CPU, batch 1"], t5[f"our s/image, {H100}, batch 1"],
            t5[f"our s/image, {H200}, batch 1"]) == ("5.5", "7.3", "5", "0.7", "0.6")
    assert "not measured yet" not in md.split("## Tables 1 and 2", 1)[1].split("## Table 3", 1)[0]
    # bits/dim against training time, per GPU run: the last and best evaluation of each attention
    t = cells(md, "linear",
              "### Table 1, MNIST: held-out bits/dim against training time (gpu/NVIDIA_H100_80GB_HBM3/mnist)")
    assert (t["paper bits/dim (converged)"], t["our last step"], t["our training s"], t["our last bits/dim"]) == (
        "0.644", "500", "5", "1.1")
    assert "](gpu/NVIDIA_H100_80GB_HBM3/mnist/bpd_vs_time.png)" in md
    # the GPU runs: each step's status, the environment, the kernel tests' counts
    runs = md.split("### gpu/NVIDIA_H100_80GB_HBM3\n", 1)[1].split("\n### ", 1)[0]
    assert row(runs, "2 kernels", "| step |")[1] == "incomplete" and row(runs, "1 env", "| step |")[1] == "done"
    assert row(runs, "nvcc", "Environment") == ["nvcc", "release 13.0 / V13.0.88"]
    assert "GPU kernel tests (env/kernel_tests.xml): 2 passed, 1 failed, 2 skipped " \
           "(failed: tests.test_cupy_kernels.test_b)" in runs
    assert "## Other results" not in md  # every GPU step's folder is shown in a section
    write_manifest(root / "gpu" / "NVIDIA_H100_80GB_HBM3", gpu_runs=["."])  # --results at one device's folder
    alone = build(root / "gpu" / "NVIDIA_H100_80GB_HBM3", tmp_path / "R.md")
    assert "\n### NVIDIA_H100_80GB_HBM3\n" in alone and "| 6 mnist | done |" in alone


def bench_row(device, method, dtype, pass_, ms, n=16384, status="ok", time="2026-11-23T12:00:00+00:00"):
    return {"device": device, "time": time, "task": "kernels.bench", "method": method, "pass": pass_, "dtype": dtype,
            "batch": 8, "heads": 8, "n": n, "d": 64, "m": 64, "status": status, "ms": ms if status == "ok" else None,
            "pct_of_floor": 100 * 0.2 / ms if status == "ok" else None}


def test_kernel_targets_stand_met_or_not_met_on_either_side(tmp_path):
    root = tmp_path / "results"
    # H100: each target just met (the time bounds are inclusive); H200: each just missed
    for dev, folder, (fwd, fwd_bwd, ft_fwd, ft_bwd, fla_fwd, fla_bwd) in (
            (H100, "NVIDIA_H100_80GB_HBM3", (0.32, 1.25, 3.3, 12.6, 0.33, 1.26)),
            (H200, "NVIDIA_H200", (0.33, 1.26, 3.19, 12.49, 0.33, 1.26))):
        d = root / "gpu" / folder / "kernels"
        d.mkdir(parents=True)
        rows = [bench_row(dev, "cupy", "bf16", "fwd", fwd), bench_row(dev, "cupy", "bf16", "fwd_bwd", fwd_bwd),
                bench_row(dev, "cupy", "fp32", "fwd", 0.32), bench_row(dev, "cupy", "fp32", "fwd_bwd", 1.25),
                bench_row(dev, "fast_transformers", "fp32", "fwd", ft_fwd),
                bench_row(dev, "fast_transformers", "fp32", "fwd_bwd", ft_bwd),
                bench_row(dev, "fla_chunk", "bf16", "fwd", fla_fwd),
                bench_row(dev, "fla_chunk", "bf16", "fwd_bwd", fla_bwd),
                # another N, and an earlier row of the target point: neither counts
                bench_row(dev, "cupy", "bf16", "fwd", 0.01, n=8192),
                bench_row(dev, "cupy", "bf16", "fwd", 0.01, time="2026-11-22T12:00:00+00:00"),
                bench_row(dev, "sdpa", "bf16", "fwd", 0.5, status="missing: no reason")]
        pd.DataFrame(rows).to_csv(d / "bench.csv", index=False)
        (d / "command.txt").write_text("python -m repro.reproduction.bench --out-dir x\n")
    write_manifest(root, kernels=["gpu/NVIDIA_H100_80GB_HBM3/kernels", "gpu/NVIDIA_H200/kernels"])
    md = build(root, root / "REPORT.md")
    h100 = f"### Kernel targets on {H100}\n"
    assert row(md, "forward <= 0.32 ms, bf16", h100) == ["forward <= 0.32 ms, bf16", "0.32 ms (62% of floor)", "met"]
    assert row(md, "forward + backward <= 1.25 ms, bf16", h100)[2] == "met"
    assert row(md, ">= 10x the authors' kernel, fp32, forward", h100)[1:] == [
        "10.3x (cupy 0.32 ms, fast_transformers 3.3 ms)", "met"]
    assert row(md, ">= 10x the authors' kernel, fp32, forward + backward", h100)[2] == "met"
    assert row(md, "faster than fla's chunk kernel, bf16, forward", h100)[2] == "met"
    assert row(md, "faster than fla's chunk kernel, bf16, forward + backward", h100)[2] == "met"
    h200 = f"### Kernel targets on {H200} (the targets were set for an H100)"
    for target in ("forward <= 0.32 ms, bf16", "forward + backward <= 1.25 ms, bf16",
                   ">= 10x the authors' kernel, fp32, forward", ">= 10x the authors' kernel, fp32, forward + backward",
                   "faster than fla's chunk kernel, bf16, forward",
                   "faster than fla's chunk kernel, bf16, forward + backward"):
        assert row(md, target, h200)[2] == "not met", target
    # each run's own table: ms and % of the floor per method, why a method has no number
    t = cells(md, "bf16 | fwd | 8 x 8 x 64 | 16384", "### gpu/NVIDIA_H100_80GB_HBM3/kernels")
    assert (t["cupy"], t["fla_chunk"], t["sdpa"]) == ("0.32 ms (62% of floor)", "0.33 ms (61% of floor)", "missing")
    assert "No number: sdpa: missing: no reason" in md
    assert "GPU: not measured yet" not in md.split("## Kernel benchmark", 1)[1]


def test_without_gpu_results_the_report_says_not_measured_yet(tmp_path):
    root = tmp_path / "results"
    gpu_results(root)
    shutil.rmtree(root / "gpu")  # the CPU runs only, as results/ is before any GPU run
    bench = root / "kernels" / "cpu"  # a CPU benchmark at the target shape: no GPU target stands on it
    bench.mkdir(parents=True)
    pd.DataFrame([bench_row(CPU, "cupy", "bf16", "fwd", 0.1)]).to_csv(bench / "bench.csv", index=False)
    write_manifest(root, tables_1_2={"bits_per_dim": ["images/mnist_cpu"], "images_per_s": image_columns(1, ())},
                   table_4=image_columns(1, ()), table_5=image_columns(1, ()), kernels=["kernels/cpu"])
    md = build(root, root / "REPORT.md")
    assert "GPU: not measured yet" in md.split("\n## ", 1)[0]
    for section in ("### Table 1: MNIST", "### Table 4, MNIST", "### Table 5, CIFAR-10"):
        header = md.split(section, 1)[1].split("\n|", 1)[1].split("\n", 1)[0]
        gpu_columns = [h for h in header.split("|") if "GPU" in h and "paper" not in h]
        assert [h.strip() for h in gpu_columns] == ["our GPU: not measured yet"] * (2 if "Table 1" in section else 1)
    targets = md.split("### Kernel targets (GPU: not measured yet)", 1)[1].split("\n### ", 1)[0]
    assert targets.count("| not measured yet | not measured yet |") == 6
    assert "Not run yet (no GPU run in results/claims.yaml)" in md


def test_a_kernel_target_without_its_peer_is_not_measured(tmp_path):
    d = tmp_path / "results" / "kernels" / "h100"
    d.mkdir(parents=True)
    pd.DataFrame([bench_row(H100, "cupy", "bf16", "fwd", 0.3), bench_row(H100, "cupy", "fp32", "fwd", 0.3),
                  bench_row(H100, "fast_transformers", "fp32", "fwd", None, status="missing: not built")]).to_csv(
        d / "bench.csv", index=False)
    write_manifest(tmp_path / "results", kernels=["kernels/h100"])
    md = build(tmp_path / "results", tmp_path / "R.md")
    section = f"### Kernel targets on {H100}\n"
    assert row(md, "faster than fla's chunk kernel, bf16, forward", section)[1:] == [
        "fla_chunk: not measured yet", "not measured yet"]
    assert row(md, ">= 10x the authors' kernel, fp32, forward", section)[1:] == [
        "fast_transformers: missing: not built", "not measured"]
    assert row(md, "forward + backward <= 1.25 ms, bf16", section)[1:] == ["not measured yet", "not measured yet"]
    assert cells(md, "bf16 | fwd | 8 x 8 x 64 | 16384", "### kernels/h100")["fast_transformers"] == "—"  # no row


def _cpu_speed_csv(path, threads, layer_256, peer=True, sha="abc123", device="Intel Xeon (2 cores)", fused=False):
    """fused: a run since the fused CPU kernel (its backend named, the PyTorch pieces beside it, the
    forward's rate on the needed work)."""
    base = {"device": device, "dtype": "float32", "threads": threads, "git_sha": sha,
            "load_avg_1_5_15": "[0.5, 0.7, 0.9]", "status": "ok"}
    rows = [{**base, "measure": "kernel_vs_peer", "method": "ours", "n": 1024, "ms": 12.0, "speedup_vs_peer": 3.5,
             "met": True, **({"backend": "cpu"} if fused else {})}]
    rows.append({**base, "measure": "kernel_vs_peer", "method": "fast_transformers", "n": 1024, "ms": 42.0} if peer else
                {**base, "measure": "kernel_vs_peer", "method": "fast_transformers", "n": 1024,
                 "status": "missing: fast_transformers not importable"})
    if fused:
        rows += [{**base, "measure": "kernel_vs_peer", "method": "ours_torch", "n": 1024, "ms": 30.0,
                  "speedup_vs_peer": 1.4, "backend": "torch"},
                 {**base, "measure": "forward", "method": "ours", "n": 4096, "ms": 12.0, "needed_gflops": 45.0,
                  "pct_of_gemm_needed": 55.6, "gemm_gflops": 81.0, "met": True}]
    else:
        rows.append({**base, "measure": "forward", "method": "ours", "n": 4096, "ms": 15.0, "matmul_gflops": 70.0,
                     "gemm_gflops": 150.0})
    rows += [
             {**base, "measure": "backward_dense", "method": "ours", "n": 4096, "ms": 33.0, "x_forward": 2.2,
              "met": True},
             {**base, "measure": "backward_sum", "method": "ours", "n": 4096, "ms": 34.0, "x_dense": 1.03, "met": True},
             {**base, "measure": "layer", "method": "linear", "n": 256, "ms": 400.0, "speedup_vs_softmax": layer_256,
              "met": layer_256 > 1},
             {**base, "measure": "layer", "method": "softmax", "n": 256, "ms": 400.0 * layer_256},
             {**base, "measure": "generation", "method": "linear-compiled", "n": 784, "ms": 1040.0, "x_floor": 1.31,
              "met": True},
             {**base, "measure": "generation", "method": "matvec-floor", "n": 784, "ms": 794.0}]
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(path, index=False)
    path.with_suffix(".json").write_text(
        json.dumps({"command": f"python -m repro.reproduction.cpu_speed --threads {threads}"}))


def test_the_cpu_speed_section_shows_the_runs_the_manifest_names(tmp_path):
    """The CPU speed's tables in the report: one per run the manifest names, in its order (a newer
    run it does not name is left out: the report used to take the newest per thread count), each
    measure against what it is set against, its target, and met or not; a missing peer says why. A
    run of some rows only (named after them) named there is one line: its table lacks the rest."""
    speed = tmp_path / "cpu_speed"
    _cpu_speed_csv(speed / "cpu_speed_1t_20261123T100000.csv", 1, 0.9, sha="old1")
    _cpu_speed_csv(speed / "cpu_speed_1t_20261123T120000.csv", 1, 1.05, sha="new1")
    _cpu_speed_csv(speed / "cpu_speed_2t_20261123T110000.csv", 2, 0.95, peer=False, sha="two2")
    _cpu_speed_csv(speed / "cpu_speed_2t_20261124T110000.csv", 2, 1.5, sha="newer2")  # not named
    _cpu_speed_csv(speed / "cpu_speed_1t_20261127T090000.csv", 1, 1.2, sha="amd1", device="AMD EPYC (2 cores)",
                   fused=True)
    named = [f"cpu_speed/cpu_speed_{run}.csv" for run in ("1t_20261127T090000", "1t_20261123T120000",
                                                          "2t_20261123T110000")]
    write_manifest(tmp_path, cpu_speed=named)
    md = build(tmp_path, tmp_path / "REPORT.md")
    section = md.split("## CPU speed of the core", 1)[1].split("\n## ", 1)[0]
    amd, intel = section.split("**1 thread**")[1:]  # one table per CPU and thread count, the CPUs by name
    assert "AMD EPYC" in amd and "amd1" in amd and "new1" in intel  # the newer AMD run replaces no Intel run
    assert "| 12.0 ms | fast-transformers 42.0 ms | 3.50× faster | ≥ 2× | yes |" in amd
    assert "(cpu backend)" in amd and "chunked PyTorch pieces (`REPRO_KERNEL=torch`), N = 1,024 | 30.0 ms" in amd
    assert "| 45 GFLOP/s of needed work (56 % of GEMM) | ≥ 50 % of GEMM | yes |" in amd
    one, two = intel.split("**2 threads**")
    assert "new1" in one and "old1" not in section and "two2" in two
    assert "cpu_speed_1t_20261123T120000.csv" in one and "--threads 1" in one and "load 0.5–0.5" in one
    row_of = lambda part, first: next(ln for ln in part.splitlines() if ln.startswith(f"| {first}"))
    assert row_of(one, "`causal_dot_product` fwd + bwd, N = 1,024").endswith(
        "| 12.0 ms | fast-transformers 42.0 ms | 3.50× faster | ≥ 2× | yes |")
    assert "1.05× faster | > 1× | yes" in row_of(one, "layer fwd + bwd, 16,384 tokens, N = 256")
    assert "1.05× slower | > 1× | no" in row_of(two, "layer fwd + bwd, 16,384 tokens, N = 256")
    assert "missing: fast_transformers not importable" in row_of(two, "`causal_dot_product`")
    assert "| 1.04 s per image | matvec floor 0.794 s | 1.31× the floor | ≤ 1.4× | yes |" in row_of(
        one, "batch-1 generation, MNIST")
    assert "2.20× | ≤ 2.5× | yes" in row_of(one, "backward, dense gradient")
    assert "newer2" not in md and "## Other results" not in md
    _cpu_speed_csv(speed / "cpu_speed_1t_20261128T090000_layer.csv", 1, 1.2)
    write_manifest(tmp_path, cpu_speed=[*named, "cpu_speed/cpu_speed_1t_20261128T090000_layer.csv"])
    with pytest.raises(SystemExit, match=r"^error: report.cpu_speed\[3\]: cpu_speed/cpu_speed_1t_20261128T090000_layer"
                                         r".csv is not a run of every row"):
        main(["--results", str(tmp_path)])


# ----------------------------------------------------------------------------- the declared tables (schema)

def test_a_renamed_column_fails_naming_the_file_and_the_column(tmp_path):
    """A section declares the tables it reads: a benchmark.csv whose time column was renamed is
    one error naming the file and the missing column, not a section that skips the folder."""
    import pytest

    from repro.reproduction.report import SchemaError

    fake_results(tmp_path)
    path = tmp_path / "fig1" / "benchmark.csv"
    pd.read_csv(path).rename(columns={"time_per_sample_ms": "ms_per_sample"}).to_csv(path, index=False)
    with pytest.raises(SchemaError, match=r"fig1/benchmark\.csv: no column 'time_per_sample_ms'"):
        build(tmp_path, tmp_path / "REPORT.md")


def test_text_in_a_number_column_and_a_torn_csv_fail_naming_the_file(tmp_path):
    import pytest

    from repro.reproduction.report import SchemaError

    fake_results(tmp_path)
    path = tmp_path / "fig1" / "benchmark.csv"
    df = pd.read_csv(path).astype({"mem_per_sample_mb": object})
    df.loc[2, "mem_per_sample_mb"] = "twenty"
    df.to_csv(path, index=False)
    with pytest.raises(SchemaError, match=r"fig1/benchmark\.csv, line 4: column 'mem_per_sample_mb' holds 'twenty'"):
        build(tmp_path, tmp_path / "REPORT.md")
    path.write_text('attention,n\n"linear,4096\n')  # a quote never closed
    with pytest.raises(SchemaError, match=r"fig1/benchmark\.csv(: not a readable CSV|, line 2: 1 fields where)"):
        build(tmp_path, tmp_path / "REPORT.md")


def test_every_section_module_declares_what_it_reads():
    """Each module of the report package that renders a section declares its tables (TABLES,
    possibly empty for one that reads no CSV) and (order, name, render) entries."""
    from repro.reproduction.report import Table
    from repro.reproduction.report.sections import section_modules

    modules = section_modules()
    names = [name for m in modules for _, name, _ in m.SECTIONS]
    assert {"figure1", "figure2", "tables_1_2", "table_3", "kernels", "cpu_speed", "gpu_runs"} <= set(names)
    assert len(names) == len(set(names))
    for m in modules:
        assert all(isinstance(t, Table) for t in getattr(m, "TABLES", [])), m.__name__


def test_a_column_takes_the_one_run_the_manifest_names_never_a_mix_of_folders(tmp_path):
    """Two CPU runs of Table 1: one with softmax and linear (400 steps), one with all four
    attentions (600 steps). The CPU column takes the one the manifest names alone, here the
    smaller (the old rule took the folder with the most attentions), and each attention from it
    (it once took each from whichever folder was read last)."""
    for folder, values in (("z_short", {"softmax": 1.9, "linear": 1.8}),
                           ("b_long", {"softmax": 1.7, "linear": 1.65, "lsh-4": 1.6, "lsh-1": 1.66})):
        (tmp_path / folder).mkdir()
        pd.DataFrame([{"dataset": "mnist", "attention": a, "eval_bits_per_dim": v, "device": CPU, "status": "ok"}
                      for a, v in values.items()]).to_csv(tmp_path / folder / "bpd_final.csv", index=False)
    write_manifest(tmp_path, tables_1_2={"bits_per_dim": ["z_short"]})
    md = build(tmp_path, tmp_path / "REPORT.md")
    for att, v in (("softmax", "1.9"), ("linear", "1.8"), ("lsh-4", "not yet run")):
        assert cells(md, att, "### Table 1: MNIST")["our bits/dim, CPU"] == v
    assert "Our bits/dim, CPU: one run, `z_short`" in md and "b_long" not in md
    write_manifest(tmp_path, tables_1_2={"bits_per_dim": ["b_long"]})
    md = build(tmp_path, tmp_path / "REPORT.md")
    for att, v in (("softmax", "1.7"), ("linear", "1.65"), ("lsh-4", "1.6")):
        assert cells(md, att, "### Table 1: MNIST")["our bits/dim, CPU"] == v
    # the commits its runs were made at, from the folder's raw rows: one per attention where they
    # differ (runs added in a later GPU window)
    (tmp_path / "b_long" / "image_rows.jsonl").write_text("".join(
        json.dumps({"attention": a, "kind": "final", "git_sha": sha}) + "\n"
        for a, sha in (("softmax", "aaaaaaa1111"), ("linear", "bbbbbbb2222"), ("lsh-4", "aaaaaaa1111"))))
    md = build(tmp_path, tmp_path / "REPORT.md")
    assert f"`b_long` ({CPU}, git aaaaaaa (softmax, lsh-4), bbbbbbb (linear))" in md
    (tmp_path / "b_long" / "image_rows.jsonl").write_text(json.dumps({"attention": "linear", "git_sha": "ccccccc3"}))
    assert f"`b_long` ({CPU}, git ccccccc)" in build(tmp_path, tmp_path / "REPORT.md")


def test_an_images_per_s_column_holds_the_named_run_at_its_batch(tmp_path):
    """Three CPU throughput runs: a loaded one of three methods at batches 1 and 10, a run of linear
    alone at batch 64 (another machine), a quiet run of two methods at batch 1 measured in full.
    Table 4's columns are the loaded run at batch 10 and the quiet run at batch 1 (named quiet), as
    the manifest says: each value marked loaded (and extrapolated where it was), each run named
    under the table with its command, the batch-64 run never shown. Table 5 names the quiet run
    alone: the old ranking put the loaded run (the most cells) first there."""
    def run(folder, rows, load, device=CPU):
        (tmp_path / folder).mkdir()
        pd.DataFrame([{"size": "mnist", "method": m, "batch": b, "images_per_s": v, "seconds_per_image": 1 / v,
                       "extrapolated": x, "device": device, "loadavg_1min_start": load, "loadavg_1min_end": load,
                       "git_sha": "abcdef123456", "status": "ok"} for m, b, v, x in rows]).to_csv(
            tmp_path / folder / "throughput.csv", index=False)
        (tmp_path / folder / "command.txt").write_text(f"python run.py task=throughput task.publish={folder}\n")

    run("loaded", [(m, b, v * b, m == "softmax") for m, v in (("softmax", 0.01), ("linear", 0.3),
                                                               ("stateful-softmax", 0.2)) for b in (1, 10)], 5.0)
    run("big_batch", [("linear", 64, 99.0, False)], 1.0, device="Intel(R) Xeon(R) Processor (2 cores, 1 threads)")
    run("quiet", [("linear", 1, 0.5, False), ("stateful-softmax", 1, 0.4, False)], 0.9)
    write_manifest(tmp_path, table_5=[{"folder": "quiet", "batch": 1}],
                   table_4=[{"folder": "loaded", "batch": 10}, {"folder": "quiet", "batch": 1, "quiet": True}])
    md = build(tmp_path, tmp_path / "REPORT.md")
    t4 = cells(md, "linear", "### Table 4, MNIST")
    assert t4["our images/s, CPU, batch 10"] == "3 (loaded)" and t4["our images/s, CPU, batch 1, quiet run"] == "0.5"
    assert cells(md, "softmax", "### Table 4, MNIST")["our images/s, CPU, batch 10"] == "0.1 (extrapolated, loaded)"
    assert cells(md, "softmax", "### Table 4, MNIST")["our images/s, CPU, batch 1, quiet run"] == "not in this run"
    section = md.split("### Table 4, MNIST", 1)[1].split("\n### ", 1)[0]
    assert "99" not in section.split("\n\n")[1] and "big_batch" not in md  # the table itself: no batch-64 value
    assert ("Our images/s, CPU, batch 10: one run, `loaded` (AMD EPYC (2 cores, 1 threads), git abcdef1, 1-min load "
            "5.0-5.0): `python run.py task=throughput task.publish=loaded`.") in section
    assert "Our images/s, CPU, batch 1, quiet run: one run, `quiet`" in section
    assert cells(md, "linear", "### Table 5, MNIST")["our s/image, CPU, batch 1"] == "2"
    table_5 = md.split("### Table 5, MNIST", 1)[1].split("\n### ", 1)[0]
    assert "Our s/image, CPU, batch 1: one run, `quiet`" in table_5 and "`loaded`" not in table_5


def test_figure1_shows_the_runs_the_manifest_names_in_its_order(tmp_path):
    """Three CPU runs measure linear at N = 512 (different code, batch and memory method): Figure 1
    shows the two the manifest names, in its order, each naming what sets it apart (code version,
    tokens per point, memory method); the third is not shown; a run of other lengths prints no rows
    of points it never tried."""
    for folder, ms, batch, sha in (("fig_a", 127.0, 32, "aaaaaaa111"), ("fig_b", 36.0, 8, "bbbbbbb222"),
                                   ("fig_c", 50.0, 8, "ccccccc333")):
        (tmp_path / folder).mkdir()
        pd.DataFrame([{"attention": "linear", "n": 512, "batch": batch, "repeats": 3, "status": "ok",
                       "time_per_sample_ms": ms, "mem_per_sample_mb": 12.0, "causal": True, "device": CPU,
                       "git_sha": sha, "mem_method": "peak RSS", "time": "2026-11-23T00:00:00+00:00"}]).to_csv(
            tmp_path / folder / "benchmark.csv", index=False)
    (tmp_path / "fig_limits").mkdir()
    pd.DataFrame([{"attention": "softmax", "n": 8192, "batch": 1, "repeats": 1, "status": "ok",
                   "time_per_sample_ms": 9.0, "mem_per_sample_mb": 1.0, "causal": True, "device": CPU}]).to_csv(
        tmp_path / "fig_limits" / "benchmark.csv", index=False)
    write_manifest(tmp_path, figure1=["fig_b", "fig_a", "fig_limits"])
    md = build(tmp_path, tmp_path / "REPORT.md")
    assert md.index("### fig_b (causal)") < md.index("### fig_a (causal)") < md.index("### fig_limits (causal)")
    assert "fig_c" not in md and "ccccccc" not in md
    assert row(md, "linear | linear | 512", "### fig_a (causal)")[4] == "127"
    assert row(md, "linear | linear | 512", "### fig_b (causal)")[4] == "36"
    assert "Run: git aaaaaaa; 2026-11-23; 16,384 tokens per point (batch x N); 3 timed repeats; memory: peak RSS" in md
    assert "Run: git bbbbbbb; 2026-11-23; 4,096 tokens per point (batch x N)" in md
    limits = md.split("### fig_limits (causal)", 1)[1].split("\n### ", 1)[0]
    assert "| softmax |" not in limits.split("Slopes")[0] and "hold none of the paper's read-off points" in limits


def test_figure1_shows_the_bytes_kept_for_backward_and_the_memory_spread(tmp_path):
    (tmp_path / "fig").mkdir()
    pd.DataFrame([{"attention": a, "n": 512, "batch": 8, "repeats": 3, "status": "ok", "time_per_sample_ms": 1.0,
                   "mem_per_sample_mb": m, "mem_per_sample_min_mb": m - 1, "mem_per_sample_max_mb": m + 2,
                   "saved_per_sample_mb": k, "causal": True, "device": CPU}
                  for a, m, k in (("linear", 12.0, 4.5), ("softmax", 9.0, 5.0))]).to_csv(
        tmp_path / "fig" / "benchmark.csv", index=False)
    (tmp_path / "fig" / "summary.json").write_text(json.dumps({"attentions": {
        "linear": {"time_slope_all": 1.0, "mem_slope_all": 1.0, "saved_slope_all": 0.99, "largest_n": 512}}}))
    write_manifest(tmp_path, figure1=["fig"])
    md = build(tmp_path, tmp_path / "REPORT.md")
    assert cells(md, "linear | linear | 512", "### fig")["our MB/sample kept for backward"] == "4.5"
    assert cells(md, "linear | linear | 512", "### fig")["our MB/sample (peak; min-max over passes)"] == "12 (11-14)"
    assert cells(md, "linear", "Slopes")["our kept-for-backward slope"] == "0.99"


def test_table_3_marks_timed_updates_and_sets_both_softmaxes_beside_the_paper(tmp_path):
    """A timing run's seconds per epoch come from a few timed updates: each says how many, in wall
    and CPU time; the paper's softmax (the N x N matrix) gets both of ours: softmax-math and SDPA."""
    (tmp_path / "speed").mkdir()
    pd.DataFrame([{"model": m, "steps": 8, "valid_per_%": 150.0, "s_per_epoch": w, "cpu_s_per_epoch": c, "status": "ok"}
                  for m, w, c in (("softmax", 30.0, 17.5), ("softmax-math", 58.0, 38.5), ("linear", 16.0, 11.5))]
                 ).to_csv(tmp_path / "speed" / "asr_table.csv", index=False)
    (tmp_path / "speed" / "asr_rows.jsonl").write_text(json.dumps({"device": CPU, "label": "CPU timing run"}) + "\n")
    write_manifest(tmp_path, table_3=["speed"])
    md = build(tmp_path, tmp_path / "REPORT.md")
    assert row(md, "softmax | softmax-math", "### speed")[2:] == [
        "5.12", "timing run", "2711", "58 (from 8 updates)", "38.5 (from 8 updates)"]
    assert row(md, "softmax | softmax", "### speed")[5:] == ["30 (from 8 updates)", "17.5 (from 8 updates)"]
    assert row(md, "lsh-4", "### speed")[3:] == ["not run here", "2250", "—", "—"]


def test_figure2_gives_the_spread_and_what_the_loss_scores(tmp_path):
    """Each copy run says whether its loss scores the copy alone or the separator too (the authors'
    scoring; runs from before the option scored the copy), and gives the seeds' spread."""
    for folder, flag in (("ours", None), ("authors", True)):
        (tmp_path / folder).mkdir()
        pd.DataFrame([{"max_len": 32, "attention": "linear", "n_seeds": 3, "steps": 800, "eval_loss": 0.3,
                       "eval_loss_std": 0.05, "eval_accuracy": 0.9, "time_per_step_ms": 50.0, "status": "ok"}]
                     ).to_csv(tmp_path / folder / "copy_final.csv", index=False)
        row_ = {"attention": "linear", "device": CPU, **({} if flag is None else {"score_separator": flag})}
        (tmp_path / folder / "copy_rows.jsonl").write_text(json.dumps(row_) + "\n")
    write_manifest(tmp_path, figure2=["ours", "authors"])
    md = build(tmp_path, tmp_path / "REPORT.md")
    assert "### ours\n\nHardware" in md and "Scored: copy\n" in md.split("### ours", 1)[1]
    assert "Scored: copy + separator\n" in md.split("### authors", 1)[1]
    assert row(md, "32 | linear", "### ours")[4] == "0.3 ± 0.05"


def test_an_archived_run_is_kept_but_never_read_or_reported(tmp_path):
    """A run the manifest lists as archived (superseded), wherever it lies: no table, no "Other
    results" line, and its files are never read (a damaged one stops nothing). The report used to
    leave out results/archive/ by its name and read every other folder."""
    fake_results(tmp_path)
    shutil.copytree(tmp_path / "fig1", tmp_path / "fig1_old")
    (tmp_path / "fig1_old" / "benchmark.csv").write_text("attention,n\nlinear,5")  # torn: no newline at its end
    fake_manifest(tmp_path, archived={"fig1_old": "superseded by fig1"})
    md = build(tmp_path, tmp_path / "REPORT.md")
    assert "fig1_old" not in md and "### fig1 (causal)" in md


def test_a_folder_of_several_commands_shows_each_as_its_own_span(tmp_path):
    """A reproduce_gpu step writes one command a line to command.txt (the MNIST step: one per
    attention); joined into one span they read as one command that does not parse. Each is its
    own span, and a backslash still continues a line."""
    from repro.reproduction.report.format import code, command, commands_of
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "command.txt").write_text("python run.py attention=softmax \\\n   seed=0\npython run.py attention=linear\n")
    (b / "command.txt").write_text("python run.py attention=linear\npython run.py attention=lsh-1\n")
    assert command(a, tmp_path) == "python run.py attention=softmax seed=0\npython run.py attention=linear"
    assert code(command(a, tmp_path)) == "`python run.py attention=softmax seed=0`; `python run.py attention=linear`"
    assert commands_of([a, b], tmp_path) == ("`python run.py attention=softmax seed=0`; "
                                             "`python run.py attention=linear`; `python run.py attention=lsh-1`")


@pytest.mark.parametrize("damage", ["torn_csv", "short_row", "empty_csv", "torn_json", "bad_jsonl_line",
                                    "dropped_column", "torn_copy_rows", "torn_image_rows", "no_eval_loss",
                                    "no_s_per_epoch", "no_status", "empty_copy_rows"])
def test_a_damaged_results_file_stops_the_report_with_one_line_naming_it(tmp_path, damage, capsys):
    """A torn last line of figure1-cpu/benchmark.csv used to retitle its section and drop a row; a
    torn copy_final.csv turned both Figure 2 verdicts around (NaN compared as a number); a torn
    JSON or JSONL, or an empty CSV, gave a traceback. Each is now one line naming the file (and the
    line), and nothing is written."""
    results = tmp_path / "results"
    shutil.copytree(REPO / "results", results)
    before = (results / "REPORT.md").read_text()
    path, expect = {
        "torn_csv": ("figure1-cpu/benchmark.csv", r"figure1-cpu/benchmark.csv, line \d+: the last line is cut off"),
        "short_row": ("copy/figure2_n128_cpu/copy_final.csv", r"copy_final.csv, line 3: \d+ fields where the header"),
        "empty_csv": ("figure1-cpu/empty.csv", r"empty.csv: not a readable CSV"),
        "torn_json": ("figure1-cpu/summary.json", r"figure1-cpu/summary.json, line \d+: not valid JSON"),
        "bad_jsonl_line": ("images/mnist_claims_seeds_cpu/image_rows.jsonl",
                           r"image_rows.jsonl, line 2 is not valid JSON"),
        "dropped_column": ("images/mnist_claims_seeds_cpu/bpd_final.csv",
                           r"bpd_final.csv: no column 'eval_bits_per_dim'"),
        # a torn last line of a JSONL used to be dropped: softmax fell to 2 seeds and the copy claim became
        # "not judged"; the same on image_rows.jsonl changed Table 2's ms/step
        "torn_copy_rows": ("copy/figure2_n128_cpu/copy_rows.jsonl",
                           r"figure2_n128_cpu/copy_rows.jsonl, line \d+: the last line is cut off"),
        "torn_image_rows": ("images/mnist_claims_seeds_cpu/image_rows.jsonl",
                            r"mnist_claims_seeds_cpu/image_rows.jsonl, line \d+: the last line is cut off"),
        # a dropped column used to become a silent "—" (and a raw nan for benchmark.csv's status)
        "no_eval_loss": ("copy/figure2_n128_cpu/copy_final.csv", r"copy_final.csv: no column 'eval_loss'"),
        "no_s_per_epoch": ("asr/speed_800_cpu/asr_table.csv", r"asr_table.csv: no column 's_per_epoch'"),
        "no_status": ("figure1-cpu/benchmark.csv", r"figure1-cpu/benchmark.csv: no column 'status'"),
        "empty_copy_rows": ("copy/figure2_n128_cpu/copy_rows.jsonl", r"copy_rows.jsonl: no rows \(an empty file"),
    }[damage]
    f = results / path
    if damage == "torn_csv" or damage == "torn_json":
        f.write_text(f.read_text()[:-15])
    elif damage.startswith("torn_"):
        f.write_text(f.read_text()[:-40])
    elif damage.startswith("no_"):
        pd.read_csv(f).drop(columns=damage[3:]).to_csv(f, index=False)
    elif damage == "empty_copy_rows":
        f.write_text("")
    elif damage == "short_row":
        lines = f.read_text().split("\n")
        lines[2] = lines[2].rsplit(",", 1)[0]  # one field fewer, the newline kept
        f.write_text("\n".join(lines))
    elif damage == "empty_csv":
        f.write_text("")
    elif damage == "dropped_column":  # used to make Table 1 take its bits/dim from another folder
        pd.read_csv(f).drop(columns="eval_bits_per_dim").to_csv(f, index=False)
    else:
        lines = f.read_text().split("\n")
        lines[1] = lines[1][: len(lines[1]) // 2]
        f.write_text("\n".join(lines))
    with pytest.raises(SystemExit) as stop:
        main(["--results", str(results)])
    line = str(stop.value.code)
    assert line.startswith("error: ") and "\n" not in line and re.search(expect, line), line
    assert (results / "REPORT.md").read_text() == before


# ----------------------------------------------------------------------------- failed runs and their commands

def test_a_failed_run_is_shown_failed_with_its_status_in_every_section(tmp_path):
    """A diverged run (status "error: non-finite loss ...") used to show "—" cells with no mark, and a
    failed run with a finite number showed that number as a result: each section now says it failed
    and why. A run stopped at its time budget (the equal-time runs) has not failed."""
    fake_results(tmp_path)
    bad = "error: non-finite loss nan at step 2"
    copy = tmp_path / "copy" / "diverged"
    copy.mkdir(parents=True)
    pd.DataFrame([{"max_len": 24, "attention": "linear", "n_seeds": 1, "steps": 3, "eval_loss": None,
                   "eval_accuracy": None, "time_per_step_ms": 57.1, "status": bad},
                  {"max_len": 24, "attention": "softmax", "n_seeds": 1, "steps": 6, "eval_loss": 0.5,
                   "eval_accuracy": 0.6, "time_per_step_ms": 50.0, "status": "timeout"}]).to_csv(
        copy / "copy_final.csv", index=False)
    path = tmp_path / "asr_table" / "asr_table.csv"
    pd.read_csv(path).assign(status=bad).to_csv(path, index=False)
    path = tmp_path / "throughput" / "cpu_measured" / "throughput.csv"
    pd.read_csv(path).assign(status="oom").to_csv(path, index=False)
    fake_manifest(tmp_path, figure2=["copy/diverged"])
    img = tmp_path / "images" / "mnist"
    pd.DataFrame([{"dataset": "mnist", "attention": "linear", "bits_per_dim": None, "device": CPU, "status": bad},
                  {"dataset": "mnist", "attention": "softmax", "bits_per_dim": 1.5, "device": CPU,
                   "status": "stopped: time limit"}]).to_csv(img / "image_final.csv", index=False)
    md = build(tmp_path, tmp_path / "REPORT.md")
    assert row(md, "24 | linear", "### copy/diverged")[4:6] == [f"failed ({bad})"] * 2
    assert row(md, "24 | softmax", "### copy/diverged")[4:6] == ["failed (timeout)"] * 2  # its 0.5 is no result
    assert row(md, "bilstm", "### asr_table")[3] == f"failed ({bad})"
    assert cells(md, "linear", "### Table 5, MNIST")["our s/image, CPU, batch 1"] == "oom"
    assert cells(md, "linear", "### Table 1: MNIST")["our bits/dim, CPU"] == f"failed ({bad})"
    assert cells(md, "softmax", "### Table 1: MNIST")["our bits/dim, CPU"] == "1.5"


def test_a_parent_readme_gives_a_command_only_to_a_folder_it_names(tmp_path):
    """A run published beside documented ones used to get the parent README's first command (another
    folder's): now only a line naming the folder counts; else it says the command is not recorded."""
    from repro.reproduction.report.format import command

    (tmp_path / "copy" / "named").mkdir(parents=True)
    (tmp_path / "copy" / "diverged").mkdir()
    (tmp_path / "copy" / "README.md").write_text(
        "- `other/`:\n\n      python run.py -m experiment=copy_figure2_cpu\n\n"
        "- `named/`: `python run.py experiment=smoke_copy task.publish=results/copy/named`\n")
    assert command(tmp_path / "copy" / "named", tmp_path) == \
        "python run.py experiment=smoke_copy task.publish=results/copy/named"
    assert command(tmp_path / "copy" / "diverged", tmp_path) == "not recorded (add a command.txt)"


def test_publishing_writes_the_commands_that_made_the_rows(tmp_path, monkeypatch):
    """run.py records its command line (with the settings from the environment that change results);
    every row carries it and the published folder gets it as command.txt, one command a line, so a
    new run's folder is never "not recorded"."""
    import torch

    from repro.common import results
    from repro.reproduction.report.format import command

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    typed = ["experiment=smoke_copy", "task.label=two words", "task.publish=results/copy/x"]
    line = results.run_command(typed)
    assert line == "OMP_NUM_THREADS=1 python run.py experiment=smoke_copy 'task.label=two words' " \
                   "task.publish=results/copy/x"
    assert results.run_command(["a=1"], world_size=2).endswith("torchrun --nproc_per_node=2 run.py a=1")
    # a run started by another with settings of its own (a scorecard's reference): those alone
    assert results.run_command(["a=1"], env={"REPRO_KERNEL": "torch"}) == "REPRO_KERNEL=torch python run.py a=1"
    assert results.run_command(["a=1"], env={}) == "python run.py a=1"
    monkeypatch.setenv(results.COMMAND_ENV, line)
    row_ = {"publish": str(tmp_path / "copy" / "x"), **results.provenance(torch.device("cpu"))}
    assert row_["command"] == line
    folder = results.publish_folder([row_, {**row_, "command": "python run.py seed=1"}, row_])
    assert (folder / "command.txt").read_text() == f"{line}\npython run.py seed=1\n"
    assert command(folder, tmp_path) == f"{line}\npython run.py seed=1"
    monkeypatch.delenv(results.COMMAND_ENV)
    assert "command" not in results.provenance(torch.device("cpu"))  # outside run.py: none claimed


def test_marks_read_load_and_extrapolation_from_a_runs_row():
    """A value is marked loaded only where the row names its cores and its load passed them (the
    larger of the start and end loads), extrapolated only where the row says so."""
    from repro.reproduction.report import marks
    row = {"device": "AMD EPYC (2 cores, 1 threads)", "loadavg_1min_start": 1.5, "loadavg_1min_end": 2.5,
           "extrapolated": "True"}
    assert run_load(row) == 2.5 and marks.loaded(row) and marks.extrapolated(row)
    assert marks.marked(3.0, row) == "3 (extrapolated, loaded)"
    quiet = {**row, "loadavg_1min_end": float("nan"), "extrapolated": False}
    assert run_load(quiet) == 1.5 and not marks.loaded(quiet) and marks.marked(3.0, quiet) == "3"
    assert not marks.loaded({**row, "device": "NVIDIA H100 80GB HBM3"})  # no core count: never judged loaded
