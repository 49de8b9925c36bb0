"""Memory of whole models in training: one step (forward, backward, optimizer) of the copy and
MNIST models at the sizes of their presets (the smoke runs and the CPU claim runs), each
attention in a fresh process, rounds interleaved (every attention of every preset once, then
again), so the machine's drift falls on all of them alike.

    python -m repro.reproduction.model_memory --out results/memory/models_cpu
    python -m repro.reproduction.model_memory --presets smoke_copy --attentions softmax,linear --rounds 3

Per (preset, attention): what the step keeps for backward (exact: saved tensors' storages,
repro.training.memory), the peak of bytes torch's allocator held during the step above what it
held before (exact, one thread: the profiler's record of every allocation) and its peak resident
memory above what was live before it (median, min and max over the rounds; glibc's mmap threshold
lowered and VmHWM reset, as the benchmark does), written as rows to model_memory.csv under --out,
atomically, with the command in command.txt."""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

PRESETS = ("smoke_copy", "copy_claims_n128_cpu", "smoke_mnist", "mnist_claims_seeds_cpu")


def _batch_and_loss(cfg):
    """(model, batch, loss_fn) as the preset's task builds them; images are random (memory does
    not depend on their content)."""
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from repro.conf.attention import attention_name
    from repro.data import CopyTask
    from repro.models import AutoregressiveTransformer
    from repro.tasks import image
    from repro.tasks.copy import copy_loss

    t = cfg.task
    if t.name == "copy":
        data = CopyTask(t.batch_size, t.max_len, t.n_symbols, t.min_copy, t.max_copy, seed=0)
        model = AutoregressiveTransformer(instantiate(cfg.attention), n_tokens=data.vocab_size,
                                          **OmegaConf.to_container(cfg.model, resolve=True))
        return model, next(data), copy_loss, t.max_len
    cfg = image.with_attention_settings(cfg, attention_name(cfg))
    side = t.resize or 28
    batch = torch.randint(0, 256, (image.train_batch_size(cfg, attention_name(cfg)), 1, side, side),
                          dtype=torch.uint8)
    return image.build_model(cfg), batch, image.image_loss, side * side


def measure(preset: str, attention: str) -> dict:
    """One training step of `preset` with `attention`, in this process."""
    import torch
    from hydra import compose, initialize_config_dir

    from repro.conf import CONF_DIR
    from repro.tasks.benchmark_point import prepare_rss_measure, proc_status_kb
    from repro.training.memory import peak_allocated_bytes, saved_bytes
    from repro.training.optim import build_optimizer

    torch.manual_seed(0)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={preset}", f"attention={attention}"])
    model, batch, loss_fn, n = _batch_and_loss(cfg)
    optimizer = build_optimizer(cfg.trainer.optimizer, model)

    def step():
        loss, _ = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state and the allocator's first buffers exist before the measured step
    kept, (loss, _) = saved_bytes(loss_fn, model, batch)
    loss.backward()
    optimizer.zero_grad(set_to_none=True)
    del loss
    method = prepare_rss_measure()
    base = proc_status_kb("VmRSS") * 1024
    step()
    peak = proc_status_kb("VmHWM") * 1024 - base
    alloc, _ = peak_allocated_bytes(step)  # exact: the allocator's record (the C library's slack aside)
    return {"preset": preset, "task": cfg.task.name, "attention": attention, "n": n,
            "batch": int(batch["tokens"].shape[0] if isinstance(batch, dict) else batch.shape[0]),
            "n_params": sum(p.numel() for p in model.parameters()), "kept_mb": kept / 2**20,
            "peak_alloc_mb": alloc / 2**20, "peak_mb": peak / 2**20, "mem_method": method}


def run(presets, attentions, rounds: int, out: Path, threads: int):
    import torch

    from repro.common.results import atomic_write, provenance, rows_to_csv

    torch.set_num_threads(threads)  # the rows' device names the threads the points ran with

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    points = {}
    for r in range(rounds):
        for preset in presets:
            for att in attentions:
                proc = subprocess.run([sys.executable, "-m", "repro.reproduction.model_memory", "--point", preset, att],
                                      capture_output=True, text=True, env=env)
                if proc.returncode:
                    raise SystemExit(f"error: model_memory {preset} {att}: "
                                     f"{(proc.stderr.strip().splitlines() or ['exit ' + str(proc.returncode)])[-1]}")
                points.setdefault((preset, att), []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1}/{rounds} {preset} {att}: peak {points[(preset, att)][-1]['peak_mb']:.1f} MB",
                      flush=True)
    rows = []
    for found in points.values():
        peaks = [p["peak_mb"] for p in found]
        rows.append({**{k: v for k, v in found[0].items() if k != "peak_mb"}, "peak_mb": statistics.median(peaks),
                     "peak_min_mb": min(peaks), "peak_max_mb": max(peaks), "rounds": len(peaks), "threads": threads,
                     **provenance(torch.device("cpu"))})
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "model_memory.csv", rows_to_csv(rows))
    atomic_write(out / "command.txt", "python -m repro.reproduction.model_memory "
                 + " ".join(shlex.quote(a) for a in sys.argv[1:]) + "\n")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--attentions", default="softmax,linear")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("results/memory/models_cpu"))
    p.add_argument("--point", nargs=2, metavar=("PRESET", "ATTENTION"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.point:
        print(json.dumps(measure(*a.point)), flush=True)
        return
    if a.rounds < 1 or a.threads < 1:
        p.error(f"--rounds and --threads must be >= 1; got --rounds {a.rounds}, --threads {a.threads}")
    run(a.presets.split(","), a.attentions.split(","), a.rounds, a.out, a.threads)


if __name__ == "__main__":
    main()
