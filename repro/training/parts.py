"""The parts the training loop (repro.training.trainer.Trainer, behind repro.training.loop.fit)
is built from: the trainer config's checks, precision, seeding, moving batches to the device,
torch.compile, held-out evaluation, and the small helpers its rows use."""
import math
import random
import statistics
from contextlib import contextmanager, suppress

import numpy as np
import torch
from omegaconf import OmegaConf

from repro.common.errors import ConfigError
from repro.training import distributed as ddp

PRECISIONS = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
TIME_LIMIT = "stopped: time limit"  # the final row's status when trainer.max_time_s ended the run
WARMUP_STEPS = 3  # first steps of a process, left out of time_per_step (allocations, lazy init)


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds CUDA too


def to_device(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def tensors_of(batch):
    """The tensors of a batch as to_device walks it (a tensor, or dicts, lists and tuples of them), in order."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from tensors_of(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from tensors_of(v)


def validate(t):
    """Every trainer key fit() reads, checked: one line naming a bad value and what is valid."""
    for key in ("max_steps", "log_every"):
        if not isinstance(t[key], int) or t[key] < 1:
            raise ConfigError(f"trainer.{key} must be a positive integer; got {t[key]!r}")
    for key in ("eval_every", "checkpoint_every"):
        if t[key] is not None and (not isinstance(t[key], int) or t[key] < 0):
            raise ConfigError(f"trainer.{key} must be a non-negative integer or null; got {t[key]!r}")
    if t.eval_batches is not None and (not isinstance(t.eval_batches, int) or t.eval_batches < 1):
        # 0 batches is an evaluation of nothing: a NaN loss reported as a result
        raise ConfigError(f"trainer.eval_batches must be a positive integer (the held-out batches of every "
                          f"evaluation); got {t.eval_batches!r} (to evaluate never, set trainer.eval_every=0)")
    limit = t.max_time_s
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                              or not math.isfinite(limit) or limit <= 0):
        raise ConfigError(f"trainer.max_time_s must be a positive number of seconds or null; got {limit!r}")
    if t.precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision={t.precision!r}; valid: {', '.join(PRECISIONS)}")
    if t.grad_clip is not None and not (isinstance(t.grad_clip, (int, float)) and 0 < t.grad_clip < math.inf):
        raise ConfigError(f"trainer.grad_clip must be positive or null; got {t.grad_clip!r}")
    lr = (t.get("optimizer") or {}).get("lr")
    if lr is not None and not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr < math.inf):
        raise ConfigError(f"trainer.optimizer.lr must be a positive number; got {lr!r}")
    if t.compile not in (True, False):
        raise ConfigError(f"trainer.compile must be true or false; got {t.compile!r}")
    backend = t.compile_backend
    if t.compile and backend not in (valid := compile_backends()):
        raise ConfigError(f"trainer.compile_backend={backend!r}; valid: {', '.join(valid)}")


def compile_backends() -> list[str]:
    """The torch.compile backends this install has, sorted (for config checks)."""
    import torch._dynamo
    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def compile_model(module, backend: str = "inductor", **kwargs):
    """torch.compile(module) with the backend named in the config (dynamic shapes left to torch)."""
    return torch.compile(module, backend=backend, **kwargs)


def mean(values):
    return float(sum(values) / len(values)) if values else float("nan")


@contextmanager
def held_out(model, device):
    """Eval mode and no grad, under a forked RNG, so evaluating (or not) leaves the training
    stream unchanged; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            yield
    finally:
        model.train(was_training)


def evaluate(model, loss_fn, batches, device, autocast) -> dict:
    """Mean loss and metrics over the held-out batches (under held_out). Under DDP each rank
    scores its slice of each batch (the whole batch when it does not split evenly) and the means
    are averaged."""
    sums, count = {}, 0
    with held_out(model, device):
        for batch in batches:
            if ddp.is_distributed():
                with suppress(ConfigError):  # uneven: every rank scores the whole batch, the same mean
                    batch = ddp.shard(batch, ddp.rank(), ddp.world_size())
            with autocast():
                loss, metrics = loss_fn(model, to_device(batch, device))
            for k, v in {"loss": loss, **metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            count += 1
    out = {k: v / count for k, v in sums.items()} if count else {}
    return dict(zip(out, ddp.mean_across_ranks(list(out.values()))))


def run_hook(hook, model, step, device) -> dict:
    with held_out(model, device):
        return hook(model, step) or {}


def step_timing(step_times, cpu_times, trained: int, before: dict) -> dict:
    """The final row's step times in ms (the median and mean wall time, the median CPU time of all
    the process's threads, which other processes' load barely moves), WARMUP_STEPS left out, from
    this process's steps; where it trained none (a resume of a finished or timed-out run), `before`:
    those its checkpoint kept from the process that wrote it, so a resume does not lose them. (A
    process that trained steps but timed none, stopped before its first sync point, has none.)"""
    timed, cpu = step_times[WARMUP_STEPS:] or step_times, cpu_times[WARMUP_STEPS:] or cpu_times
    if not timed:
        return {"time_per_step_ms": None, "time_per_step_mean_ms": None, "cpu_time_per_step_ms": None,
                **({} if trained else before)}
    return {"time_per_step_ms": 1e3 * statistics.median(timed), "time_per_step_mean_ms": 1e3 * mean(timed),
            "cpu_time_per_step_ms": 1e3 * statistics.median(cpu) if cpu else None}


def step_time_text(final: dict) -> str:
    """The final row's step times for the line a task prints: the mean (steps x mean is the
    training's wall time, other processes' load included) and the median (a typical step)."""
    if not final.get("time_per_step_mean_ms"):
        return "no steps trained in this process"
    text = f"step time mean {final['time_per_step_mean_ms']:.1f} ms (median {final['time_per_step_ms']:.1f} ms)"
    if final.get("steps_this_process") == 0:  # carried from the checkpoint (step_timing)
        return f"no steps trained in this process; {text} in the one that wrote its checkpoint"
    return text


def rows_last(rows, kind, key):
    return next((r[key] for r in reversed(rows) if r["kind"] == kind and key in r), None)


# What a resume may change: how long and how far it trains, what it logs, evaluates and writes
# where (its own run dir included), and the hardware it runs on. Every other setting (the seed,
# the task's data and sizes, the model, the attention, the optimizer and its schedule, precision,
# gradient clipping) is the run's own, and a checkpoint resumes only a run that has them all as
# they were.
MAY_CHANGE_ON_RESUME = ("trainer.max_steps", "trainer.max_time_s", "trainer.log_every", "trainer.eval_every",
                        "trainer.eval_batches", "trainer.checkpoint", "trainer.checkpoint_every", "trainer.resume",
                        "trainer.progress", "trainer.threads", "trainer.compile", "trainer.compile_backend",
                        "task.label", "task.publish", "task.publish_replace", "task.out_dir", "run_dir", "logger",
                        "device", "hydra")


def default_fingerprint(cfg) -> dict:
    """Every setting of the run, flattened (`trainer.optimizer.lr`), but MAY_CHANGE_ON_RESUME."""
    def flat(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from flat(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            yield prefix, node

    container = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                 for k, v in cfg.items() if k != "hydra"}  # each node resolved against the whole config
    return {k: v for k, v in flat(container, "")
            if not any(k == m or k.startswith(m + ".") for m in MAY_CHANGE_ON_RESUME)}
