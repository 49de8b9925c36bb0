"""python -m repro.report [--results results] [--out PATH] [--docs]: every table and figure of the paper
beside ours, from the runs results/claims.yaml names, as one markdown file (results/REPORT.md, written
atomically; --out writes a copy elsewhere, its figure links made relative to it).

Which runs: results/claims.yaml (repro.reproduction.manifest) names, for each section and each column
of a table, the folder (or folders) that answer it; a section reads the folders named for it and no
other, and a folder the manifest does not name is not read at all. What each section reads there:
  benchmark.csv (+ summary.json, benchmark.png)   Figure 1        (task=benchmark; report.figure1)
  copy_final.csv (+ copy_curves.png, ...)         Figure 2        (task=copy; report.figure2)
  throughput.csv                                  Tables 1/2 and 4 images/s, Table 5 s/image (task=throughput),
                                                  one run at one batch a column (report.tables_1_2.images_per_s,
                                                  report.table_4, report.table_5)
  a CSV with a bits_per_dim column                Tables 1/2 bits/dim, one folder per hardware (rows name
                                                  `dataset` (mnist, cifar10) or carry it in `task`, and
                                                  `attention`; report.tables_1_2.bits_per_dim)
  a CSV with a PER column                         Table 3, one table per folder: `valid_per_%` / `per_%`
                                                  (percent) or `per` (a fraction when <= 1); rows name
                                                  `attention` (or `model`) and may carry seconds_per_epoch
                                                  or s_per_epoch; a folder whose `label` (in the CSV or its
                                                  .jsonl rows) says "timing run" gives seconds per epoch only
  bench.csv, kernels.csv                          the kernels (repro.reproduction.bench, task=kernels)
  bpd_vs_time.csv (+ .png)                        MNIST bits/dim against training time (reproduce_gpu)
  <step>/status.json, env/env.json, env/kernel_tests.xml   each reproduce_gpu run's steps, environment
                                                  and kernel tests (report.gpu_runs: the run's folder)
  cpu_speed_<T>t_<time>.csv (+ .json)             the CPU speed of the core (report.cpu_speed: the runs)
  rows carry `device` (the hardware) as every result row does (for Tables 1/2 bits/dim and Table 3,
  the run rows in a .jsonl beside the CSV may carry it instead). Tables 1, 2, 4 and 5 give ours in
  columns by hardware: CPU (any CPU), and each GPU by its name; a cell never mixes hardware or runs.
The commands that produced a folder: its `command.txt` (one command a line, a trailing backslash
continuing one; task.publish writes it), else the first `python ...` command in the folder's README.md,
or in the nearest parent's README.md under results/ one on a line naming the folder (the manifest's
`runs` says which). A paper table with no result of ours says "not yet run". A damaged file, a missing
declared column or a manifest that does not say what it must stops it with one line naming the file;
a failed run (schema.failed) is shown as failed, never as a result.

One module per part of REPORT.md (claims, figure1, figure2, fidelity, images, speech, kernels,
cpu_speed, gpu_runs, memory, scorecard), each declaring the tables it reads (its TABLES, checked on load by
schema.py) and taking its folders from the manifest (ctx.tables); format.py holds what they share
and build.py puts them together.
"""
from repro.reproduction.report.build import DOC_BLOCK, build, doc_pages, main, render_blocks, sections
from repro.reproduction.report.schema import SchemaError, Table

__all__ = ["DOC_BLOCK", "SchemaError", "Table", "build", "doc_pages", "main", "render_blocks", "sections"]
