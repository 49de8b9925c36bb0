"""Optimizer and lr schedule from config (trainer.optimizer, trainer.scheduler): each a
`_target_` with `_partial_: true`, so any torch.optim class or lr_scheduler fits. The schedule
steps once per update (milestones count gradient steps), except ReduceLROnPlateau, which the
loop steps with the evaluation loss.

RAdam here is the authors' (repro.training.radam: each parameter's gradient clipped on its own
inside the step); the paper_* presets use it with the trainer's global clip off (trainer.grad_clip: null)."""
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from repro.common.errors import ConfigError
from repro.training.radam import RAdam  # noqa: F401  (the presets' _target_: repro.training.optim.RAdam)


def _build(node, what, *args):
    try:
        return instantiate(node)(*args)
    except (InstantiationException, TypeError, ValueError) as err:
        cause = err.__cause__ or err
        raise ConfigError(f"trainer.{what}: cannot build {node.get('_target_')!r}: "
                          f"{str(cause).strip().splitlines()[-1]}") from err


def build_optimizer(node, model):
    if node is None or "_target_" not in node:
        raise ConfigError("trainer.optimizer needs a _target_ (e.g. torch.optim.RAdam) with _partial_: true")
    return _build(node, "optimizer", [p for p in model.parameters() if p.requires_grad])


def build_scheduler(node, optimizer):
    """None when no schedule is configured (constant lr)."""
    if node is None:
        return None
    return _build(node, "scheduler", optimizer)
