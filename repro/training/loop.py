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
(each with the task's identity and repro.common.results.provenance) and to the logger. A step reads
nothing back from the device: its loss and metrics stay there until the next log, eval or
checkpoint step (and the end), where the window is read in one transfer; the step times
(time_per_step_ms, the median, and its mean) are measured between those points and shared among
their steps (repro.training.trainer says where the device is synchronised, and why).

Resume: trainer.resume=<run dir or checkpoint file> restores model, optimizer, scheduler,
step, data stream, every RNG state and the wandb run id; the run then goes on exactly as if never
stopped (tests/training/test_training.py checks the next losses are equal). Rows are appended to
results.jsonl one line at a time (repro.training.rows); the checkpoint records how many there
were, and a resume starts its results.jsonl with those rows from the checkpoint's run dir, so
the resumed run dir (a new one, or the same) holds the whole history and nothing after it.
SIGINT/SIGTERM (Ctrl-C, a SLURM pre-emption) stop the loop at the end of the current step, after
the checkpoint and the final row (repro.training.stopping; what the user sees, exit statuses
included: docs/training.md, "Stopping and resuming").

Every row carries elapsed_s: the wall-clock seconds of training so far (steps, evaluations, rows
and checkpoints: everything from the start of the loop), continued across a resume (the
checkpoint holds it). trainer.max_time_s ends the run as trainer.max_steps does, once elapsed_s
passes it at the end of a step, and fit() returns: a planned end (docs/training.md, "A time
limit").

DDP (repro.training.distributed): under torchrun, or SLURM with several tasks, fit() joins the
process group, wraps the model in DistributedDataParallel and gives each rank its slice of the
global batch (train_data yields global batches; a stream with its own `world_size` attribute,
e.g. ShuffledBatches(rank=, world_size=), is taken as already sharded). loss_fn then receives
the DDP wrapper: call model(...), not other methods of it, in the training loss. Train and eval
metrics are averaged over ranks; rank 0 alone writes rows, logs and checkpoints (the others
wait at a barrier). The losses equal a single process's on the same global batch when the
loss is a mean over equal shares (tests/training/test_distributed.py).

trainer.compile=true trains a torch.compile'd model (trainer.compile_backend: inductor, or
aot_eager / eager for a quick check); evaluation, eval_hook and checkpoints use the plain
module, so checkpoints stay interchangeable.
"""
# the names the tasks and tests import from here (the parts live in repro.training.parts)
from repro.common.config import parse_device  # noqa: F401
from repro.models.generate import compile_step  # noqa: F401  (generation's; tests import it from here)
from repro.training.parts import compile_backends, seed_everything, step_time_text, to_device  # noqa: F401
from repro.training.trainer import Trainer


def fit(model, loss_fn, train_data, cfg, *, run_dir, eval_data=None, identity=None, fingerprint=None,
        eval_hook=None) -> dict:
    """Train `model` per cfg.trainer; returns the final row (also written to results.jsonl).
    The parts, one at a time: repro.training.trainer.Trainer.

    identity: what every row carries to say which run it is (task, attention, sizes, seed).
    fingerprint: what a checkpoint must match to be resumed here (default: cfg.model and
    cfg.attention and the task's name).
    """
    return Trainer(model, loss_fn, train_data, cfg, run_dir=run_dir, eval_data=eval_data, identity=identity,
                   fingerprint=fingerprint, eval_hook=eval_hook).run()
