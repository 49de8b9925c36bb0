"""The shared training loop: schedule, exact resume, checkpoints (atomic, corrupt, mismatched),
stopping on a signal, bad settings."""
import io
import os
import re
import signal
import time
from functools import partial

import pytest
import torch

from repro.attention import LinearAttention
from repro.common.errors import ConfigError
from repro.common.results import read_jsonl
from repro.data import CopyTask
from repro.models import AutoregressiveTransformer
from repro.tasks.copy import copy_loss, run
from repro.training import fit, load_checkpoint, save_checkpoint, seed_everything

# Dropout on, so the resume must restore the torch RNG too; log every step to compare each loss.
BASE = ("experiment=smoke_copy", "attention=linear", "task.max_len=16", "task.batch_size=8", "model.dropout=0.1",
        "trainer.log_every=1", "trainer.eval_every=3", "trainer.eval_batches=1", "trainer.checkpoint_every=2",
        "trainer.progress=false")


def train(compose_cfg, out, *overrides):
    run(compose_cfg(*BASE, *overrides, f"+task.out_dir={out}"))
    return read_jsonl(out / "results.jsonl")


def tiny_fit(cfg, run_dir, loss_fn=copy_loss):
    """fit() on a 1-layer copy model, the same weights and data stream every call."""
    seed_everything(0)
    model = AutoregressiveTransformer(partial(LinearAttention), 11, n_layers=1, d_model=16, n_heads=2, d_ff=16)
    return fit(model, loss_fn, CopyTask(8, 16, seed=0), cfg, run_dir=run_dir,
               eval_data=lambda: [next(CopyTask(8, 16, seed=9))])


def signal_at_step(n, signum=signal.SIGINT):
    """copy_loss, sending this process `signum` during the n-th training step (as Ctrl-C or
    SLURM's SIGTERM would, mid-step)."""
    calls = []

    def loss_fn(model, batch):
        calls.append(model.training)  # evaluations call it too, in eval mode
        if sum(calls) == n and model.training:
            os.kill(os.getpid(), signum)
        return copy_loss(model, batch)
    return loss_fn


def losses(rows):
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


@pytest.mark.slow
def test_resume_continues_exactly(compose_cfg, tmp_path):
    whole = train(compose_cfg, tmp_path / "whole", "trainer.max_steps=10", "trainer.scheduler.milestones=[6]")
    first = train(compose_cfg, tmp_path / "first", "trainer.max_steps=5", "trainer.scheduler.milestones=[6]")
    rest = train(compose_cfg, tmp_path / "rest", "trainer.max_steps=10", "trainer.scheduler.milestones=[6]",
                 f"trainer.resume={tmp_path / 'first'}")
    assert losses(first) == {s: v for s, v in losses(whole).items() if s <= 5}
    assert losses(rest) == losses(whole)  # bit for bit, the five steps after the resume included
    assert [r["lr"] for r in rest if r["kind"] == "train"] == [r["lr"] for r in whole if r["kind"] == "train"]
    a = load_checkpoint(tmp_path / "whole")
    b = load_checkpoint(tmp_path / "rest/checkpoints/last.pt")
    assert a["step"] == b["step"] == 10 and a["data"]["batches"] == b["data"]["batches"] == 10
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k


def test_lr_schedule_steps_per_update(compose_cfg, tmp_path):
    rows = train(compose_cfg, tmp_path, "trainer.max_steps=5", "trainer.optimizer.lr=0.01",
                 "trainer.scheduler.milestones=[3]", "trainer.scheduler.gamma=0.5", "trainer.checkpoint=false")
    # lr after each update: MultiStepLR counts updates, so steps 3.. run at half the rate
    assert [r["lr"] for r in rows if r["kind"] == "train"] == pytest.approx([0.01, 0.01, 0.005, 0.005, 0.005])


def test_bf16_autocast_trains(compose_cfg, tmp_path):
    rows = train(compose_cfg, tmp_path, "trainer.max_steps=3", "trainer.precision=bfloat16", "trainer.checkpoint=false")
    assert rows[-1]["status"] == "ok" and rows[-1]["precision"] == "bfloat16"
    assert all(torch.isfinite(torch.tensor(v)) for v in losses(rows).values())


