"""The paper's GPU results on one GPU, in seven resumable steps:

    python -m repro.reproduce_gpu                  # every step (about 30 minutes on an H100)
    python -m repro.reproduce_gpu --steps 2,3      # a subset
    python -m repro.reproduce_gpu --smoke          # every step at tiny sizes on the CPU (a test)

  1 env         environment report (GPU, driver, torch, CuPy, ...), the GPU kernel tests
                (REPRO_KERNEL=cupy pytest tests/kernels/test_cupy_kernels.py), and compute-sanitizer
                memcheck and racecheck on one small launch of each kernel, when it is on PATH
  2 kernels     the kernel benchmark, fp32 and bf16, N = 1k .. 64k, against the chunked path, the
                authors' CUDA kernel, fla's chunk kernel and SDPA (% of the bandwidth floor)
  3 figure1     Figure 1 at the paper's grid, N = 2^9 .. 2^16: softmax, softmax-math, linear, lsh-1/4/8
  4 generation  seconds per image at batch 1 and images/s at batch 256 (Tables 1, 2, 4, 5 GPU
                columns): linear, stateful softmax, softmax, lsh-1; and at batch 1 linear and the
                cache with the whole step as one CUDA graph (generation_graphed/)
  5 copy        the copy task at the paper's settings (experiment=paper_copy, 10,000 updates):
                softmax and linear seed by seed, then lsh-4 and the delta rule, seeds 0-2
                (--copy-attentions, --copy-seeds); one run a job, cut at --copy-wall-s and resumed
                by the next command, on this node or, from the packed checkpoint, on another
  6 mnist       MNIST, the paper's 8-layer model on the embedded digits, the same training wall
                time (trainer.max_time_s=60: steps and evaluations) for softmax, linear, lsh-1 and
                lsh-4: bits/dim against steps and against the rows' elapsed_s
  7 speech      speech timing at about 800 frames, softmax against linear, the paper's encoder sizes

Each step runs the suite's own commands (`python run.py experiment=... task.*=...`,
`python -m repro.reproduction.bench`) as jobs; results go to results/gpu/<device>/<step>/ in the
formats `python -m repro.report` reads, with the exact commands in command.txt and each job's
log in logs/. Run folders and checkpoints go to outputs/gpu/<device>/ (not committed).
A job that finished is not run again, a step whose jobs all finished is skipped (--force redoes
it, training runs from scratch), and a job cut by its wall-clock cap is stopped with SIGTERM (the
training loop then checkpoints and writes its final row) and resumed by the next run (an MNIST
run too: its elapsed_s, and so its time limit, goes on from the checkpoint). Each step is sized
to stay under 8 minutes on an H100. GPU-only jobs say why they were skipped (e.g. in --smoke).
"""
import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from repro.common.results import REPO, atomic_write, provenance
from repro.reproduction.gpu_pack import PACK_NAME, PACKED, pack, unpack
from repro.reproduction.gpu_steps import (
    COPY_ATTENTIONS,
    COPY_SEEDS,
    COPY_WALL_S,
    MIN_JOB_S,
    STEPS,
    Ctx,
    copy_jobs,
    copy_runs,
    device_folder,
    env_jobs,
    figure1_jobs,
    generation_jobs,
    kept_rows,
    kernels_jobs,
    mnist_jobs,
    mnist_runs,
    speech_jobs,
)
from repro.reproduction.jobs import Interrupted, finished_ok, on_signal, run_job, shown


