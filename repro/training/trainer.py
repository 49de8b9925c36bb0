"""Trainer: the state of one training run and its parts, one at a time (repro.training.loop.fit
states the contract; fit is `Trainer(...).run()`).

    __init__      set-up: the process group, the device, the model (DDP, compile), optimizer
    resume        trainer.resume: model, optimizer, scheduler, step, data stream, RNG, rows
    run           the loop: train_step every step; at a sync point, rows, evaluation, checkpoint
    train_step    one update (forward, backward, clip, step), nothing read back from the device
    evaluate      an "eval" row (and the plateau schedule's step)
    checkpoint    <run dir>/checkpoints/last.pt, atomically (rank 0; every rank's RNG)
    finish        the final row, the time-limit line, the exit on a signal

Device synchronisation: none in a plain step. The window (each step's loss, grad norm and
metrics since the last train row) holds device tensors; they are read back at a *sync point*:
a log step, an eval or checkpoint step, the end, a signal, and once after the first
WARMUP_STEPS steps of a process (so their times stay out of time_per_step). A sync point is
one device-to-host transfer of the window (and under DDP one all-reduce of it, so every rank
holds each step's rank mean, as the rows report). The step times are measured between sync
points, once the device has caught up, and shared among the steps between them (with
log_every=1, one step each, as a per-step timer would). A non-finite loss is found at the next
sync point, before anything is logged, evaluated or checkpointed from it.

Stopping needs no device: the signal flag and the clock (time.perf_counter, for
trainer.max_time_s) are read on the host every step. Under DDP the ranks must leave the loop at
the same step (a signal may reach one rank only, clocks differ, and a rank that stops early
leaves the others waiting in the next collective), so every step they agree with one all-reduce
of a CPU tensor, which goes over gloo (beside nccl on GPUs): a small host round trip, no sync of
the device's queue.
"""
import functools
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf, open_dict
from tqdm import tqdm

