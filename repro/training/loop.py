"""fit(): the training loop of every training task.

The task builds the model, a loss function and the data; fit() does the rest:

    loss, metrics = loss_fn(model, batch)      # loss: scalar tensor; metrics: {name: scalar}
    train_data: an iterator of batches with state_dict() / load_state_dict() (the stream position;
                repro.data.CopyTask, or repro.data.ShuffledBatches over any map-style dataset)
    eval_data:  a callable returning an iterable of held-out batches (the same ones each call)
    eval_hook:  optional callable(model, step) -> {name: value}, run after each evaluation (in eval
                mode, no grad, RNG forked) and merged into its row: decoded error rates, sample
                grids written to disk (a value that is a pathlib.Path to a .png also goes to the
                logger's log_image, e.g. wandb). trainer.plateau_metric names the eval metric that a
                ReduceLROnPlateau schedule follows (default: loss).

Every trainer.log_every steps a "train" row (window means of loss and metrics), every
trainer.eval_every steps an "eval" row, at the end a "final" row go to <run dir>/results.jsonl
(each with the task's identity and repro.results.provenance) and to the logger.

Resume: trainer.resume=<run dir or checkpoint file> restores model, optimizer, scheduler,
step, data stream, every RNG state and the wandb run id; the run then goes on exactly as if never
stopped (tests/test_training.py checks the next losses are equal). Rows are appended to
results.jsonl one line at a time (repro.training.rows); the checkpoint records how many there
were, and a resume starts its results.jsonl with those rows from the checkpoint's run dir, so
the resumed run dir (a new one, or the same) holds the whole history and nothing after it.
SIGINT/SIGTERM (Ctrl-C, a SLURM pre-emption) stop the loop at the end of the current step; the
checkpoint and the final row are written, one line names the checkpoint and the command that
resumes it, and the process exits 130 (SIGINT) or 143 (SIGTERM) (repro.training.stopping).

Every row carries elapsed_s: the wall-clock seconds of training so far (steps, evaluations, rows
and checkpoints: everything from the start of the loop), continued across a resume (the
checkpoint holds it). trainer.max_time_s ends the run as trainer.max_steps does, once elapsed_s
passes it at the end of a step: a train row, an evaluation, the checkpoint, a final row with
status "stopped: time limit", one line saying how to train on, and fit() returns (exit status 0:
a planned end). Resuming with a larger trainer.max_time_s trains on.

DDP (repro.training.distributed): under torchrun, or SLURM with several tasks, fit() joins the
process group, wraps the model in DistributedDataParallel and gives each rank its slice of the
global batch (train_data yields global batches; a stream with its own `world_size` attribute,
e.g. ShuffledBatches(rank=, world_size=), is taken as already sharded). loss_fn then receives
the DDP wrapper: call model(...), not other methods of it, in the training loss. Train and eval
metrics are averaged over ranks; rank 0 alone writes rows, logs and checkpoints (the others
wait at a barrier). The losses equal a single process's on the same global batch when the
loss is a mean over equal shares (tests/test_distributed.py).

trainer.compile=true trains a torch.compile'd model (trainer.compile_backend: inductor, or
aot_eager / eager for a quick check); evaluation, eval_hook and checkpoints use the plain
module, so checkpoints stay interchangeable.
"""
import math
import os
import random
import statistics
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf, open_dict
from tqdm import tqdm

from ..config import ConfigError, parse_device
from ..logging import NullLogger, make_logger
from ..results import provenance
from . import distributed as ddp
from .checkpoint import LAST, check_fingerprint, check_run_dir, load_checkpoint, load_into, rng_state, save_checkpoint, set_rng_state
from .optim import build_optimizer, build_scheduler
from .rows import RowLog, resumed_history
from .stopping import exit_stopped, stop_on_signals, time_limit_line
from .threads import set_threads

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


def _validate(t):
    for key in ("max_steps", "log_every"):
        if not isinstance(t[key], int) or t[key] < 1:
            raise ConfigError(f"trainer.{key} must be a positive integer; got {t[key]!r}")
    for key in ("eval_every", "checkpoint_every", "eval_batches"):
        if t[key] is not None and (not isinstance(t[key], int) or t[key] < 0):
            raise ConfigError(f"trainer.{key} must be a non-negative integer or null; got {t[key]!r}")
    limit = t.max_time_s
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                              or not math.isfinite(limit) or limit <= 0):
        raise ConfigError(f"trainer.max_time_s must be a positive number of seconds or null; got {limit!r}")
    if t.precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision={t.precision!r}; valid: {', '.join(PRECISIONS)}")
    if t.grad_clip is not None and t.grad_clip <= 0:
        raise ConfigError(f"trainer.grad_clip must be positive or null; got {t.grad_clip!r}")
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


