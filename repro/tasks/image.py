"""task=mnist / task=cifar: the paper's autoregressive image generation (Section 4.2).

Images are sequences of 8-bit sub-pixels (repro.models.pixels: channels interleaved, the first
value input only), the output at each position a mixture of 10 discretized logistics for the
next value. Training minimises the negative log-likelihood in nats per predicted value; the
rows report bits/dim exactly as the paper: NLL / (ln 2 * predicted values), 783 per MNIST image,
3071 per CIFAR-10 image.

One run trains one attention through the shared loop (repro.training.fit: checkpoints, resume,
bf16). Each evaluation also samples a grid of images, unconditional and completing the top half
of held-out images, through the attention's recurrent form (RNN state for linear attention,
key/value cache for softmax) or, for attentions without one (LSH), by re-running the prefix;
the grid goes to <run dir>/samples/ and to the logger. task.mode=sample draws a grid from a
trained checkpoint instead of training. A multirun ends in aggregate(): bits/dim curves per
attention (CSV, PNG) and a table beside the paper's numbers; so does a single run that ended, at
trainer.max_steps or at the time limit trainer.max_time_s (a planned end, with its evaluation),
but not one stopped by a signal (not ended: resumed later, it writes the summary then).
"""
import io
import math
import time

import pandas as pd
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

from repro.attention.base import is_recurrent
from repro.common import paper
from repro.common.config import parse_device
from repro.common.errors import ConfigError, building_from_config
from repro.common.results import atomic_write, output_dirs, provenance, save_figure, write_jsonl
from repro.conf import group_options, in_multirun
from repro.conf import run_dir as get_run_dir
from repro.conf.attention import attention_config, attention_name, user_set
from repro.data import ShuffledBatches
from repro.data.images import Images, load_images, resize
from repro.models import logistic_mixture as dmol
from repro.models.generate import generate
from repro.models.pixels import PixelTransformer, to_images, to_sequence
from repro.models.transformer import TransformerLayer
from repro.training import fit, load_checkpoint, seed_everything
from repro.training.checkpoint import load_into, require
from repro.training.distributed import is_main
from repro.training.loop import step_time_text
from repro.training.rows import read_rows

MODES = ("train", "sample")


def image_loss(model, batch):
    """NLL in nats per predicted value (the training loss) and bits/dim. batch: (B, C, H, W) uint8."""
    seq = to_sequence(batch)                         # (B, L)
    nll = model.nll(seq)                             # (B,) nats summed over the L - 1 predictions
    loss = nll.sum() / (nll.numel() * (seq.shape[1] - 1))
    return loss, {"bits_per_dim": (loss / math.log(2.0)).detach()}


def build_model(cfg, n_layers=None):
    m = OmegaConf.to_container(cfg.model, resolve=True)
    m["n_layers"] = n_layers or cfg.task.get("n_layers") or m["n_layers"]
    with building_from_config():
        return PixelTransformer(instantiate(cfg.attention), n_mixtures=cfg.task.n_mixtures, **m)


def sampling_mode(model) -> str:
    """recurrent when every layer's attention has a recurrent twin, else rerun (LSH, or a user's
    plain nn.Module without a step)."""
    recurrent = all(is_recurrent(m.attention) for m in model.modules() if isinstance(m, TransformerLayer))
    return "recurrent" if recurrent else "rerun"


