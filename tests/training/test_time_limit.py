"""trainer.max_time_s: a run ends itself once its elapsed_s passes the limit, at a step boundary,
as at trainer.max_steps (a train row, an evaluation, the checkpoint, a final row with status
"stopped: time limit"), prints one line with the command that trains on, and exits 0; resumed with
a larger limit it trains on, with the same limit it trains nothing."""
import os
import shlex
import subprocess
import sys
from functools import partial

import pytest

from repro.common.results import REPO, read_jsonl
from repro.tasks.copy import run
from repro.training import load_checkpoint
from tests.training.test_training import BASE, tiny_fit

# eval_every beyond any step reached: the one evaluation is the one at the time limit
ARGS = ["experiment=smoke_copy", "attention=linear", "task.max_len=16", "task.batch_size=8", "model.n_layers=1",
        "trainer.log_every=1000", "trainer.eval_every=100000", "trainer.eval_batches=1", "trainer.max_steps=100000",
        "trainer.progress=false", "trainer.max_time_s=1.5"]


def steps_of(rows, kind):
    return [r["step"] for r in rows if r["kind"] == kind]


@pytest.mark.slow
def test_time_limit_from_the_command_line_ends_with_an_evaluation_a_checkpoint_and_exit_0(compose_cfg, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "0"}
    res = subprocess.run([sys.executable, "run.py", *ARGS, f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, text=True,
                         capture_output=True, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    rows = read_jsonl(run_dir / "results.jsonl")
    ckpt, final = load_checkpoint(run_dir), rows[-1]
    step = final["steps"]
    assert 1 < step < 100000 and final["status"] == "stopped: time limit"
    # at a step boundary: the checkpoint, the data stream and the last rows are all at that step
    assert ckpt["step"] == step and ckpt["data"]["batches"] == step
    assert steps_of(rows, "train") == [*range(1000, step, 1000), step] and steps_of(rows, "eval") == [step]
    assert final["eval_loss"] == rows[-2]["loss"] and rows[-2]["kind"] == "eval"  # the held-out metric, fresh
    assert 1.5 < ckpt["elapsed_s"] <= final["elapsed_s"] < 1.5 + 30  # passed, then stopped within a step or so
    line = [x for x in res.stdout.splitlines() if x.startswith("stopped at the time limit")]
    assert line == [f"stopped at the time limit trainer.max_time_s=1.5 at step {step}, {final['elapsed_s']:.1f} s "
                    f"of training: checkpoint {run_dir / 'checkpoints/last.pt'}; to train on, resume with a larger "
                    f"limit: python run.py {' '.join(ARGS[:-1])} trainer.max_time_s=3 trainer.resume={run_dir}"]

    # the printed command trains on (composed here, three more steps instead of 100,000)
    command = shlex.split(line[0].split("resume with a larger limit: ")[1])
    assert command[:2] == ["python", "run.py"]
    run(compose_cfg(*command[2:], f"trainer.max_steps={step + 3}", f"+task.out_dir={tmp_path / 'more'}"))
    more = read_jsonl(tmp_path / "more/results.jsonl")
    assert more[-1]["status"] == "ok" and more[-1]["steps"] == step + 3
    assert steps_of(more, "train") == steps_of(rows, "train") + [step + 3]
    assert [r["elapsed_s"] for r in more if r["step"] > step][0] > ckpt["elapsed_s"]


def test_resume_with_the_same_limit_trains_nothing_and_a_larger_one_trains_on(compose_cfg, tmp_path):
    cfg = partial(compose_cfg, *BASE, "trainer.max_steps=100000", "trainer.eval_every=0", "trainer.log_every=1000",
                  "trainer.checkpoint_every=0")
    tiny_fit(cfg("trainer.max_time_s=0.3"), tmp_path / "first")
    first = read_jsonl(tmp_path / "first/results.jsonl")
    step, at_stop = first[-1]["steps"], load_checkpoint(tmp_path / "first")["elapsed_s"]
    assert first[-1]["status"] == "stopped: time limit" and at_stop > 0.3

    same = tiny_fit(cfg("trainer.max_time_s=0.3", f"trainer.resume={tmp_path / 'first'}"), tmp_path / "same")
    assert same["status"] == "stopped: time limit" and same["steps"] == step and same["steps_this_process"] == 0
    timing = ("time_per_step_ms", "time_per_step_mean_ms", "cpu_time_per_step_ms")
    assert [same[k] for k in timing] == [first[-1][k] for k in timing] and first[-1]["time_per_step_ms"] > 0
    assert steps_of(read_jsonl(tmp_path / "same/results.jsonl"), "train") == steps_of(first, "train")

    more = tiny_fit(cfg(f"trainer.max_steps={step + 5}", "trainer.max_time_s=1000",
                        f"trainer.resume={tmp_path / 'first'}"), tmp_path / "more")
    assert more["status"] == "ok" and more["steps"] == step + 5 and more["steps_this_process"] == 5
    assert more["time_per_step_ms"] != first[-1]["time_per_step_ms"]  # its own steps' times, not the carried ones
    assert more["elapsed_s"] > at_stop


@pytest.mark.slow
def test_time_limit_under_ddp_ends_every_rank_at_the_same_step(tmp_path):
    """Each rank reads its own clock; the ranks agree (one collective a step, as for signals), so
    they stop together, without a hang, and rank 0's rows and checkpoint are at that step."""
    from tests.training.test_distributed import torchrun

    run_dir, rows = torchrun(tmp_path, "trainer.max_steps=100000", "trainer.eval_every=100000",
                             "trainer.log_every=1000", "trainer.max_time_s=1")
    final, ckpt = rows[-1], load_checkpoint(run_dir)
    assert final["status"] == "stopped: time limit" and final["world_size"] == 2 and final["elapsed_s"] > 1
    assert ckpt["step"] == final["steps"] == steps_of(rows, "eval")[-1] and ckpt["world_size"] == 2
