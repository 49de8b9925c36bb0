"""Optimizer and lr schedule from config (trainer.optimizer, trainer.scheduler): each a
`_target_` with `_partial_: true`, so any torch.optim class or lr_scheduler fits. The schedule
steps once per update (milestones count gradient steps), except ReduceLROnPlateau, which the
loop steps with the evaluation loss.

RAdam here is torch's RAdam with the authors' gradient clipping inside the step: each
parameter's gradient is clipped to norm max_grad_norm on its own (their radam.py calls
clip_grad_norm_ on every parameter before its update), not one global norm over the model. With
weight_decay and decoupled_weight_decay=True the decay is theirs too (p <- p - lr * wd * p before
the update). The paper_* presets use it with the trainer's global clip off (trainer.grad_clip: null)."""
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from repro.cli.config import ConfigError


class RAdam(torch.optim.RAdam):
    """torch.optim.RAdam that first clips every parameter's gradient to norm max_grad_norm
    separately (null: no clipping)."""

    def __init__(self, params, lr=1e-3, max_grad_norm: float | None = None, **kwargs):
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"RAdam: max_grad_norm must be positive or null; got {max_grad_norm}")
        super().__init__(params, lr=lr, **kwargs)
        self.defaults["max_grad_norm"] = max_grad_norm  # for groups added later
        for group in self.param_groups:
            group.setdefault("max_grad_norm", max_grad_norm)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["max_grad_norm"] is None:
                continue
            for p in group["params"]:
                if p.grad is not None:
                    torch.nn.utils.clip_grad_norm_(p, group["max_grad_norm"])  # this parameter alone
        super().step()
        return loss


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
