"""DDP through torchrun on CPU (gloo): two processes on halves of the global batch take the same
steps as one process on the whole batch, share one Hydra run dir, and resume exactly."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from repro.common.errors import ConfigError
from repro.common.results import read_jsonl
from repro.tasks.copy import run
from repro.training import load_checkpoint
from repro.training.distributed import RankShard, shard

REPO = Path(__file__).resolve().parents[2]
# A fixed copy length (min_copy = max_copy): every sequence scores as many tokens, so the mean of
# the two ranks' per-token means is the single process's mean, and the steps must agree.
BASE = ["experiment=smoke_copy", "attention=linear", "task.max_len=16", "task.batch_size=6", "task.min_copy=5",
        "task.max_copy=5", "model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.d_ff=16",
        "trainer.log_every=1", "trainer.eval_every=2", "trainer.eval_batches=1", "trainer.progress=false"]


def torchrun(cwd, *overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "run.py"), *BASE, *overrides]
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    dirs = [p.parent for p in (Path(cwd) / "outputs").glob("*/*/results.jsonl")]
    assert len(dirs) == 1, dirs  # both ranks wrote into the one dir rank 0 chose
    return dirs[0], read_jsonl(dirs[0] / "results.jsonl")


def by_step(rows, kind, key="loss"):
    return {r["step"]: r[key] for r in rows if r["kind"] == kind}


def single_process(compose_cfg, out, steps):
    run(compose_cfg(*BASE, f"trainer.max_steps={steps}", f"+task.out_dir={out}"))
    return read_jsonl(out / "results.jsonl")


def assert_same_steps(got, ref):
    for kind, key in [("train", "loss"), ("train", "accuracy"), ("eval", "loss")]:
        a, b = by_step(got, kind, key), by_step(ref, kind, key)
        common = sorted(set(a) & set(b))
        assert common and [a[s] for s in common] == pytest.approx([b[s] for s in common], rel=1e-5), (kind, key)


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(compose_cfg, tmp_path):
    ref = single_process(compose_cfg, tmp_path / "single", 3)
    (tmp_path / "ddp").mkdir()
    run_dir, rows = torchrun(tmp_path / "ddp", "trainer.max_steps=3")
    assert rows[-1]["world_size"] == 2 and rows[-1]["status"] == "ok"
    assert sorted(by_step(rows, "train")) == [1, 2, 3]  # one writer: no row twice
    assert_same_steps(rows, ref)
    ckpt = load_checkpoint(run_dir)
    assert ckpt["step"] == 3 and ckpt["world_size"] == 2 and len(ckpt["rng_ranks"]) == 2


def _worker(rank, port, out, queue):
    """One rank, forked from the test process (no re-import: fast): the run dir rank 0 resolves,
    then 3 steps, then a resume to 5 steps, both through the copy task and fit."""
    from hydra import compose, initialize_config_dir

    from repro.conf import CONF_DIR
    from repro.training import distributed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        argv = distributed.share_run_dir(["run.py", *BASE])

        def cfg(*extra):
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                return compose(config_name="config", overrides=[*BASE, *extra])

        run(cfg("trainer.max_steps=3", f"+task.out_dir={out / 'first'}"))
        run(cfg("trainer.max_steps=5", f"+task.out_dir={out / 'rest'}", f"trainer.resume={out / 'first'}"))
        queue.put((rank, argv[-1]))
    except BaseException as err:
        queue.put((rank, f"error: {type(err).__name__}: {err}"))
        raise
    finally:
        distributed.cleanup()


@pytest.mark.slow
def test_resume_under_ddp_continues_exactly(compose_cfg, tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, tmp_path, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    answers = dict(queue.get(timeout=5) for _ in procs)
    assert all(p.exitcode == 0 for p in procs), answers
    assert answers[0] == answers[1] and answers[0].startswith("hydra.run.dir=")  # rank 0's dir, on both
    ref = single_process(compose_cfg, tmp_path / "single", 5)
    rest = read_jsonl(tmp_path / "rest/results.jsonl")
    assert sorted(by_step(rest, "train")) == [1, 2, 3, 4, 5]
    assert_same_steps(rest, ref)


def test_shard_splits_the_global_batch_by_rank():
    batch = {"tokens": torch.arange(12).view(6, 2), "lens": [torch.arange(6)]}
    parts = [shard(batch, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([p["tokens"] for p in parts]), batch["tokens"])
    assert parts[1]["lens"][0].tolist() == [2, 3]
    with pytest.raises(ConfigError, match="batch of 6 cannot be split evenly over 4"):
        shard(batch, 0, 4)


def test_rank_shard_keeps_the_stream_state():
    from repro.data import CopyTask

    stream = RankShard(CopyTask(4, 16, seed=3), 1, 2)
    state = stream.state_dict()
    a = next(stream)
    stream.load_state_dict(state)
    whole = next(CopyTask(4, 16, seed=3))
    assert torch.equal(next(stream)["tokens"], a["tokens"]) and torch.equal(a["tokens"], whole["tokens"][2:])
    assert stream.vocab_size == 11 and stream.batches == 1
