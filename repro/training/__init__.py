"""The training loop every training task shares (copy, images, speech): seeding, RAdam and a
step-wise lr schedule from config, bf16 autocast, gradient clipping, periodic evaluation,
atomic checkpoints and an exact resume. See repro.training.loop.fit."""
from repro.training.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from repro.training.loop import fit, seed_everything
from repro.training.optim import build_optimizer, build_scheduler

__all__ = ["fit", "seed_everything", "build_optimizer", "build_scheduler", "save_checkpoint",
           "load_checkpoint", "find_checkpoint"]