@torch.no_grad()
def sample_grid(model, shape, n, given, seed, path):
    """Samples n images unconditionally and n completing the top half of `given` (n, C, H, W),
    saves [unconditional; conditional; originals] as one PNG at path. Returns the seconds taken
    and the mode used."""
    from torchvision.utils import save_image

    device = next(model.parameters()).device
    c, h, w = shape
    length, half = c * h * w, (h // 2) * w * c
    g = torch.Generator(device=device).manual_seed(seed)
    mode = sampling_mode(model)
    sample_fn = lambda y: dmol.sample(y, generator=g)
    given = given[:n].to(device)
    began = time.perf_counter()
    # The first value is input only (never modelled): take it from held-out images, shuffled.
    first = to_sequence(given)[torch.randperm(n, generator=g, device=device), :1]
    free = generate(model, first, length, sample_fn, mode=mode)
    cond = generate(model, to_sequence(given)[:, :half], length, sample_fn, mode=mode)
    seconds = time.perf_counter() - began
    grid = torch.cat([to_images(free, shape), to_images(cond, shape), given.to(torch.uint8)]).float() / 255.0
    buf = io.BytesIO()
    save_image(grid, buf, nrow=n, padding=1, pad_value=1.0, format="png")
    atomic_write(path, buf.getvalue())
    return seconds, mode, free, cond


def _identity(cfg, name, splits, shape):
    m, t = cfg.model, cfg.task
    return {"task": "image", "dataset": t.dataset, "attention": name, "target": cfg.attention._target_,
            "attention_settings": attention_settings(cfg), "seed": cfg.seed, "image_shape": list(shape),
            "predicted_dims": math.prod(shape) - 1,
            "data_source": splits.source, "n_train": len(splits.train), "n_test": len(splits.test),
            "batch_size": train_batch_size(cfg, name), "n_layers": t.get("n_layers") or m.n_layers,
            "d_model": m.d_model, "n_heads": m.n_heads, "d_ff": m.d_ff, "dropout": m.dropout,
            "max_steps": cfg.trainer.max_steps, "label": t.label, "publish": t.publish,
                "publish_replace": bool(t.get("publish_replace"))}


def train_batch_size(cfg, name) -> int:
    """The training batch of attention `name`: task.batch_size_by_attention[name] where set (the
    paper trained CIFAR-10's softmax at batch 1, the others at 4), else task.batch_size. The
    held-out batches keep task.batch_size: every attention is evaluated on the same images."""
    return int((cfg.task.get("batch_size_by_attention") or {}).get(name, cfg.task.batch_size))


def held_out_batches(cfg, test) -> list:
    """The first task.eval_batch_size (default task.batch_size) x trainer.eval_batches test images,
    in equal batches: an evaluation averages its batches' means, so a short last batch would weigh
    its images more. A remainder is left out (rows record n_eval) unless it is all there is."""
    size = cfg.task.get("eval_batch_size") or cfg.task.batch_size
    n = min(len(test), size * cfg.trainer.eval_batches)
    n = n - n % size if n >= size else n
    return [test[i:i + size] for i in range(0, n, size)]


def with_attention_settings(cfg, name):
    """The task's per-attention settings (the paper's LSH chunk per image size), except those the
    user set: attention.chunk_size=... on the command line wins over task.attention_settings."""
    chosen = (cfg.task.get("attention_settings") or {}).get(name) or {}
    chosen = {k: v for k, v in chosen.items() if k not in user_set(cfg, name)} if chosen else {}
    if chosen:
        cfg = cfg.copy()
        with open_dict(cfg):
            for k, v in chosen.items():
                cfg.attention[k] = v
    return cfg


def attention_settings(cfg) -> dict:
    """What the rows record of the attention: every setting it was built with."""
    return {k: v for k, v in OmegaConf.to_container(cfg.attention, resolve=True).items() if k != "_partial_"}


def _data(cfg):
    t = cfg.task
    splits = load_images(t.dataset, t.data_dir, t.source, t.download)
    splits.train, splits.test = resize(splits.train, t.resize), resize(splits.test, t.resize)
    if t.get("max_train"):
        splits.train = splits.train[: t.max_train]
    return splits


def run(cfg) -> float:
    t = cfg.task
    if t.mode not in MODES:
        raise ConfigError(f"task.mode={t.mode!r}; valid: {', '.join(MODES)}")
    if t.mode == "sample":
        return sample_from_checkpoint(cfg)
    name = attention_name(cfg)
    cfg = with_attention_settings(cfg, name)
    out = get_run_dir(cfg)
    seed_everything(cfg.seed)
    splits = _data(cfg)
    shape = splits.shape
    try:
        train = ShuffledBatches(Images(splits.train), train_batch_size(cfg, name), seed=cfg.seed)
    except ValueError as err:
        raise ConfigError(f"task.{err}") from err
    held_out = held_out_batches(cfg, splits.test)
    model = build_model(cfg)
    identity = {**_identity(cfg, name, splits, shape), "n_eval": sum(len(b) for b in held_out)}

    def hook(model, step):
        if not t.n_samples:
            return {}
        path = out / "samples" / f"step{step:08d}.png"
        seconds, mode, _, _ = sample_grid(model, shape, t.n_samples, splits.test[: t.n_samples], cfg.seed + step, path)
        return {"samples": path, "sample_seconds": seconds, "sampling_mode": mode}

    print(f"{t.dataset} {shape} from {splits.source}: {len(splits.train)} train / {len(splits.test)} test images")
    final = fit(model, image_loss, train, cfg, run_dir=out, eval_data=lambda: held_out, identity=identity,
                eval_hook=hook)
    bpd = final.get("eval_bits_per_dim", float("nan"))
    print(f"{t.dataset} {name} seed={cfg.seed}: {final['status']}, step {final['steps']}, "
          f"eval bits/dim {bpd:.4f}, {step_time_text(final)}")
    if is_main() and not in_multirun():
        aggregate(read_rows(out / "results.jsonl"), out)
    return float(bpd)


def sample_from_checkpoint(cfg) -> float:
    """task.mode=sample task.checkpoint=<run dir or file>: the model's sizes and the data settings
    come from the checkpoint's own config (plain values); the code that builds the model (every
    `_target_`) from this run's: the attention composed now must be the one it was trained with
    (trained_config). Writes samples.png and a row with the timing."""
    t = cfg.task
    if not t.get("checkpoint"):
        raise ConfigError("task.mode=sample needs task.checkpoint=<a training run dir or checkpoint file>")
    ckpt = load_checkpoint(t.checkpoint, option="task.checkpoint")
    require(ckpt, "config", "model", "step")
    trained = trained_config(ckpt["config"], cfg)
    with open_dict(trained):
        trained.device = cfg.device
        trained.task.data_dir, trained.task.download = t.data_dir, t.download
    device = parse_device(cfg.device)
    model = build_model(trained).to(device).eval()
    load_into(ckpt, "model", model)
    splits = _data(trained)
    out = get_run_dir(cfg)
    n = t.n_samples or 8
    seconds, mode, _, _ = sample_grid(model, splits.shape, n, splits.test[:n], cfg.seed, out / "samples.png")
    row = {"task": "image", "kind": "sample", "dataset": trained.task.dataset, "checkpoint": str(ckpt["path"]),
           "step": ckpt["step"], "n_samples": n, "sampling_mode": mode, "sample_seconds": seconds,
           "seconds_per_image": seconds / (2 * n), "image_shape": list(splits.shape), "seed": cfg.seed,
           "status": "ok", **provenance(device)}
    write_jsonl(out / "results.jsonl", [row])
    print(f"{2 * n} images ({n} unconditional, {n} completing a top half) by {mode} sampling in {seconds:.1f} s "
          f"-> {out / 'samples.png'}")
    return seconds


def _targets(node, prefix):
    """{dotted path of a `_target_`: its value} over a plain config node (dicts and lists)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    out = {}
    for k, v in items:
        path = f"{prefix}.{k}"
        out.update({path: v} if k == "_target_" else _targets(v, path))
    return out


def trained_config(saved, cfg):
    """The checkpoint's saved config, as data: its model and attention settings build the model,
    but only with the classes this run composes (conf/attention, the command line), never with a
    `_target_` the file names. Any `_target_` that differs from this run's is refused in one line
    naming both."""
    t = cfg.task
    if not (isinstance(saved, dict) and all(isinstance(saved.get(k), dict) for k in ("task", "model", "attention"))):
        raise ConfigError(f"task.checkpoint={t.checkpoint}: its config holds no task, model and attention "
                          "settings: not a checkpoint of a training run")
    if saved["task"].get("_target_") != cfg.task._target_:
        raise ConfigError(f"task.checkpoint={t.checkpoint}: not an image-task checkpoint "
                          f"(task {saved['task'].get('name')!r})")
    for node in ("attention", "model"):
        then = _targets(saved[node], node)
        now = _targets(OmegaConf.to_container(cfg[node], resolve=True) if cfg.get(node) is not None else {}, node)
        for path in sorted(set(then) | set(now)):
            if then.get(path) != now.get(path):
                hint = f" (conf/attention: {_entries_of(then.get(path))})" if path == "attention._target_" else ""
                raise ConfigError(f"task.checkpoint={t.checkpoint} was trained with {path}={then.get(path)!r}, "
                                  f"this run composes {path}={now.get(path)!r}: a model is built from this suite's "
                                  f"configs and the command line, never from a checkpoint's; give the settings it "
                                  f"was trained with{hint}")
    return OmegaConf.create(saved)


def _entries_of(target) -> str:
    """The conf/attention entries that build `target`, for the hint of a refusal."""
    names = [n for n in group_options("attention") if attention_config(n).get("_target_") == target]
    return f"attention={' or attention='.join(names)}" if names else "no entry builds it"


# ----------------------------------------------------------------------------- aggregation

def curves(df) -> pd.DataFrame:
    parts = []
    for kind in ("train", "eval"):
        sub = df[(df.kind == kind) & df.bits_per_dim.notna()] if "bits_per_dim" in df else df.iloc[:0]
        if len(sub):
            g = sub.groupby(["dataset", "attention", "step"], sort=False).bits_per_dim
            parts.append(g.agg(["mean", "min", "max", "count"]).reset_index().rename(columns={"count": "n_seeds"})
                         .assign(kind=kind))
    cols = ["dataset", "attention", "kind", "step", "mean", "min", "max", "n_seeds"]
    return (pd.concat(parts)[cols].sort_values(["dataset", "attention", "kind", "step"]) if parts
            else pd.DataFrame(columns=cols))


def finals(df) -> pd.DataFrame:
    g = df[df.kind == "final"].groupby(["dataset", "attention"])
    out = pd.DataFrame({
        "n_seeds": g.seed.nunique(), "steps": g.steps.max(),
        "eval_bits_per_dim": g.eval_bits_per_dim.mean() if "eval_bits_per_dim" in df else float("nan"),
        "train_loss_nats": g.train_loss.mean(), "time_per_step_ms": g.time_per_step_ms.mean(),
        "status": g.status.agg(lambda s: ",".join(sorted(set(s)))),
    }).reset_index()
    out["paper_bits_per_dim"] = [paper.paper_bits_per_dim(d, a) for d, a in zip(out.dataset, out.attention)]
    return out


def plot_curves(c, df, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for (name, kind), g in c.groupby(["attention", "kind"], sort=True):
        ax.plot(g.step, g["mean"], marker="o" if kind == "eval" else None, ls="-" if kind == "eval" else ":",
                label=f"{name} ({'held-out' if kind == 'eval' else 'training'})")
    ax.set_xlabel("gradient steps")
    ax.set_ylabel("bits/dim")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    r = df.iloc[0]
    label = f"{r['label']}\n" if r.get("label") else ""
    ax.set_title(f"{label}{r.dataset} {tuple(r.image_shape)} from {r.data_source}\n{r.n_layers} layers, d_model "
                 f"{r.d_model}, {r.n_heads} heads, batch {r.batch_size}, {r.precision}, {r.device}", fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def aggregate(rows, out_dir) -> pd.DataFrame:
    """bpd_curves.csv/.png and table.txt (final held-out bits/dim beside the paper's); rows with
    a `publish` folder are also written there, raw rows included."""
    df = pd.DataFrame([r for r in rows if r.get("kind") in ("train", "eval", "final")])
    c, f = curves(df), finals(df)
    text = f.to_string(index=False, float_format=lambda v: f"{v:.4g}")
    print(text)
    for d in output_dirs(rows, out_dir, "image_rows.jsonl"):
        atomic_write(d / "bpd_curves.csv", c.to_csv(index=False))
        atomic_write(d / "bpd_final.csv", f.to_csv(index=False))
        atomic_write(d / "table.txt", text + "\n")
        if len(c):
            plot_curves(c, df, d / "bpd_curves.png")
    return f
