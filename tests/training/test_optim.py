"""repro.training.optim.RAdam, the authors' optimizer (their radam.py): torch's RAdam with each
parameter's gradient clipped on its own inside the step, and decoupled weight decay; checked
against torch.nn.utils.clip_grad_norm_ on each parameter alone + torch.optim.RAdam, against a
first step written out by hand, and through the training loop with the paper preset."""
from functools import partial

import pytest
import torch

from repro.attention import LinearAttention
from repro.data import CopyTask
from repro.models import AutoregressiveTransformer
from repro.tasks.copy import copy_loss
from repro.training import fit, seed_everything
from repro.training.optim import RAdam


def _params():
    """Three parameters whose gradients have very different norms."""
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*shape, dtype=torch.float64)) for shape in ((4, 3), (7,), (2, 2, 2))]


def _grads(step):
    torch.manual_seed(100 + step)
    return [torch.randn(4, 3, dtype=torch.float64) * 10, torch.randn(7, dtype=torch.float64) * 0.01,
            torch.randn(2, 2, 2, dtype=torch.float64)]


def test_per_parameter_clipping_equals_clip_grad_norm_on_each_parameter_alone():
    ours, ref, glob = _params(), _params(), _params()
    opt = RAdam(ours, lr=0.01, max_grad_norm=0.5, weight_decay=0.01, decoupled_weight_decay=True)
    ref_opt = torch.optim.RAdam(ref, lr=0.01, weight_decay=0.01, decoupled_weight_decay=True)
    glob_opt = torch.optim.RAdam(glob, lr=0.01, weight_decay=0.01, decoupled_weight_decay=True)
    for step in range(8):  # past RAdam's first (un-adapted) steps
        for ps in (ours, ref, glob):
            for p, g in zip(ps, _grads(step)):
                p.grad = g.clone()
        opt.step()
        for p in ref:
            torch.nn.utils.clip_grad_norm_(p, 0.5)  # the reference: each parameter on its own
        ref_opt.step()
        torch.nn.utils.clip_grad_norm_(glob, 0.5)  # one global norm: not the authors' clipping
        glob_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert max((a - b).abs().max() for a, b in zip(ours, glob)) > 1e-4


def test_the_first_step_by_hand():
    """RAdam's first step is un-adapted: p <- p (1 - lr wd) - lr clip(g), clip(g) = g min(1, c / |g|)."""
    ps = _params()
    before = [p.detach().clone() for p in ps]
    grads = _grads(0)
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    lr, wd, c = 0.01, 0.01, 0.5
    RAdam(ps, lr=lr, max_grad_norm=c, weight_decay=wd, decoupled_weight_decay=True).step()
    for p, p0, g in zip(ps, before, grads):
        clipped = g * min(1.0, c / (g.norm().item() + 1e-6))
        torch.testing.assert_close(p.detach(), p0 * (1 - lr * wd) - lr * clipped, rtol=1e-12, atol=1e-14)
    assert grads[0].norm() > c > grads[1].norm()  # one gradient was clipped, one was not


def test_bad_max_grad_norm_is_named():
    with pytest.raises(ValueError, match="max_grad_norm must be positive or null; got 0"):
        RAdam(_params(), max_grad_norm=0)


def test_the_paper_preset_trains_with_it_and_no_global_clip(compose_cfg, tmp_path):
    cfg = compose_cfg("experiment=paper_copy", "attention=linear", "model=tiny", "task.max_len=16", "task.batch_size=8",
                      "trainer.max_steps=1", "trainer.eval_every=0", "trainer.progress=false",
                      "trainer.optimizer.max_grad_norm=0.05", "trainer.optimizer.lr=0.01")
    assert cfg.trainer.grad_clip is None and cfg.trainer.optimizer.weight_decay == 0.01

    def fresh():
        seed_everything(0)
        m = dict(cfg.model)
        return AutoregressiveTransformer(partial(LinearAttention), 11, **m)

    model = fresh()
    fit(model, copy_loss, CopyTask(8, 16, seed=0), cfg, run_dir=tmp_path)
    ref = fresh()
    loss, _ = copy_loss(ref, next(CopyTask(8, 16, seed=0)))
    loss.backward()
    clipped = 0
    for p in ref.parameters():  # first step by hand: per-parameter clip, decoupled decay, -lr g
        g = p.grad * min(1.0, 0.05 / (p.grad.norm().item() + 1e-6))
        clipped += bool(p.grad.norm() > 0.05)
        p.data = p.data * (1 - 0.01 * 0.01) - 0.01 * g
    assert clipped >= 2  # several parameters clipped, each to its own norm
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
