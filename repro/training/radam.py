"""The authors' RAdam: torch's RAdam with their gradient clipping inside the step. Each parameter's
gradient is clipped to norm max_grad_norm on its own (their radam.py calls clip_grad_norm_ on
every parameter before its update), not one global norm over the model; with weight_decay and
decoupled_weight_decay=True the decay is theirs too (p <- p - lr * wd * p before the update).
The paper_* presets use it (as repro.training.optim.RAdam) with the trainer's global clip off.
Plain torch, so that tools without Hydra (repro.reproduction.profile_kernels) build it too."""
import torch


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