def env_report(ctx):
    """env.json: what this machine is, from torch, CuPy, nvidia-smi and nvcc."""
    device = torch.device("cuda") if ctx.device == "cuda" else torch.device("cpu")
    report = {**provenance(device), "cuda_available": torch.cuda.is_available(),
              "torch_cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        report.update(capability=list(torch.cuda.get_device_capability(0)), sms=p.multi_processor_count,
                      memory_gb=p.total_memory / 2**30, l2_mb=getattr(p, "L2_cache_size", 0) / 2**20)
    try:
        import cupy
        report["cupy"] = cupy.__version__
        report["cupy_cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        if torch.cuda.is_available():
            report["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception as err:
        report["cupy"] = f"unavailable: {str(err).splitlines()[0][:200]}"
    for tool, args in (("nvidia-smi", ["--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                       "--format=csv,noheader"]), ("nvcc", ["--version"])):
        if shutil.which(tool):
            res = subprocess.run([tool, *args], capture_output=True, text=True)
            report[tool] = (res.stdout or res.stderr).strip().splitlines()[-4:]
        else:
            report[tool] = "not on PATH"
    for dist in ("triton", "hydra-core", "flash-linear-attention", "fla-core", "mlxtend"):
        try:
            from importlib.metadata import version
            report[dist] = version(dist)
        except Exception:
            report[dist] = None
    atomic_write(ctx.out / "env" / "env.json", json.dumps(report, indent=1, default=str) + "\n")


def copy_finish(ctx):
    from repro.tasks.copy import aggregate
    aggregate(kept_rows(ctx, "copy", copy_runs(ctx)), ctx.runs / "copy")  # published in results/gpu/<device>/copy


def mnist_finish(ctx):
    """The image task's aggregate over the four runs, and bits/dim against training time: each
    held-out evaluation at its row's elapsed_s (the run's seconds of training, steps and
    evaluations, when that evaluation ended)."""
    import pandas as pd

    from repro.common.results import rows_to_csv
    from repro.tasks.image import aggregate
    rows = kept_rows(ctx, "mnist", mnist_runs(ctx))
    aggregate(rows, ctx.runs / "mnist")
    df = pd.DataFrame(rows)
    ev = df[(df.kind == "eval") & df.get("bits_per_dim", pd.Series(dtype=float)).notna()]
    ev = ev.rename(columns={"bits_per_dim": "eval_bpd"})[["attention", "step", "elapsed_s", "eval_bpd", "device"]]
    atomic_write(ctx.out / "mnist" / "bpd_vs_time.csv", rows_to_csv(ev.to_dict("records")))
    _plot_bpd(ev, ctx.out / "mnist" / "bpd_vs_time.png")


def _plot_bpd(ev, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from repro.common.results import save_figure
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for att, g in ev.groupby("attention"):
        axes[0].plot(g.step, g.eval_bpd, marker="o", label=att)
        axes[1].plot(g.elapsed_s, g.eval_bpd, marker="o", label=att)
    for ax, xlabel in zip(axes, ("gradient steps", "seconds of training (elapsed_s: steps and evaluations)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out bits/dim")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"MNIST, 8 layers, the same wall time per attention, on {ev.device.iloc[0] if len(ev) else '?'}",
                 fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


@dataclass
class Step:
    number: int
    jobs: callable
    before: callable = None  # in-process, before the jobs (the environment report)
    finish: callable = None  # in-process, after every job finished (aggregates across runs)


STEP_DEFS = {1: Step(1, env_jobs, before=env_report), 2: Step(2, kernels_jobs), 3: Step(3, figure1_jobs),
             4: Step(4, generation_jobs), 5: Step(5, copy_jobs, finish=copy_finish),
             6: Step(6, mnist_jobs, finish=mnist_finish), 7: Step(7, speech_jobs)}


# ----------------------------------------------------------------------------- running

def run_step(ctx, number, force=False, deadline=None):
    """Runs one step's jobs that have not finished; True when the whole step is done. Under a
    deadline (time.monotonic()), a job is not started with less than MIN_JOB_S left."""
    name, d = STEPS[number], ctx.out / STEPS[number]
    marker = d / "status.json"
    spec = STEP_DEFS[number]
    jobs = spec.jobs(ctx)

    # done earlier, and no job added since (a new method, --copy-seeds): nothing to run
    if marker.is_file() and json.loads(marker.read_text()).get("status") == "done" and not force \
            and all(j.skip or finished_ok(d / "jobs" / f"{j.name}.json") for j in jobs):
        print(f"[{number} {name}] done earlier ({marker}); --force redoes it")
        return True
    d.mkdir(parents=True, exist_ok=True)
    if spec.before:
        spec.before(ctx)
    commands = "".join(shown(j.argv) + "\n" for j in jobs if not j.skip)
    # written again once the jobs have run: a job publishing into d writes its own command.txt (its one command)
    atomic_write(d / "command.txt", commands)
    results, kept_new = {}, False
    for job in jobs:
        jm = d / "jobs" / f"{job.name}.json"
        prev = json.loads(jm.read_text()) if jm.is_file() else {}
        if prev.get("status") == "ok" and not force:
            results[job.name] = prev
            continue
        if job.skip:
            results[job.name] = {"status": "skipped", "reason": job.skip}
            print(f"[{number} {name}] {job.name}: skipped: {job.skip}")
        elif deadline is not None and deadline - time.monotonic() < MIN_JOB_S:
            results[job.name] = {"status": "not started: --budget-s spent", "command": shown(job.argv)}
            print(f"[{number} {name}] {job.name}: not started: --budget-s spent (the next command runs it)")
        else:
            if job.fresh is not None and Path(job.fresh).exists():
                shutil.rmtree(job.fresh)  # a training run that starts from scratch: not over an old one
            print(f"[{number} {name}] {job.name}: {shown(job.argv)}", flush=True)
            try:
                status, rc, seconds = run_job(job, d / "logs" / f"{job.name}.log", deadline=deadline)
            except Interrupted:
                atomic_write(d / "command.txt", commands)
                atomic_write(jm, json.dumps({"status": "interrupted", "command": shown(job.argv)}, indent=1) + "\n")
                atomic_write(marker, json.dumps({"status": "incomplete", "jobs": results}, indent=1) + "\n")
                raise
            results[job.name] = {"status": status, "rc": rc, "seconds": round(seconds, 1),
                                 "command": shown(job.argv), "wall_s": job.wall_s}
            if status == "ok" and job.rows is not None:
                if not Path(job.rows).is_file():
                    results[job.name]["status"] = status = f"failed: it wrote no {job.rows.name}"
                else:
                    atomic_write(d / "runs" / f"{job.name}.jsonl", Path(job.rows).read_bytes())
                    kept_new = True
            print(f"[{number} {name}] {job.name}: {status} in {seconds:.0f} s "
                  f"(log: {d / 'logs' / (job.name + '.log')})")
            if status != "ok":
                tail = (d / "logs" / f"{job.name}.log").read_text().splitlines()[-15:]
                print("\n".join("    " + line for line in tail))
        atomic_write(jm, json.dumps(results[job.name], indent=1) + "\n")
    done = all(r["status"] in ("ok", "skipped") for r in results.values())
    # the aggregate over the runs finished so far, also when others are still to run (a window
    # may end first): what a later window adds is aggregated with them then
    if spec.finish and (done or kept_new):
        try:
            spec.finish(ctx)
            if not done:
                print(f"[{number} {name}] aggregated the runs finished so far; the others follow in a later command")
        except Exception as err:
            print(f"[{number} {name}] aggregating failed: {type(err).__name__}: {err}")
            done = False
    atomic_write(d / "command.txt", commands)
    atomic_write(marker, json.dumps({"status": "done" if done else "incomplete", "jobs": results}, indent=1) + "\n")
    print(f"[{number} {name}] {'done' if done else 'INCOMPLETE: rerun to continue (finished jobs are kept)'}")
    return done


def parse_steps(text):
    """'1,3-5' -> [1, 3, 4, 5]; names work too ('env,kernels')."""
    by_name = {v: k for k, v in STEPS.items()}
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part in by_name:
            out.append(by_name[part])
        elif re.fullmatch(r"\d+(-\d+)?", part):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi or lo) + 1))
        else:
            out.append(part)
    bad = [s for s in out if s not in STEPS]
    if bad or not out:
        raise ValueError(f"--steps {text!r}: {bad or 'empty'} are not steps; valid: 1-7 or "
                         f"{', '.join(f'{k}={v}' for k, v in STEPS.items())}")
    return sorted(set(out))


def parse_copy(attentions: str, seeds: str, wall_s: float) -> dict:
    """Step 5's options as Ctx fields; a bad one is a ValueError naming it and what is valid."""
    from repro.conf.attention import named_attentions

    names = [a.strip() for a in attentions.split(",") if a.strip()]
    valid = named_attentions()
    bad = [a for a in names if a not in valid]
    if bad or not names:
        raise ValueError(f"--copy-attentions {attentions!r}: {bad or 'empty'}; valid: {', '.join(valid)}")
    if not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", seeds):
        raise ValueError(f"--copy-seeds {seeds!r}: give seeds as non-negative integers, e.g. 0,1,2")
    if not (wall_s > 0 and wall_s != float("inf")):
        raise ValueError(f"--copy-wall-s {wall_s}: give a positive number of seconds")
    return {"copy_attentions": tuple(dict.fromkeys(names)),
            "copy_seeds": tuple(dict.fromkeys(int(s) for s in seeds.split(","))), "copy_wall_s": wall_s}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m repro.reproduce_gpu", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--steps", default="1-7", help="e.g. 1,3-5 or env,kernels (default: all)")
    ap.add_argument("--smoke", action="store_true", help="every step at tiny sizes on the CPU")
    ap.add_argument("--force", action="store_true", help="rerun finished steps and jobs")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds this command may take in all: a job is stopped (SIGTERM, checkpoint) before "
                         "then and none starts with under 30 s left; the next command resumes (docs/gpu.md)")
    ap.add_argument("--out", default=None, help="default results/gpu/<device>/ (--smoke: outputs/gpu-smoke/results)")
    ap.add_argument("--runs", default=None, help="run folders; default outputs/gpu/<device>/ "
                    "(--smoke: outputs/gpu-smoke/runs)")
    ap.add_argument("--copy-attentions", default=",".join(COPY_ATTENTIONS),
                    help="step 5's attentions, the first two run seed by seed (default: %(default)s)")
    ap.add_argument("--copy-seeds", default=",".join(map(str, COPY_SEEDS)),
                    help="step 5's seeds (default: %(default)s)")
    ap.add_argument("--copy-wall-s", type=float, default=COPY_WALL_S,
                    help="step 5: seconds a run may take in one command before it is cut and resumed next time "
                         "(default: %(default)s)")
    ap.add_argument("--pack", metavar="DIR", default=None,
                    help=f"only pack {' and '.join(PACKED)} into DIR/{PACK_NAME} (parts past 15 MiB) and exit")
    ap.add_argument("--unpack", metavar="FILE", nargs="+", default=None,
                    help="only extract an archive --pack wrote (its file or parts) into the repository and exit")
    args = ap.parse_args(argv)
    if args.pack or args.unpack:
        try:
            if args.pack:
                files = pack(args.pack)
                print(f"packed into {', '.join(str(f) for f in files)}")
            else:
                names = unpack(args.unpack)
                print(f"unpacked {sum(not n.endswith('/') for n in names)} entries into {REPO}")
        except (ValueError, OSError) as err:
            ap.error(str(err))
        return 0
    try:
        steps = parse_steps(args.steps)
    except ValueError as err:
        ap.error(str(err))
    if args.budget_s is not None and not (args.budget_s > 0 and args.budget_s != float("inf")):
        ap.error(f"--budget-s {args.budget_s}: give a positive number of seconds")
    try:
        copy_options = parse_copy(args.copy_attentions, args.copy_seeds, args.copy_wall_s)
    except ValueError as err:
        ap.error(str(err))
    if not args.smoke and not torch.cuda.is_available():
        ap.error("no CUDA device is visible: this runs the GPU results; --smoke runs every step on the CPU")
    dev = "cpu" if args.smoke else "cuda"
    out = Path(args.out) if args.out else REPO / ("outputs/gpu-smoke/results" if args.smoke
                                                  else f"results/gpu/{device_folder()}")
    runs = Path(args.runs) if args.runs else REPO / ("outputs/gpu-smoke/runs" if args.smoke
                                                     else f"outputs/gpu/{device_folder()}")
    ctx = Ctx(out.resolve(), runs.resolve(), args.smoke, dev, force=args.force, **copy_options)
    print(f"results -> {ctx.out}; runs -> {ctx.runs}")
    began = time.monotonic()
    deadline = began + args.budget_s if args.budget_s else None
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    done = {}
    try:
        for n in steps:
            done[n] = run_step(ctx, n, args.force, deadline)
    except Interrupted as err:
        print(f"interrupted ({err}): the job in flight was stopped; rerun to continue (finished jobs are kept)")
        return 130 if str(err) == "SIGINT" else 143
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"{sum(done.values())}/{len(done)} steps done in {time.monotonic() - began:.0f} s"
          + ("" if all(done.values()) else f"; incomplete: {[STEPS[n] for n, ok in done.items() if not ok]}"))
    if all(done.values()):
        print("next: python -m repro.report")
    return 0 if all(done.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
