"""task=copy: the paper's Figure 2. A causal transformer learns to repeat a random sequence
after a separator (repro.data.CopyTask); loss and accuracy count the copy only.

One run trains one attention with one seed through the shared loop (repro.training.fit) and
writes train/eval/final rows to its run dir. A Hydra multirun over attention and seed (the
figure), or over task.max_len (the length sweep), ends in aggregate(): loss against gradient
steps per attention (mean over seeds, band from min to max), final accuracy and time per
step per attention against N, as CSVs, plots and a table.
"""
import itertools

import pandas as pd
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from repro.common.errors import ConfigError
from repro.common.results import atomic_write, output_dirs, save_figure
from repro.conf import in_multirun
from repro.conf import run_dir as get_run_dir
from repro.conf.attention import attention_name
from repro.data import CopyTask
from repro.models import AutoregressiveTransformer
from repro.training import fit, seed_everything
from repro.training.distributed import is_main
from repro.training.loop import step_time_text
from repro.training.rows import read_rows


def copy_loss(model, batch):
    """Cross-entropy and accuracy over the scored positions (batch["mask"]: the copy, and the
    separator's with task.score_separator)."""
    logits = model(batch["tokens"])                                   # (B, N, V)
    targets, mask = batch["targets"], batch["mask"].float()          # (B, N)
    ce = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")  # (B, N)
    loss = (ce * mask).sum() / mask.sum()
    right = (logits.argmax(-1) == targets).float() * mask
    accuracy = right.sum() / mask.sum()
    seq_accuracy = (right.sum(1) == mask.sum(1)).float().mean()  # the whole copy right
    return loss, {"accuracy": accuracy.detach(), "seq_accuracy": seq_accuracy.detach()}


def run(cfg) -> float:
    t = cfg.task
    name = attention_name(cfg)
    run_dir = get_run_dir(cfg)
    seed_everything(cfg.seed)
    try:
        data = CopyTask(t.batch_size, t.max_len, t.n_symbols, t.min_copy, t.max_copy, seed=cfg.seed,
                        score_separator=t.score_separator)
    except ValueError as err:
        raise ConfigError(f"task.{err}") from err

    def held_out():  # the same held-out sequences at every evaluation, for every run
        stream = CopyTask(t.batch_size, t.max_len, t.n_symbols, t.min_copy, t.max_copy, seed=t.eval_seed,
                          score_separator=t.score_separator)
        return itertools.islice(stream, cfg.trainer.eval_batches)

    model = AutoregressiveTransformer(instantiate(cfg.attention), n_tokens=data.vocab_size,
                                      **OmegaConf.to_container(cfg.model, resolve=True))
    m = cfg.model
    identity = {"task": "copy", "attention": name, "target": cfg.attention._target_, "seed": cfg.seed,
                "max_len": t.max_len, "min_copy": data.min_copy, "max_copy": data.max_copy,
                "n_symbols": t.n_symbols, "score_separator": bool(t.score_separator), "batch_size": t.batch_size,
                "n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads, "d_ff": m.d_ff,
                "dropout": m.dropout,
                "max_steps": cfg.trainer.max_steps, "label": t.label, "publish": t.publish,
                "publish_replace": bool(t.get("publish_replace"))}
    final = fit(model, copy_loss, data, cfg, run_dir=run_dir, eval_data=held_out, identity=identity)
    print(f"copy {name} N={t.max_len} seed={cfg.seed}: {final['status']}, step {final['steps']}, "
          f"eval loss {final.get('eval_loss', float('nan')):.4f}, eval accuracy "
          f"{final.get('eval_accuracy', float('nan')):.4f}, {step_time_text(final)}")
    if is_main() and not in_multirun():
        aggregate(read_rows(run_dir / "results.jsonl"), run_dir)
    return float(final.get("eval_loss", float("nan")))


# ----------------------------------------------------------------------------- aggregation

def curves(df) -> pd.DataFrame:
    """Long table: per (N, attention, kind, metric, step), mean/std/min/max over seeds."""
    parts = []
    for kind, metrics in [("train", ["loss", "accuracy"]), ("eval", ["loss", "accuracy", "seq_accuracy"])]:
        sub = df[df.kind == kind]
        for metric in metrics:
            if metric not in sub or sub[metric].isna().all():
                continue
            g = sub.groupby(["max_len", "attention", "step"], sort=False)[metric]
            out = g.agg(["mean", "std", "min", "max", "count"]).reset_index().rename(columns={"count": "n_seeds"})
            parts.append(out.assign(kind=kind, metric=metric))
    cols = ["max_len", "attention", "kind", "metric", "step", "mean", "std", "min", "max", "n_seeds"]
    return (pd.concat(parts)[cols].sort_values(["max_len", "attention", "kind", "metric", "step"]) if parts
            else pd.DataFrame(columns=cols))


FINAL_COLUMNS = ["max_len", "attention", "n_seeds", "steps", "train_loss", "eval_loss", "eval_loss_std",
                 "eval_accuracy", "eval_accuracy_std", "eval_seq_accuracy", "time_per_step_ms", "cpu_time_per_step_ms",
                 "status"]


