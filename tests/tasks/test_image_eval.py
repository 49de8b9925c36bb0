"""The held-out images an image run scores: equal batches (an evaluation averages batch means, so a
short last batch would weigh its images more), task.eval_batch_size apart from the training batch,
and the count in every row (n_eval)."""
import contextlib

import torch

from repro.tasks import image
from repro.training.parts import evaluate
from tests.tasks.test_image_task import train


def test_held_out_mean_is_the_per_image_mean(compose_cfg):
    """10 test images, batch 4, 3 batches requested: the old split [4, 4, 2] weighed the last two
    images twice; now two batches of 4, and the mean of batch means is the mean over 8 images."""
    test = torch.randint(0, 256, (10, 1, 8, 8), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    cfg = compose_cfg("task=mnist", "task.batch_size=4", "trainer.eval_batches=3")
    batches = image.held_out_batches(cfg, test)
    assert [len(b) for b in batches] == [4, 4]
    per_image = lambda model, b: (b.double().mean(dim=(1, 2, 3)).mean(), {})  # a loss whose mean is exact
    got = evaluate(torch.nn.Identity(), per_image, batches, torch.device("cpu"), contextlib.nullcontext)["loss"]
    assert abs(got - test[:8].double().mean().item()) < 1e-12
    cfg = compose_cfg("task=mnist", "task.batch_size=4", "task.eval_batch_size=5", "trainer.eval_batches=3")
    assert [len(b) for b in image.held_out_batches(cfg, test)] == [5, 5]
    cfg = compose_cfg("task=mnist", "task.batch_size=16", "trainer.eval_batches=3")
    assert [len(b) for b in image.held_out_batches(cfg, test)] == [10]  # fewer than one batch: all of them


def test_rows_record_the_held_out_count(compose_cfg, tmp_path):
    rows = train(compose_cfg, tmp_path / "run", "trainer.max_steps=2", "trainer.eval_every=2", "task.n_samples=0",
                 "task.eval_batch_size=4", "trainer.eval_batches=3")
    evals = [r for r in rows if r["kind"] in ("eval", "final")]
    assert evals and {r["n_eval"] for r in evals} == {12}