def compile_step(model, backend: str = "inductor"):
    """Compile a model's recurrent `step` in place (repro.models.generate then samples through
    the compiled step). dynamic=True keeps the position symbolic, so the step is one graph for
    every position (softmax's key/value cache compiles again each time it doubles: give it room
    for the whole sequence with its initial_cache). The tokens are made contiguous
    first: generation passes a column of its (B, length) buffer, whose stride would otherwise be
    a guard, and a generation of another length a recompilation. Returns the model."""
    compiled = torch.compile(type(model).step.__get__(model), backend=backend, dynamic=True)
    model.step = lambda tokens, state=None: compiled(tokens.contiguous(), state)
    return model


def _mean(values):
    return float(sum(values) / len(values)) if values else float("nan")


@contextmanager
def _held_out(model, device):
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
    """Mean loss and metrics over the held-out batches (under _held_out). Under DDP each rank
    scores its slice of each batch (the whole batch when it does not split evenly) and the means
    are averaged."""
    sums, count = {}, 0
    with _held_out(model, device):
        for batch in batches:
            if ddp.is_distributed():
                try:
                    batch = ddp.shard(batch, ddp.rank(), ddp.world_size())
                except ConfigError:
                    pass  # uneven: every rank scores the whole batch, the mean is the same
            with autocast():
                loss, metrics = loss_fn(model, to_device(batch, device))
            for k, v in {"loss": loss, **metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            count += 1
    out = {k: v / count for k, v in sums.items()} if count else {}
    return dict(zip(out, ddp.mean_across_ranks(list(out.values()))))


def _run_hook(hook, model, step, device) -> dict:
    with _held_out(model, device):
        return hook(model, step) or {}


def fit(model, loss_fn, train_data, cfg, *, run_dir, eval_data=None, identity=None, fingerprint=None,
        eval_hook=None) -> dict:
    """Train `model` per cfg.trainer; returns the final row (also written to results.jsonl).

    identity: what every row carries to say which run it is (task, attention, sizes, seed).
    fingerprint: what a checkpoint must match to be resumed here (default: cfg.model and
    cfg.attention and the task's name).
    """
    t = cfg.trainer
    _validate(t)
    run_dir, device = Path(run_dir), parse_device(cfg.device)
    check_run_dir(run_dir, t.resume)
    set_threads(t.threads, device)
    distributed = ddp.init()
    rank, world = ddp.rank(), ddp.world_size()
    main = rank == 0
    if distributed and device.type == "cuda":
        device = torch.device("cuda", ddp.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if distributed and getattr(train_data, "world_size", 1) == 1:
        train_data = ddp.RankShard(train_data, rank, world)
    identity = dict(identity or {})
    fingerprint = fingerprint or _fingerprint(cfg)
    dtype = PRECISIONS[t.precision]
    if dtype is torch.float16 and device.type == "cpu":
        raise ConfigError("trainer.precision=float16 needs a GPU; on CPU use bfloat16 or float32")

    def autocast():
        return torch.autocast(device.type, dtype=dtype) if dtype else nullcontext()

    model.to(device).train()
    train_model = model  # what the training loss calls: DDP and/or compiled around `model`
    if distributed:
        from torch.nn.parallel import DistributedDataParallel

        train_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if t.compile:
        train_model = compile_model(train_model, t.compile_backend)
    optimizer = build_optimizer(t.optimizer, model)
    scheduler = build_scheduler(t.scheduler, optimizer)
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)

    step, history, logger_id, window, last_eval = 0, [], None, {}, {}
    elapsed_before = 0.0  # seconds of training in the processes before this one (from the checkpoint)
    max_time = t.max_time_s
    if t.resume:
        ckpt = load_checkpoint(t.resume)
        check_fingerprint(ckpt, fingerprint)
        for name, obj in [("model", model), ("optimizer", optimizer), ("data", train_data)] + \
                         ([("scheduler", scheduler)] if scheduler is not None else []):
            load_into(ckpt, name, obj)
        step, history, logger_id = ckpt["step"], resumed_history(ckpt), ckpt.get("logger_run_id")
        window = ckpt.get("window") or {}  # the steps since the last train row, which it will average
        last_eval = ckpt.get("last_eval") or {}  # what the final row reports until the next evaluation
        elapsed_before = float(ckpt.get("elapsed_s", 0.0))  # (checkpoints older than elapsed_s: from 0)
        if step > t.max_steps:
            raise ConfigError(f"trainer.max_steps={t.max_steps} is below the step of the checkpoint it resumes "
                              f"({ckpt['path']} is at step {step}): set trainer.max_steps={step} or more")
        if step == t.max_steps:
            print(f"{ckpt['path']} is at step {step} = trainer.max_steps: the run is finished, nothing to train "
                  f"(set trainer.max_steps above {step} to train on)")
        else:
            print(f"resumed from {ckpt['path']} at step {step}")
    if logger_id and cfg.logger.get("run_id") is None:
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.logger.run_id = logger_id  # wandb continues the same run (other loggers ignore it)
    rng = ckpt["rng"] if t.resume else rng_state()
    per_rank_rng = t.resume and len(ckpt.get("rng_ranks") or []) == world  # saved by this many ranks
    if per_rank_rng:
        rng = ckpt["rng_ranks"][rank]
    logger = make_logger(cfg, run_dir) if main else NullLogger(run_dir)
    set_rng_state(rng)  # whatever the logger drew, training starts from the seeded (or saved) state
    if distributed and rank > 0 and not per_rank_rng:
        torch.manual_seed(torch.initial_seed() + rank)  # each rank its own dropout masks
    meta = provenance(device)
    identity.update(precision=t.precision, device_type=device.type)

    # results.jsonl: the resumed history, then one appended line per row (rank 0 writes)
    rows = RowLog(run_dir / "results.jsonl", history, write=main)
    last_train_loss = rows_last(history, "train", "loss")

    def elapsed():  # this run's training seconds so far, earlier processes included
        return elapsed_before + time.perf_counter() - began

    def emit(kind, metrics):
        nonlocal last_train_loss
        row = {**identity, "kind": kind, "step": step, "elapsed_s": elapsed(), **metrics, **meta}
        rows.append(row)
        if kind == "train":
            last_train_loss = row.get("loss")
        logger.log({f"{kind}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        return row

    def checkpoint():
        rngs = ddp.all_gather_object(rng_state()) if distributed else None  # a collective: every rank
        if main:
            rows.sync()
            save_checkpoint(run_dir / LAST, {
                "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "data": train_data.state_dict(), "rng": rng_state(),
                "rows_written": len(rows),  # the rows so far live in results.jsonl, not here
                "window": window, "last_eval": last_eval,
                "elapsed_s": elapsed(),  # a resume's clock starts here, so elapsed_s runs on across processes
                **({"rng_ranks": rngs, "world_size": world} if distributed else {}),
                "fingerprint": fingerprint, "logger_run_id": getattr(getattr(logger, "run", None), "id", None),
                "config": OmegaConf.to_container(cfg, resolve=True)})
        ddp.barrier()  # nobody runs ahead of (or exits before) the file on disk

    def run_eval():
        if eval_data is None or not t.eval_batches:
            return {}
        out = evaluate(model, loss_fn, eval_data(), device, autocast)
        if eval_hook is not None:  # rank 0's (it may write files); the others get its numbers
            extra = {}
            if main:
                for k, v in _run_hook(eval_hook, model, step, device).items():
                    if isinstance(v, Path) and v.suffix == ".png":  # a sample grid: to wandb too
                        logger.log_image(f"eval/{k}", v)
                        v = str(v)
                    extra[k] = v
            out.update(ddp.broadcast_object(extra if main else None))
        if plateau:
            metric = t.plateau_metric or "loss"
            if metric not in out:
                raise ConfigError(f"trainer.plateau_metric={metric!r} is not an eval metric; valid: {', '.join(out)}")
            scheduler.step(out[metric])
        emit("eval", out)
        return out

    step_times, cpu_times, status = [], [], "ok"
    load_start = os.getloadavg()[0]
    began = time.perf_counter()  # elapsed_s counts from here (on top of elapsed_before)
    out_of_time = max_time is not None and elapsed_before >= max_time  # a resumed run that had used it all
    bar = tqdm(total=t.max_steps, initial=step, desc=identity.get("task", "train"), unit="step",
               dynamic_ncols=True, disable=not t.progress or not main)
    with stop_on_signals() as stop:
        while step < t.max_steps and not out_of_time:
            t0, c0 = time.perf_counter(), time.process_time()
            batch = to_device(next(train_data), device)
            try:
                with autocast():
                    loss, metrics = loss_fn(train_model, batch)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or math.inf)
                scaler.step(optimizer)
                scaler.update()
            except torch.OutOfMemoryError as err:
                status = f"oom: {str(err).splitlines()[0][:160]}"
                break
            if scheduler is not None and not plateau:
                scheduler.step()
            loss_value = loss.item()  # syncs the device, so the step time below is real
            out_of_time = max_time is not None and elapsed() > max_time  # the clock read once a step, no sync
            if distributed:  # every rank logs, and stops, on the same numbers
                names = list(metrics)
                loss_value, *values, stopped, late = ddp.mean_across_ranks(
                    [loss_value, *(float(metrics[k]) for k in names), float(bool(stop)), float(out_of_time)])
                metrics = dict(zip(names, values))
                if stopped and not stop:
                    stop.append(None)  # another rank was signalled: finish together
                out_of_time = late > 0  # one rank's clock past the limit: all end at this step
            step += 1
            step_times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
            if not math.isfinite(loss_value):
                status = f"error: non-finite loss {loss_value} at step {step}"
                break
            for k, v in {"loss": loss_value, "grad_norm": float(grad_norm), **metrics}.items():
                window.setdefault(k, []).append(float(v))
            bar.update(1)
            end = step == t.max_steps or out_of_time  # planned ends: a train row and an evaluation at this step
            if step % t.log_every == 0 or end:
                logged = {k: _mean(v) for k, v in window.items()}
                emit("train", {**logged, "lr": optimizer.param_groups[0]["lr"]})
                bar.set_postfix(loss=f"{logged['loss']:.4f}")
                window.clear()  # (in place: checkpoint() saves this dict)
            if t.eval_every and (step % t.eval_every == 0 or end):
                last_eval = run_eval()
            if t.checkpoint and t.checkpoint_every and step % t.checkpoint_every == 0:
                checkpoint()
            if stop:
                status = f"stopped by signal at step {step}"
                break
    if out_of_time and status == "ok" and step < t.max_steps:  # (reaching both at once: max_steps, ok)
        status = TIME_LIMIT
    bar.close()
    if t.eval_every and not last_eval and status in ("ok", TIME_LIMIT) and step > 0:
        # a run that ended between evaluations (a stopped run is not ended: it evaluates at its
        # next eval step after the resume, as an uninterrupted run does, and logs no extra row)
        last_eval = run_eval()
    if t.checkpoint and not status.startswith(("oom", "error")):
        checkpoint()  # at exit: what a resume continues from
    timed = step_times[WARMUP_STEPS:] or step_times
    cpu = cpu_times[WARMUP_STEPS:] or cpu_times
    final = emit("final", {
        "status": status, "steps": step, "steps_this_process": len(step_times),
        "train_loss": last_train_loss,
        **{f"eval_{k}": v for k, v in last_eval.items()},
        "time_per_step_ms": 1e3 * statistics.median(timed) if timed else None,
        "time_per_step_mean_ms": 1e3 * _mean(timed) if timed else None,
        # this process's CPU time (all its threads): barely moved by other processes' load
        "cpu_time_per_step_ms": 1e3 * statistics.median(cpu) if cpu else None,
        "train_time_s": time.perf_counter() - began,
        "n_params": sum(p.numel() for p in model.parameters()),
        "loadavg_1min_start": load_start, "loadavg_1min_end": os.getloadavg()[0],
        "threads": torch.get_num_threads(), "world_size": world,
        **({"compile_backend": t.compile_backend} if t.compile else {})})
    rows.close()
    logger.finish()
    ddp.barrier()  # rank 0's rows are on disk before any rank goes on to read them
    if status == TIME_LIMIT and main:
        print(time_limit_line(max_time, step, final["elapsed_s"], run_dir, run_dir / LAST if t.checkpoint else None,
                              world), flush=True)
    # checkpoint and rows are written: one line, then exit 130/143 (a multirun stops too). Every
    # rank asks (a collective), in case a signal reached one rank after the last step.
    signals = [s for s in ddp.all_gather_object(stop[0] if stop else None) if s is not None]
    if signals:
        exit_stopped(signals[0], step, run_dir, run_dir / LAST if t.checkpoint else None, world, main)
    return final


def step_time_text(final: dict) -> str:
    """The final row's step times for the line a task prints: the mean (steps x mean is the
    training's wall time, other processes' load included) and the median (a typical step)."""
    if not final.get("time_per_step_mean_ms"):
        return "no steps trained in this process"
    return f"step time mean {final['time_per_step_mean_ms']:.1f} ms (median {final['time_per_step_ms']:.1f} ms)"


def rows_last(rows, kind, key):
    return next((r[key] for r in reversed(rows) if r["kind"] == kind and key in r), None)


def _fingerprint(cfg) -> dict:
    """Flattened model and attention settings and the task's name."""
    out = {"task": cfg.task.get("name")}
    for group in ("model", "attention"):
        node = cfg.get(group)
        if node is not None:
            for k, v in OmegaConf.to_container(node, resolve=True).items():
                out[f"{group}.{k}"] = v
    return out