def finals(df) -> pd.DataFrame:
    """Per (N, attention): final held-out loss/accuracy (mean and std over seeds), time per step.
    Runs without a final row (killed, or refused before training) have none here."""
    if "kind" not in df or not (df.kind == "final").any():
        return pd.DataFrame(columns=FINAL_COLUMNS)
    g = df[df.kind == "final"].groupby(["max_len", "attention"])

    def col(key, how):
        return g[key].agg(how) if key in df else float("nan")

    out = pd.DataFrame({
        "n_seeds": g.seed.nunique(), "steps": g.steps.max(), "train_loss": col("train_loss", "mean"),
        "eval_loss": col("eval_loss", "mean"), "eval_loss_std": col("eval_loss", "std"),
        "eval_accuracy": col("eval_accuracy", "mean"), "eval_accuracy_std": col("eval_accuracy", "std"),
        "eval_seq_accuracy": col("eval_seq_accuracy", "mean"),
        "time_per_step_ms": g.time_per_step_ms.mean(),  # each run's median step, averaged over seeds
        "cpu_time_per_step_ms": col("cpu_time_per_step_ms", "mean"),
        "status": g.status.agg(lambda s: ",".join(sorted(set(s)))),
    }).reset_index()
    if "softmax" in set(out.attention):
        ref = out[out.attention == "softmax"].set_index("max_len").time_per_step_ms
        out["speedup_vs_softmax"] = out.max_len.map(ref) / out.time_per_step_ms
        if "cpu_time_per_step_ms" in df:
            ref = out[out.attention == "softmax"].set_index("max_len").cpu_time_per_step_ms
            out["cpu_speedup_vs_softmax"] = out.max_len.map(ref) / out.cpu_time_per_step_ms
    return out


def _title(df) -> str:
    r = df.iloc[0]
    label = f"{r['label']} | " if r.get("label") else ""
    return (f"{label}copy task, {r.n_layers} layers, d_model {r.d_model}, {r.n_heads} heads, d_ff {r.d_ff}, "
            f"batch {r.batch_size}, {r.max_steps} steps, {r.precision}\n{r.device}")


def plot_curves(c, df, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(c.max_len.unique())
    fig, axes = plt.subplots(len(lengths), 2, figsize=(11, 3.8 * len(lengths)), squeeze=False)
    for row, n in zip(axes, lengths):
        for ax, (kind, metric, label) in zip(row, [("train", "loss", "training loss (copy tokens)"),
                                                   ("eval", "accuracy", "held-out copy accuracy")]):
            sel = c[(c.max_len == n) & (c.kind == kind) & (c.metric == metric)]
            for name, g in sel.groupby("attention", sort=True):
                line, = ax.plot(g.step, g["mean"], label=f"{name} ({int(g.n_seeds.max())} seeds)")
                if g.n_seeds.max() > 1:
                    ax.fill_between(g.step, g["min"], g["max"], color=line.get_color(), alpha=0.2, lw=0)
            ax.set_xlabel("gradient steps")
            ax.set_ylabel(label)
            ax.set_title(f"N = {n}", fontsize=9)
            ax.grid(True, alpha=0.3)
            if metric == "loss":
                ax.set_yscale("log")
        row[0].legend(fontsize=8)
    fig.suptitle(_title(df) + "\nline: mean over seeds; band: min to max over seeds", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def plot_lengths(f, df, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, g in f.groupby("attention", sort=True):
        axes[0].errorbar(g.max_len, g.eval_accuracy, yerr=g.get("eval_accuracy_std"), marker="o", capsize=3, label=name)
        line, = axes[1].plot(g.max_len, g.time_per_step_ms, marker="o", label=f"{name} (wall)")
        if g.cpu_time_per_step_ms.notna().any():
            axes[1].plot(g.max_len, g.cpu_time_per_step_ms, marker="s", ls="--", color=line.get_color(),
                         label=f"{name} (process CPU time)")
    axes[0].set_ylabel("final held-out copy accuracy")
    axes[1].set_ylabel("time per training step (ms)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_title(df), fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def aggregate(rows, out_dir) -> pd.DataFrame:
    """copy_curves.csv/.png (Figure 2), copy_final.csv and table.txt; with more than one N,
    also copy_lengths.png (accuracy and time per step against N). Rows carrying a `publish`
    folder are written there too."""
    df = pd.DataFrame(rows)
    c, f = curves(df), finals(df)
    text = f"{_title(df)}\n\n" + f.to_string(index=False, float_format=lambda v: f"{v:.4g}")
    print(text)
    for d in output_dirs(rows, out_dir, "copy_rows.jsonl"):
        atomic_write(d / "copy_curves.csv", c.to_csv(index=False))
        atomic_write(d / "copy_final.csv", f.to_csv(index=False))
        atomic_write(d / "table.txt", text + "\n")
        if not c.empty:  # a run that diverged before its first logged row has no curve
            plot_curves(c, df, d / "copy_curves.png")
        if df.max_len.nunique() > 1:
            plot_lengths(f, df, d / "copy_lengths.png")
    return f