@pytest.mark.slow  # trains, then resumes
def test_corrupt_truncated_and_missing_checkpoints(compose_cfg, tmp_path):
    train(compose_cfg, tmp_path / "ok", "trainer.max_steps=2")
    good = (tmp_path / "ok/checkpoints/last.pt").read_bytes()
    for name, data in [("garbage.pt", b"not a checkpoint at all"), ("cut.pt", good[: len(good) // 2])]:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ConfigError, match="corrupt") as err:
            train(compose_cfg, tmp_path / "x", "trainer.max_steps=3", f"trainer.resume={path}")
        assert str(path) in str(err.value) and "\n" not in str(err.value)
    torch.save({"step": 3}, tmp_path / "foreign.pt")
    with pytest.raises(ConfigError, match="not a repro-checkpoint"):
        load_checkpoint(tmp_path / "foreign.pt")
    with pytest.raises(ConfigError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nowhere")


@pytest.mark.slow  # trains, then resumes
def test_mismatched_checkpoint_is_refused(compose_cfg, tmp_path):
    train(compose_cfg, tmp_path / "ok", "trainer.max_steps=2")
    with pytest.raises(ConfigError, match="model.d_model is 64 there, 32 here") as err:
        train(compose_cfg, tmp_path / "x", "trainer.max_steps=3", "model.d_model=32",
              f"trainer.resume={tmp_path / 'ok'}")
    assert str(tmp_path / "ok/checkpoints/last.pt") in str(err.value)
    with pytest.raises(ConfigError, match="attention._target_"):
        train(compose_cfg, tmp_path / "y", "trainer.max_steps=3", "attention=softmax",
              f"trainer.resume={tmp_path / 'ok'}")


def test_checkpoint_write_is_atomic(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, {"step": 1, "w": torch.ones(3)})
    with pytest.raises(TypeError, match="checkpoint.bad is a builtins.function"):
        save_checkpoint(path, {"step": 2, "bad": lambda: None})  # not data: refused before anything is written
    assert load_checkpoint(path)["step"] == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


def test_signal_stops_after_the_step_with_a_checkpoint(compose_cfg, tmp_path, capsys):
    cfg = compose_cfg(*BASE, "trainer.max_steps=50", "trainer.checkpoint_every=0")
    data = CopyTask(8, 16, seed=0)
    seed_everything(0)
    model = AutoregressiveTransformer(partial(LinearAttention), 11, n_layers=1, d_model=16, n_heads=2, d_ff=16)
    with pytest.raises(SystemExit) as stopped:  # once the checkpoint is written
        fit(model, signal_at_step(4), data, cfg, run_dir=tmp_path)
    assert stopped.value.code == 130
    final = read_jsonl(tmp_path / "results.jsonl")[-1]
    assert final["status"] == "stopped by signal at step 4" and final["steps"] == 4
    assert load_checkpoint(tmp_path)["step"] == 4 and data.batches == 4
    assert capsys.readouterr().err == (f"stopped by SIGINT at step 4: checkpoint {tmp_path / 'checkpoints/last.pt'}; "
                                       f"resume with: add trainer.resume={tmp_path} to the command that started it\n")


def test_resume_between_log_points_logs_what_an_uninterrupted_run_logs(compose_cfg, tmp_path):
    """Stopped at step 4, between the train rows of steps 3 and 6 and the evaluations of steps 5
    and 9: the resumed run's row of step 6 averages steps 4-6, as the uninterrupted run's does,
    and no evaluation is logged at the stop."""
    cfg = partial(compose_cfg, *BASE, "trainer.max_steps=9", "trainer.log_every=3", "trainer.eval_every=5",
                  "trainer.checkpoint_every=0")
    tiny_fit(cfg(), tmp_path / "whole")
    with pytest.raises(SystemExit):
        tiny_fit(cfg(), tmp_path / "first", signal_at_step(4))
    assert load_checkpoint(tmp_path / "first")["step"] == 4
    tiny_fit(cfg(f"trainer.resume={tmp_path / 'first'}"), tmp_path / "rest")

    def logged(path):  # every row but the final one, without the wall-clock fields
        return [{k: v for k, v in r.items() if k not in ("time", "elapsed_s", "device")}
                for r in read_jsonl(path / "results.jsonl") if r["kind"] != "final"]

    whole = logged(tmp_path / "whole")
    assert [(r["kind"], r["step"]) for r in whole] == [("train", 3), ("eval", 5), ("train", 6), ("train", 9),
                                                       ("eval", 9)]
    assert logged(tmp_path / "rest") == whole


def test_elapsed_s_runs_on_across_a_resume(compose_cfg, tmp_path):
    """Every row carries elapsed_s, the seconds of training so far. A run stopped at step 4 and
    resumed logs the rows an uninterrupted run logs, its clock going on from the checkpoint's:
    monotone, and between the two processes' own loop times and their wall time measured here."""
    cfg = partial(compose_cfg, *BASE, "trainer.max_steps=9", "trainer.log_every=3", "trainer.eval_every=5",
                  "trainer.checkpoint_every=0")

    def timed(*args):  # (what fit raised or None, the seconds it took as seen from outside)
        began = time.perf_counter()
        try:
            tiny_fit(*args)
        except SystemExit as stop:
            return stop, time.perf_counter() - began
        return None, time.perf_counter() - began

    _, wall_whole = timed(cfg(), tmp_path / "whole")
    stopped, wall_first = timed(cfg(), tmp_path / "first", signal_at_step(4))
    assert stopped is not None
    at_stop = load_checkpoint(tmp_path / "first")["elapsed_s"]
    _, wall_rest = timed(cfg(f"trainer.resume={tmp_path / 'first'}"), tmp_path / "rest")
    whole, first, rest = (read_jsonl(tmp_path / d / "results.jsonl") for d in ("whole", "first", "rest"))
    for rows, wall in ((whole, wall_whole), (rest, wall_first + wall_rest)):
        assert [(r["kind"], r["step"]) for r in rows] == [(r["kind"], r["step"]) for r in whole]
        clock = [r["elapsed_s"] for r in rows]
        assert clock == sorted(clock) and clock[0] > 0 and clock[-1] < wall
        assert clock[-1] >= rows[-1]["train_time_s"]  # this process's loop, at least
    assert first[0]["elapsed_s"] == rest[0]["elapsed_s"] <= at_stop <= first[-1]["elapsed_s"] < wall_first
    resumed = [r for r in rest if r["step"] > 4]  # written by the resumed process: its clock starts at at_stop
    assert resumed[0]["elapsed_s"] > at_stop and resumed[-1]["elapsed_s"] >= at_stop + rest[-1]["train_time_s"]


@pytest.mark.slow
def test_rerun_in_a_run_dir_with_a_checkpoint_is_refused_and_resume_in_place_works(compose_cfg, tmp_path):
    train(compose_cfg, tmp_path, "trainer.max_steps=2")
    before = (tmp_path / "checkpoints/last.pt").read_bytes()
    with pytest.raises(ConfigError, match=f"already holds a run's checkpoint .*trainer.resume={tmp_path}") as err:
        train(compose_cfg, tmp_path, "trainer.max_steps=4")  # would start again at step 0
    assert "\n" not in str(err.value) and (tmp_path / "checkpoints/last.pt").read_bytes() == before
    with pytest.raises(ConfigError, match="already holds"):  # resuming another run into this one: also refused
        train(compose_cfg, tmp_path / "other", "trainer.max_steps=2")
        train(compose_cfg, tmp_path, "trainer.max_steps=4", f"trainer.resume={tmp_path / 'other'}")
    rows = train(compose_cfg, tmp_path, "trainer.max_steps=4", f"trainer.resume={tmp_path}")  # in place
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4] and rows[-1]["steps"] == 4


@pytest.mark.slow  # trains, then resumes
def test_resuming_a_finished_run_says_so_and_trains_nothing(compose_cfg, tmp_path, capsys):
    first = train(compose_cfg, tmp_path / "first", "trainer.max_steps=3")
    capsys.readouterr()
    rest = train(compose_cfg, tmp_path / "rest", "trainer.max_steps=3", f"trainer.resume={tmp_path / 'first'}")
    out = capsys.readouterr().out
    assert "is at step 3 = trainer.max_steps: the run is finished, nothing to train" in out
    assert "nan" not in out and "ok, step 3" in out and "no steps trained in this process" in out
    assert [r["kind"] for r in rest] == [r["kind"] for r in first]  # no second evaluation
    assert rest[-1]["eval_loss"] == first[-1]["eval_loss"] and rest[-1]["steps_this_process"] == 0
    # the step times are those of the run that trained (kept in its checkpoint), not lost
    assert rest[-1]["time_per_step_ms"] == first[-1]["time_per_step_ms"] > 0
    assert f"mean {first[-1]['time_per_step_mean_ms']:.1f} ms" in out and "the one that wrote its checkpoint" in out


@pytest.mark.slow  # trains, then resumes
def test_max_steps_below_the_checkpoint_is_refused(compose_cfg, tmp_path):
    train(compose_cfg, tmp_path / "first", "trainer.max_steps=4")
    with pytest.raises(ConfigError, match=r"trainer.max_steps=2 is below the step of the checkpoint it resumes "
                                          r"\(.*last.pt is at step 4\): set trainer.max_steps=4 or more"):
        train(compose_cfg, tmp_path / "rest", "trainer.max_steps=2", f"trainer.resume={tmp_path / 'first'}")


@pytest.mark.slow  # trains
def test_threads_default_to_one_on_cpu_and_the_step_time_printed_is_the_mean(compose_cfg, tmp_path, monkeypatch,
                                                                          capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # torch's default on a 2-core machine
        final = train(compose_cfg, tmp_path / "auto", "trainer.max_steps=6", "trainer.checkpoint=false")[-1]
        assert final["threads"] == torch.get_num_threads() == 1
        out = capsys.readouterr().out
        assert (f"step time mean {final['time_per_step_mean_ms']:.1f} ms (median {final['time_per_step_ms']:.1f} ms)"
                in out)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own choice wins
        assert train(compose_cfg, tmp_path / "env", "trainer.max_steps=1",
                     "trainer.checkpoint=false")[-1]["threads"] == 2
        with pytest.raises(ConfigError, match=r"trainer.threads=0; valid: auto, a positive integer, or null"):
            train(compose_cfg, tmp_path / "bad", "trainer.max_steps=1", "trainer.threads=0")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("override,message", [("trainer.precision=fp8", "trainer.precision='fp8'"),
                                              ("trainer.max_steps=0", "trainer.max_steps"),
                                              ("trainer.max_time_s=0", "trainer.max_time_s must be a positive number "
                                                                       "of seconds or null; got 0$"),
                                              ("trainer.max_time_s=soon", "trainer.max_time_s.*got 'soon'$"),
                                              ("trainer.optimizer._target_=torch.optim.Nope", "trainer.optimizer"),
                                              ("task.max_len=4", "max_len=4")])
def test_bad_settings_fail_in_one_line(compose_cfg, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message) as err:
        train(compose_cfg, tmp_path, "trainer.max_steps=2", override)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("n,batch,drop_last,world", [(23, 5, True, 1), (23, 5, False, 1), (30, 4, True, 3)])
def test_shuffled_batches_cover_epochs_and_resume(n, batch, drop_last, world):
    from repro.data import ShuffledBatches

    data = [torch.tensor([i]) for i in range(n)]
    ranks = [ShuffledBatches(data, batch, seed=5, drop_last=drop_last, rank=r, world_size=world) for r in range(world)]
    per_rank = n // world
    per_epoch = per_rank // batch if drop_last else -(-per_rank // batch)
    epochs = [[torch.cat([next(s) for _ in range(per_epoch)]).flatten().tolist() for s in ranks] for _ in range(2)]
    for seen in epochs:
        flat = sum(seen, [])
        assert len(flat) == len(set(flat))  # no item twice in an epoch, across ranks either
        assert len(flat) == world * (per_epoch * batch if drop_last else per_rank)
    assert epochs[0] != epochs[1]  # a fresh order each epoch
    s = ranks[0]
    state = s.state_dict()
    expected = [next(s).tolist() for _ in range(per_epoch + 2)]  # across an epoch boundary
    t = ShuffledBatches(data, batch, seed=5, drop_last=drop_last, rank=0, world_size=world)
    t.load_state_dict(state)
    assert [next(t).tolist() for _ in range(per_epoch + 2)] == expected
    with pytest.raises(ValueError, match="from before the stream counted batches"):
        t.load_state_dict({"epoch": 0, "index": batch})  # an older checkpoint's (items, or batches): ambiguous


@pytest.mark.parametrize("clip", [0.05, None])
def test_one_step_equals_a_hand_written_clipped_radam_step(compose_cfg, tmp_path, clip):
    cfg = compose_cfg(*BASE, "trainer.max_steps=1", f"trainer.grad_clip={clip or 'null'}", "trainer.eval_every=0",
                      "trainer.optimizer.lr=0.01")

    def fresh():
        seed_everything(0)
        return AutoregressiveTransformer(partial(LinearAttention), 11, n_layers=1, d_model=16, n_heads=2, d_ff=16)

    model = fresh()
    fit(model, copy_loss, CopyTask(8, 16, seed=0), cfg, run_dir=tmp_path)
    ref = fresh()
    loss, _ = copy_loss(ref, next(CopyTask(8, 16, seed=0)))
    loss.backward()
    grads = [p.grad for p in ref.parameters()]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    if clip and norm > clip:  # clipping by the global norm, written out
        for g in grads:
            g.mul_(clip / (norm.item() + 1e-6))
    torch.optim.RAdam(ref.parameters(), lr=0.01).step()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
    row = read_jsonl(tmp_path / "results.jsonl")[0]
    assert row["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)  # logged before clipping


def test_a_non_finite_loss_ends_the_run_before_anything_is_logged_or_checkpointed_from_it(compose_cfg, tmp_path):
    """A step reads nothing back from the device, so a NaN loss is found at the next sync point
    (here the checkpoint step 6, after the NaN at step 5): the run ends there with the NaN's own
    step in its status, before the train row, the evaluation or the checkpoint that would hold it."""
    cfg = compose_cfg(*BASE, "trainer.max_steps=10", "trainer.log_every=10", "trainer.eval_every=6",
                      "trainer.checkpoint_every=6")
    calls = []

    def nan_at_step_5(model, batch):
        loss, metrics = copy_loss(model, batch)
        calls.append(model.training)
        return (loss * float("nan") if model.training and sum(calls) == 5 else loss), metrics

    final = tiny_fit(cfg, tmp_path, nan_at_step_5)
    rows = read_jsonl(tmp_path / "results.jsonl")
    assert final["status"] == "error: non-finite loss nan at step 5" and final["steps"] == 6
    assert [r["kind"] for r in rows] == ["final"]  # no train or eval row (the first were due at step 6 and 10)
    assert not (tmp_path / "checkpoints" / "last.pt").exists()


READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.numpy}


def test_a_step_reads_nothing_back_from_the_device_until_a_sync_point(compose_cfg, tmp_path):
    """A metric that notes each step at which it is read back to the host (on a GPU, a read
    stalls the launch queue): read at the sync points alone, after the warm-up steps (3) and at
    the log steps (5, 10), not every step; and the train rows are the window's means all the same."""
    cfg = compose_cfg(*BASE, "trainer.max_steps=10", "trainer.log_every=5", "trainer.eval_every=0",
                      "trainer.checkpoint=false")
    steps, read_at = [], set()

    class Watched(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in READS:
                read_at.add(len(steps))
            return super().__torch_function__(func, types, args, kwargs or {})

    def watched_loss(model, batch):
        loss, metrics = copy_loss(model, batch)
        steps.append(None)
        return loss, {**metrics, "watched": metrics["accuracy"].as_subclass(Watched)}

    tiny_fit(cfg, tmp_path, watched_loss)
    assert read_at == {3, 5, 10}
    rows = [r for r in read_jsonl(tmp_path / "results.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [5, 10] and all(r["watched"] == r["accuracy"] for r in rows)


@pytest.mark.slow  # trains, then resumes
def test_a_checkpoint_damaged_after_it_was_written_is_refused(compose_cfg, tmp_path):
    """Bytes zeroed inside last.pt used to load and resume on damaged optimizer state: the file's
    SHA-256, written with it, is checked on load."""
    train(compose_cfg, tmp_path / "ok", "trainer.max_steps=2")
    path = tmp_path / "ok/checkpoints/last.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(64)  # zeroed in the middle, the length kept
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="corrupt: its SHA-256 does not match") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    buf = io.BytesIO()  # a checkpoint of the first format (no checksum, a partial fingerprint)
    torch.save({"format": "repro-checkpoint-v1", "step": 2}, buf)
    (tmp_path / "v1.pt").write_bytes(buf.getvalue())
    with pytest.raises(ConfigError, match="first format.*train afresh"):
        load_checkpoint(tmp_path / "v1.pt")
    whole = (tmp_path / "ok/checkpoints/last.pt")
    train(compose_cfg, tmp_path / "cut", "trainer.max_steps=2")  # its checksum trailer cut off
    cut = tmp_path / "cut/checkpoints/last.pt"
    cut.write_bytes(cut.read_bytes()[:-(len(b"\nrepro-sha256:") + 65)])  # the torch file whole, no trailer
    with pytest.raises(ConfigError, match="has lost its checksum"):
        load_checkpoint(cut)
    assert whole.is_file()


@pytest.mark.slow  # trains, then resumes
@pytest.mark.parametrize("change", ["seed=1", "task.max_len=12"])
def test_a_resume_with_another_setting_of_the_run_is_refused(compose_cfg, tmp_path, change):
    """The seed, the task's settings, the optimizer and the precision are the run's own: a resume
    that changes one is another run (it used to be accepted and labelled as this one). What may
    change (MAY_CHANGE_ON_RESUME: limits, logging, evaluation cadence, where results go) does."""
    train(compose_cfg, tmp_path / "ok", "trainer.max_steps=2")
    key = change.split("=")[0]
    with pytest.raises(ConfigError, match=f"does not match this run: {re.escape(key)} is"):
        train(compose_cfg, tmp_path / "x", "trainer.max_steps=3", change, f"trainer.resume={tmp_path / 'ok'}")
    rows = train(compose_cfg, tmp_path / "y", "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=1",
                 "trainer.max_time_s=600", f"trainer.resume={tmp_path / 'ok'}")
    assert rows[-1]["status"] == "ok" and rows[-1]["steps"] == 3


def test_the_fingerprint_holds_every_setting_but_those_a_resume_may_change(compose_cfg):
    """The optimizer, its schedule and the precision are in it (with the seed and the task's
    settings, tried end to end above); limits, cadence, logging and device are not."""
    from repro.training.parts import default_fingerprint

    base = default_fingerprint(compose_cfg(*BASE))
    for change in ("trainer.optimizer.lr=0.001", "trainer.precision=bfloat16", "trainer.grad_clip=0.5",
                   "trainer.scheduler.gamma=0.5", "model.dropout=0.2", "attention=softmax"):
        assert default_fingerprint(compose_cfg(*BASE, change)) != base, change
    for change in ("trainer.max_steps=7", "trainer.max_time_s=60", "trainer.log_every=3", "trainer.eval_every=2",
                   "trainer.checkpoint_every=4", "trainer.progress=false", "logger=csv", "device=cpu",
                   "task.label=x"):
        assert default_fingerprint(compose_cfg(*BASE, change)) == base, change


@pytest.mark.slow  # trains, then resumes
def test_csv_metrics_carry_on_across_a_resume(compose_cfg, tmp_path):
    """logger=csv: a resumed run's metrics.csv starts with the earlier run's rows up to the
    checkpoint (it used to start afresh, the steps before the resume gone), in a new run dir and
    continuing in place; rows a killed run logged past its checkpoint are replaced."""
    import pandas as pd

    csv = ["logger=csv", "trainer.log_every=1", "trainer.eval_every=0", "trainer.scheduler.milestones=[6]"]
    train(compose_cfg, tmp_path / "whole", *csv, "trainer.max_steps=8")
    train(compose_cfg, tmp_path / "first", *csv, "trainer.max_steps=4")
    whole = pd.read_csv(tmp_path / "whole/metrics.csv")
    with open(tmp_path / "first/metrics.csv", "a") as f:  # as if killed after logging step 5
        f.write(",".join(str(v) for v in whole.iloc[4].tolist()).replace("nan", "") + "\n")
    train(compose_cfg, tmp_path / "rest", *csv, "trainer.max_steps=8", f"trainer.resume={tmp_path / 'first'}")
    rest = pd.read_csv(tmp_path / "rest/metrics.csv")
    train_rows = lambda df: df[df["train/loss"].notna()]  # the final row: no train/loss
    assert train_rows(rest).step.tolist() == train_rows(whole).step.tolist() == list(range(1, 9))
    pd.testing.assert_series_equal(train_rows(rest)["train/loss"].reset_index(drop=True),
                                   train_rows(whole)["train/loss"].reset_index(drop=True))
    assert rest.step.tolist() == whole.step.tolist()  # the first run's final row is not carried on


def test_step_timing_carries_a_checkpoints_times_only_when_no_step_was_trained():
    """The final row's step times: this process's (warm-up steps left out); a resume that trained
    nothing reports its checkpoint's; one that trained steps but timed none (stopped before its
    first sync point) reports none rather than the earlier process's as its own."""
    from repro.training.parts import WARMUP_STEPS, step_timing
    before = {"time_per_step_ms": 9.0, "time_per_step_mean_ms": 9.5, "cpu_time_per_step_ms": 8.0}
    own = step_timing([1.0] * WARMUP_STEPS + [0.002, 0.004, 0.003], [0.001] * (WARMUP_STEPS + 3), 6, before)
    assert own == pytest.approx({"time_per_step_ms": 3.0, "time_per_step_mean_ms": 3.0, "cpu_time_per_step_ms": 1.0})
    assert step_timing([], [], 0, before) == before
    assert set(step_timing([], [], 2, before).values()) == {None}
