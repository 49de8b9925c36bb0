"""python -m repro.report [--results results] [--out PATH] [--docs]: every table and figure of the paper
beside ours, from whatever lies under results/, as one markdown file (results/REPORT.md, written
atomically; --out writes a copy elsewhere, its figure links made relative to it).

What it reads (the convention for results folders; any depth under results/):
  benchmark.csv (+ summary.json, benchmark.png)   Figure 1        (task=benchmark)
  copy_final.csv (+ copy_curves.png, ...)         Figure 2        (task=copy)
  throughput.csv                                  Tables 1/2 and 4 images/s, Table 5 s/image (task=throughput)
  any CSV with a bits_per_dim column              Tables 1/2 bits/dim; rows name `dataset` (mnist,
                                                  cifar10) or carry it in `task`, and `attention`
  any CSV with a PER column                       Table 3, one table per folder: `valid_per_%` /
                                                  `per_%` (percent) or `per` (a fraction when <= 1);
                                                  rows name `attention` (or `model`) and may carry
                                                  seconds_per_epoch or s_per_epoch; a folder whose
                                                  `label` (in the CSV or its .jsonl rows) says
                                                  "timing run" gives seconds per epoch only
  bench.csv (repro.reproduction.bench)                 the CUDA kernel's targets, one table per run
  kernels.csv (task=kernels)                      the chunked path against the loop and naive formula
  bpd_vs_time.csv (+ .png)                        MNIST bits/dim against training time (reproduce_gpu)
  <step>/status.json, env/env.json, env/kernel_tests.xml   each reproduce_gpu run's steps, environment
                                                  and kernel tests
  cpu_speed_<T>t_<time>.csv (+ .json)             the CPU speed of the core, the newest run
                                                  per thread count T (repro.reproduction.cpu_speed)
  rows carry `device` (the hardware) as every result row does (for Tables 1/2 bits/dim and Table 3,
  the run rows in a .jsonl beside the CSV may carry it instead). Tables 1, 2, 4 and 5 give ours in
  one column per hardware: CPU (any CPU), and each GPU by its name; a cell never mixes hardware.
The commands that produced a folder: its `command.txt` (one command a line, a trailing backslash
continuing one; task.publish writes it), else the first `python ...` command in the folder's README.md,
or in the nearest parent's README.md under results/ one on a line naming the folder. A paper table
with no result of ours says "not yet run". A damaged file or a missing declared column stops it with
one line naming the file; a failed run (schema.failed) is shown as failed, never as a result.

The "Beyond the paper" section (successors/: linear attention's successors on the paper's tasks)
owns copy/successors_n128_cpu, copy/lengths_successors_cpu, images/successors_cpu,
throughput/successors_cpu and asr/successors_cpu: the paper's sections never read them.

One module per part of REPORT.md (figure1, figure2, fidelity, images, speech, kernels, cpu_speed,
gpu_runs, memory, successors), each declaring the tables it reads (its TABLES, checked on load by
schema.py); format.py holds what they share and build.py puts them together.
"""
from repro.reproduction.report.build import DOC_BLOCK, build, doc_pages, main, render_blocks, sections
from repro.reproduction.report.schema import SchemaError, Table

__all__ = ["DOC_BLOCK", "SchemaError", "Table", "build", "doc_pages", "main", "render_blocks", "sections"]