from repro.common.config import parse_device
from repro.common.errors import ConfigError
from repro.common.results import provenance
from repro.conf import in_multirun
from repro.training import distributed as ddp
from repro.training.backends import model_backend, note_fallback
from repro.training.checkpoint import (
    LAST,
    check_fingerprint,
    check_run_dir,
    load_checkpoint,
    load_into,
    require,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from repro.training.loggers import NullLogger, make_logger
from repro.training.optim import build_optimizer, build_scheduler
from repro.training.parts import (
    PRECISIONS,
    TIME_LIMIT,
    WARMUP_STEPS,
    compile_model,
    default_fingerprint,
    mean,
    rows_last,
    run_hook,
    step_timing,
    tensors_of,
    to_device,
    validate,
)
from repro.training.parts import evaluate as held_out_means
from repro.training.rows import RowLog, resumed_history
from repro.training.stopping import DIVERGED, exit_stopped, stop_on_signals, time_limit_line
from repro.training.threads import set_threads


class Trainer:
    def __init__(self, model, loss_fn, train_data, cfg, *, run_dir, eval_data=None, identity=None,
                 fingerprint=None, eval_hook=None):
        t = self.t = cfg.trainer
        validate(t)
        self.cfg, self.run_dir, self.device = cfg, Path(run_dir), parse_device(cfg.device)
        self.resume_from = t.resume
        if not t.resume and in_multirun() and (self.run_dir / LAST).is_file():
            # a sweep run again into its own dir (one that was interrupted, say): each job goes on
            # from its checkpoint (a finished one trains nothing; a changed config is refused)
            print(f"{self.run_dir}: this sweep job has a checkpoint; resuming it", flush=True)
            self.resume_from = str(self.run_dir)
        check_run_dir(self.run_dir, self.resume_from)
        set_threads(t.threads, self.device)
        self._join_processes()
        if self.distributed and getattr(train_data, "world_size", 1) == 1:
            train_data = ddp.RankShard(train_data, self.rank, self.world)
        self.model, self.loss_fn, self.train_data = model, loss_fn, train_data
        self.eval_data, self.eval_hook = eval_data, eval_hook
        self.identity = dict(identity or {})
        self.fingerprint = fingerprint or default_fingerprint(cfg)
        self.dtype = PRECISIONS[t.precision]
        if self.dtype is torch.float16 and self.device.type == "cpu":
            raise ConfigError("trainer.precision=float16 needs a GPU; on CPU use bfloat16 or float32")
        self._build()
        # what a checkpoint holds and a resume restores
        self.step, self.history, self.logger_id, self.window, self.last_eval = 0, [], None, {}, {}
        self.elapsed_before = 0.0  # seconds of training in the processes before this one
        self.timing_before = {}
        self.rng, self.per_rank_rng = None, False
        self.status, self.stop, self.step_times, self.cpu_times = "ok", [], [], []

    def _join_processes(self):
        """Under torchrun or SLURM: the process group, and this rank's GPU."""
        self.distributed = ddp.init()
        self.rank, self.world = ddp.rank(), ddp.world_size()
        self.main = self.rank == 0
        if self.distributed and self.device.type == "cuda":
            self.device = torch.device("cuda", ddp.local_rank() % torch.cuda.device_count())
            torch.cuda.set_device(self.device)

    def _build(self):
        """The model on its device; train_model, what the training loss calls (DDP and/or
        compiled around it); optimizer, schedule and gradient scaler."""
        t, model = self.t, self.model
        model.to(self.device).train()
        self.train_model = model
        if self.distributed:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.train_model = DistributedDataParallel(model, device_ids=ids)
        if t.compile:
            self.train_model = compile_model(self.train_model, t.compile_backend)
        self.optimizer = build_optimizer(t.optimizer, model)
        self.scheduler = build_scheduler(t.scheduler, self.optimizer)
        self.plateau = isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype is torch.float16)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype) if self.dtype else nullcontext()

    def resume(self):
        """Restore everything trainer.resume's checkpoint holds (nothing without one)."""
        t = self.t
        if not self.resume_from:
            self.rng = rng_state()
            return
        ckpt = load_checkpoint(self.resume_from)  # data only: tensors and plain values
        require(ckpt, "step", "model", "optimizer", "data", "rng", "fingerprint")
        check_fingerprint(ckpt, self.fingerprint)
        for name, obj in [("model", self.model), ("optimizer", self.optimizer), ("data", self.train_data)] + \
                         ([("scheduler", self.scheduler)] if self.scheduler is not None else []):
            load_into(ckpt, name, obj)
        self.step, self.history, self.logger_id = ckpt["step"], resumed_history(ckpt), ckpt.get("logger_run_id")
        self.window = ckpt.get("window") or {}  # the steps since the last train row, which it will average
        self.last_eval = ckpt.get("last_eval") or {}  # what the final row reports until the next evaluation
        self.elapsed_before = float(ckpt.get("elapsed_s", 0.0))  # (checkpoints older than elapsed_s: from 0)
        self.timing_before = ckpt.get("timing") or {}  # the step times of the process that wrote it
        self.per_rank_rng = len(ckpt.get("rng_ranks") or []) == self.world  # saved by this many ranks
        self.rng = ckpt["rng_ranks"][self.rank] if self.per_rank_rng else ckpt["rng"]
        step, path = self.step, ckpt["path"]
        if step > t.max_steps:
            raise ConfigError(f"trainer.max_steps={t.max_steps} is below the step of the checkpoint it resumes "
                              f"({path} is at step {step}): set trainer.max_steps={step} or more")
        if step == t.max_steps:
            print(f"{path} is at step {step} = trainer.max_steps: the run is finished, nothing to train "
                  f"(set trainer.max_steps above {step} to train on)")
        else:
            print(f"resumed from {path} at step {step}")

    def _open_run(self):
        """Logger, RNG, rows: results.jsonl starts with the resumed history (rank 0 writes)."""
        if self.logger_id and self.cfg.logger.get("run_id") is None:
            self.cfg = self.cfg.copy()
            with open_dict(self.cfg):
                self.cfg.logger.run_id = self.logger_id  # wandb continues the same run (other loggers ignore it)
        self.logger = make_logger(self.cfg, self.run_dir) if self.main else NullLogger(self.run_dir)
        set_rng_state(self.rng)  # whatever the logger drew, training starts from the seeded (or saved) state
        if self.distributed and self.rank > 0 and not self.per_rank_rng:
            torch.manual_seed(torch.initial_seed() + self.rank)  # each rank its own dropout masks
        self.meta = provenance(self.device)
        self.identity.update(precision=self.t.precision, device_type=self.device.type)
        self.rows = RowLog(self.run_dir / "results.jsonl", self.history, write=self.main)
        self.last_train_loss = rows_last(self.history, "train", "loss")

    def run(self) -> dict:
        """Train to trainer.max_steps (or the time limit, a signal, an error); the final row."""
        t = self.t
        self.resume()
        self._open_run()
        self.load_start, self.first_step = os.getloadavg()[0], self.step
        self.began = time.perf_counter()  # elapsed_s counts from here (on top of elapsed_before)
        self._mark_time()
        max_time = t.max_time_s
        # a resumed run that had used it all
        self.out_of_time = max_time is not None and self.elapsed_before >= max_time
        self.bar = tqdm(total=t.max_steps, initial=self.step, desc=self.identity.get("task", "train"), unit="step",
                        dynamic_ncols=True, disable=not t.progress or not self.main)
        with stop_on_signals() as self.stop:
            while self.step < t.max_steps and not self.out_of_time:
                batch = to_device(next(self.train_data), self.device)
                if "kernel_backend" not in self.meta:
                    self._record_backend(batch)
                try:
                    self.train_step(batch)
                except torch.OutOfMemoryError as err:
                    self.status = f"oom: {str(err).splitlines()[0][:160]}"
                    break
                self.step += 1
                self.bar.update(1)
                self.out_of_time = max_time is not None and self.elapsed() > max_time  # the host's clock
                if self.distributed:
                    self._agree_on_stopping()
                if self._sync_due() and not self._sync_point():
                    break  # a non-finite loss
                if self.stop:
                    self.status = f"stopped by signal at step {self.step}"
                    break
        return self.finish()

    def _record_backend(self, batch):
        """The kernel the model's attention runs on, in every row from the first step on
        (repro.training.backends), with one console note where it fell back to the PyTorch path."""
        first = next((x for x in tensors_of(batch) if x.dim() >= 2), None)
        dtype = self.dtype or next(self.model.parameters()).dtype  # the autocast dtype, else the weights
        fields = {} if first is None else model_backend(self.model, first.shape[0], first.shape[1], dtype, self.device,
                                                        causal=getattr(self.model, "causal", True))
        self.meta.update(fields or {"kernel_backend": None})
        note_fallback(self.identity.get("attention", "the attention"), fields)

    def train_step(self, batch):
        """One update. The loss, grad norm and metrics go to the window as device tensors: no
        sync here (under float16 GradScaler.step reads its inf check, the one exception)."""
        t = self.t
        with self.autocast():
            loss, metrics = self.loss_fn(self.train_model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip or math.inf)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scheduler is not None and not self.plateau:
            self.scheduler.step()
        for k, v in {"loss": loss, "grad_norm": grad_norm, **metrics}.items():
            self.window.setdefault(k, []).append(v.detach() if isinstance(v, torch.Tensor) else float(v))

    def _agree_on_stopping(self):
        """DDP: stop, and end at the time limit, on every rank at the same step (see the module
        docstring: a CPU tensor, over gloo, so the device is not synced)."""
        flags = torch.tensor([float(bool(self.stop)), float(self.out_of_time)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] and not self.stop:
            self.stop.append(None)  # another rank was signalled: finish together
        self.out_of_time = bool(flags[1])

    def _ends_here(self) -> bool:
        """A planned end at this step: a train row and an evaluation here."""
        return self.step == self.t.max_steps or self.out_of_time

    def _sync_due(self) -> bool:
        t, s = self.t, self.step
        return (s % t.log_every == 0 or self._ends_here() or bool(self.stop)
                or bool(t.eval_every) and s % t.eval_every == 0
                or bool(t.checkpoint and t.checkpoint_every) and s % t.checkpoint_every == 0
                or s - self.first_step == WARMUP_STEPS)

    def _sync_point(self) -> bool:
        """Read the window back (the one device sync), time the steps since the last sync point,
        then the rows, evaluation and checkpoint due at this step. False on a non-finite loss."""
        t, s, end = self.t, self.step, self._ends_here()
        self._window_to_host()
        self._time_steps()
        bad = next((i for i, v in enumerate(self.window.get("loss", [])) if not math.isfinite(v)), None)
        if bad is not None:  # nothing logged, evaluated or checkpointed from it
            at = s - len(self.window["loss"]) + bad + 1
            self.status = f"error: non-finite loss {self.window['loss'][bad]} at step {at}"
            return False
        if s % t.log_every == 0 or end:
            self.log_train()
        if t.eval_every and (s % t.eval_every == 0 or end):
            self.last_eval = self.evaluate()
        if t.checkpoint and t.checkpoint_every and s % t.checkpoint_every == 0:
            self.checkpoint()
        self._mark_time()  # rows, evaluation and checkpoint are not step time
        return True

    def _window_to_host(self):
        """The window's device tensors to floats, in one transfer; under DDP each step's value
        becomes its mean over ranks (one all-reduce), so all ranks log, stop on and checkpoint
        the same numbers."""
        pending = [(k, i) for k, vs in self.window.items() for i, v in enumerate(vs) if isinstance(v, torch.Tensor)]
        if not pending:
            return
        tensors = [self.window[k][i].reshape(()) for k, i in pending]
        dtype = functools.reduce(torch.promote_types, {v.dtype for v in tensors})  # float32 for float32 and bf16
        values = torch.stack([v.to(self.device, dtype) for v in tensors]).tolist()  # (the sync)
        if self.distributed:
            values = ddp.mean_across_ranks(values)
        for (k, i), v in zip(pending, values):
            self.window[k][i] = v

    def _mark_time(self):
        self.mark = (time.perf_counter(), time.process_time(), self.step)

    def _time_steps(self):
        """Wall and CPU time since the last mark, shared equally among the steps since."""
        wall, cpu, step = self.mark
        n = self.step - step
        if n:
            self.step_times += [(time.perf_counter() - wall) / n] * n
            self.cpu_times += [(time.process_time() - cpu) / n] * n

    def elapsed(self) -> float:
        """This run's training seconds so far, earlier processes included."""
        return self.elapsed_before + time.perf_counter() - self.began

    def emit(self, kind, metrics) -> dict:
        row = {**self.identity, "kind": kind, "step": self.step, "elapsed_s": self.elapsed(), **metrics, **self.meta}
        self.rows.append(row)
        if kind == "train":
            self.last_train_loss = row.get("loss")
        self.logger.log({f"{kind}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=self.step)
        return row

    def log_train(self):
        """A train row: the window's means, and the lr."""
        logged = {k: mean(v) for k, v in self.window.items()}
        self.emit("train", {**logged, "lr": self.optimizer.param_groups[0]["lr"]})
        self.bar.set_postfix(loss=f"{logged['loss']:.4f}")
        self.window.clear()  # (in place: checkpoint() saves this dict)

    def evaluate(self) -> dict:
        """An eval row over the held-out batches, eval_hook's numbers merged in (rank 0 runs it,
        the others get its numbers); a ReduceLROnPlateau schedule steps on it."""
        if self.eval_data is None or not self.t.eval_batches:
            return {}
        out = held_out_means(self.model, self.loss_fn, self.eval_data(), self.device, self.autocast)
        if self.eval_hook is not None:
            extra = {}
            if self.main:
                for k, v in run_hook(self.eval_hook, self.model, self.step, self.device).items():
                    if isinstance(v, Path) and v.suffix == ".png":  # a sample grid: to wandb too
                        self.logger.log_image(f"eval/{k}", v)
                        v = str(v)
                    extra[k] = v
            out.update(ddp.broadcast_object(extra if self.main else None))
        if self.plateau:
            metric = self.t.plateau_metric or "loss"
            if metric not in out:
                raise ConfigError(f"trainer.plateau_metric={metric!r} is not an eval metric; valid: {', '.join(out)}")
            self.scheduler.step(out[metric])
        self.emit("eval", out)
        return out

    def checkpoint(self):
        """last.pt, written by rank 0 (a collective: every rank calls it)."""
        rngs = ddp.all_gather_object(rng_state()) if self.distributed else None
        if self.main:
            self.rows.sync()
            save_checkpoint(self.run_dir / LAST, {
                "step": self.step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "data": self.train_data.state_dict(), "rng": rng_state(),
                "rows_written": len(self.rows),  # the rows so far live in results.jsonl, not here
                "window": {k: [float(v) for v in vs] for k, vs in self.window.items()},  # (host floats already)
                "last_eval": self.last_eval,
                "elapsed_s": self.elapsed(),  # a resume's clock starts here, so elapsed_s runs on across processes
                "timing": step_timing(self.step_times, self.cpu_times, self.step - self.first_step, self.timing_before),
                **({"rng_ranks": rngs, "world_size": self.world} if self.distributed else {}),
                "fingerprint": self.fingerprint,
                "logger_run_id": getattr(getattr(self.logger, "run", None), "id", None),
                "config": OmegaConf.to_container(self.cfg, resolve=True)})
        ddp.barrier()  # nobody runs ahead of (or exits before) the file on disk

    def finish(self) -> dict:
        """After the loop: an evaluation if the run ended between two, the checkpoint, the final
        row; then the time-limit line, or the exit on a signal."""
        t, step = self.t, self.step
        if self.out_of_time and self.status == "ok" and step < t.max_steps:  # (both at once: max_steps, ok)
            self.status = TIME_LIMIT
        self.bar.close()
        if t.eval_every and not self.last_eval and self.status in ("ok", TIME_LIMIT) and step > 0:
            # a run that ended between evaluations (a stopped run is not ended: it evaluates at its
            # next eval step after the resume, as an uninterrupted run does, and logs no extra row)
            self.last_eval = self.evaluate()
        if t.checkpoint and not self.status.startswith(("oom", "error")):
            self.checkpoint()  # at exit: what a resume continues from
        if self.status.startswith("error"):  # the task still writes its summaries; then run.py fails the job
            DIVERGED.append(f"{self.run_dir}: {self.status[len('error: '):]}")
        final = self.emit("final", self._final_metrics())
        self.rows.close()
        self.logger.finish()
        ddp.barrier()  # rank 0's rows are on disk before any rank goes on to read them
        last = self.run_dir / LAST if t.checkpoint else None
        if self.status == TIME_LIMIT and self.main:
            print(time_limit_line(t.max_time_s, step, final["elapsed_s"], self.run_dir, last, self.world), flush=True)
        # checkpoint and rows are written: one line, then the exit of docs/training.md (a multirun stops too). Every
        # rank asks (a collective), in case a signal reached one rank after the last step.
        signals = [s for s in ddp.all_gather_object(self.stop[0] if self.stop else None) if s is not None]
        if signals:
            exit_stopped(signals[0], step, self.run_dir, last, self.world, self.main)
        return final

    def _final_metrics(self) -> dict:
        t = self.t
        return {
            "status": self.status, "steps": self.step, "steps_this_process": self.step - self.first_step,
            "train_loss": self.last_train_loss,
            **{f"eval_{k}": v for k, v in self.last_eval.items()},
            **step_timing(self.step_times, self.cpu_times, self.step - self.first_step, self.timing_before),
            "train_time_s": time.perf_counter() - self.began,
            "n_params": sum(p.numel() for p in self.model.parameters()),
            "loadavg_1min_start": self.load_start, "loadavg_1min_end": os.getloadavg()[0],
            "threads": torch.get_num_threads(), "world_size": self.world,
            **({"compile_backend": t.compile_backend} if t.compile else {})}
