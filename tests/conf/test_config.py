"""Every config in conf/ composes; every attention config builds a working layer; loggers."""
import pytest
import torch
from hydra.utils import instantiate

from repro.attention import AttentionLayer
from repro.cli.preflight import preflight
from repro.common.errors import ConfigError
from repro.conf import CONF_DIR, compose_group, group_options
from repro.conf.attention import named_attentions
from repro.training.loggers import make_logger

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())


@pytest.mark.parametrize("group, option", [(g, o) for g in GROUPS for o in group_options(g)])
def test_every_config_composes(compose_cfg, group, option):
    cfg = compose_cfg(f"{group}={option}")
    if "model" not in cfg:  # the scorecard alone: each of its parts' runs chooses its own sizes
        assert cfg.task.name == "scorecard" and cfg.task.parts
        return
    # speech models (model=wsj*) hold one size node per encoder, the node `encoder` names
    sizes = cfg.model[cfg.model.encoder] if cfg.model.get("encoder") in cfg.model else cfg.model
    assert cfg.task._target_ and (sizes.get("d_model") or sizes.get("hidden")) > 0


@pytest.mark.parametrize("name", named_attentions())  # custom: tests/attention/test_conformance.py
def test_every_attention_config_builds_a_layer(name):
    layer = instantiate(compose_group("attention", name))(d_model=32, n_heads=4)
    assert isinstance(layer, AttentionLayer)
    assert layer.d_model == 32 and layer.n_heads == 4


def test_default_run_is_the_quick_benchmark_of_softmax_and_linear(compose_cfg):
    cfg = compose_cfg()
    assert cfg.task.name == "benchmark" and "attention" not in cfg
    assert {"softmax", "linear"} <= set(cfg.task.attentions)
    assert compose_cfg("attention=softmax").attention._target_.endswith("SoftmaxAttention")


def test_unknown_group_option_is_named():
    with pytest.raises(ConfigError, match="unknown attention 'nope'; valid: .*linear"):
        compose_group("attention", "nope")


@pytest.mark.parametrize("logger", ["none", "csv", "wandb"])
def test_loggers(compose_cfg, tmp_path, logger):
    overrides = [f"logger={logger}"] + (["logger.mode=disabled"] if logger == "wandb" else [])
    log = make_logger(compose_cfg(*overrides), tmp_path)
    log.log({"loss": 1.5}, step=0)
    log.log({"loss": 1.0, "acc": 0.5}, step=1)
    log.log_table("rows", [{"a": 1, "b": "x"}])
    log.finish()
    if logger == "csv":
        assert (tmp_path / "metrics.csv").read_text().splitlines() == ["step,loss,acc", "0,1.5,", "1,1.0,0.5"]


def test_wandb_offline_writes_a_local_run(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    log = make_logger(compose_cfg("logger=wandb", "logger.mode=offline"), tmp_path)
    log.log({"loss": torch.tensor(2.0).item()}, step=0)
    log.finish()
    assert list((tmp_path / "wandb").glob("offline-run-*"))


@pytest.mark.parametrize("task", ["copy", "mnist", "asr"])
def test_a_task_without_an_attention_says_so_in_one_line(compose_cfg, task):
    from repro.conf.attention import attention_name
    cfg = compose_cfg(f"task={task}", "~attention")
    with pytest.raises(ConfigError, match=f"^task={task} needs an attention: attention=<one of conf/attention>$"):
        attention_name(cfg)


def test_attention_name_without_hydra_is_the_entry_the_config_equals(compose_cfg):
    from repro.conf.attention import attention_name
    assert attention_name(compose_cfg("task=copy", "attention=softmax-math")) == "softmax-math"
    # a setting changed: still the entry it was built from (the closest of its class)
    assert attention_name(compose_cfg("task=copy", "attention=linear", "attention.eps=1e-3")) == "linear"
    assert attention_name(compose_cfg("task=copy", "attention=lsh-1", "attention.chunk_size=16")) == "lsh-1"


BAD_COMMAND_LINES = [
    (["experiment=smoke_copy", "model.d_model=65"], "d_model=65 is not divisible by n_heads=4"),
    (["experiment=smoke_copy", "model.n_heads=0"], "model.n_heads=0: must be a positive integer"),
    (["experiment=smoke_copy", "attention=lsh", "attention.chunk_size=0"],
     "lsh: chunk_size and n_hashes must be >= 1; got chunk_size=0"),
    (["experiment=smoke_copy", "attention=performer", "attention.n_features=0"],
     "performer: n_features must be >= 1; got 0"),
    (["experiment=smoke_copy", "attention=local", "attention.window=0"], "local: window must be >= 1; got 0"),
    (["experiment=smoke_copy", "task.max_len=abc"], "task.max_len='abc': expected an integer (preset: 24)"),
    (["experiment=smoke_mnist", "task.batch_size=2.5"], "task.batch_size=2.5: expected an integer (preset: 16)"),
    (["experiment=smoke_copy", "seed=abc"], "seed='abc': expected an integer (preset: 0)"),
    (["experiment=smoke_copy", "seed=1.5"], "seed=1.5: expected an integer (preset: 0)"),
    (["experiment=smoke_copy", "trainer.lr=-1"],
     "trainer.lr is not a setting of this config; nearest: trainer.optimizer.lr"),
    (["-m", "experiment=smoke_copy", "seed=0,abc"], "seed='abc': expected an integer (preset: 0)"),
    # with the progress bar on (the default): the line is the error alone, not the bar's line
    (["experiment=smoke_copy", "attention=linformer"],
     "attention linformer is non-causal only and task=copy is autoregressive"),
    (["experiment=smoke_benchmark", "attention=bigbird"], "attention bigbird is non-causal only and task.causal=true"),
    (["experiment=smoke_benchmark", "attention=gla", "task.causal=false"],
     "attention gla is causal only and task.causal=false; use an attention with a non-causal form"),
    (["experiment=smoke_asr", "attention=delta"], "attention delta is causal only and task=asr is non-causal"),
    (["experiment=smoke_copy", "attention=retention", "attention.gammas=[0.5]"],
     "retention: gammas must be 4 decays in (0, 1], one per head; got [0.5]"),
]


@pytest.mark.parametrize("args, message", BAD_COMMAND_LINES, ids=[" ".join(a) for a, _ in BAD_COMMAND_LINES])
def test_a_bad_command_line_is_one_line_before_anything_runs(tmp_path, args, message):
    """Through run.py as a user types it: exit 2, one line on stderr naming the bad value and
    what is valid, no traceback, and no run directory left behind."""
    import os
    import subprocess
    import sys

    from repro.common.results import REPO

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "run.py"), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("error: "), proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stdout + proc.stderr
    assert not list(tmp_path.iterdir())  # no outputs/ or multirun/ dir made for a command that fails


def test_nearest_key_prefers_the_same_name(compose_cfg):
    from repro.cli.preflight import nearest_key

    cfg = compose_cfg("experiment=smoke_copy")
    assert nearest_key(cfg, "trainer.lr") == "trainer.optimizer.lr"
    assert nearest_key(cfg, "trainer.max_step") == "trainer.max_steps"
    assert nearest_key(cfg, "model.zzzz_qqq") is None


@pytest.mark.parametrize("override", ["trainer.eval_every=${trainer.max_steps}", "trainer.scheduler.milestones.0=100",
                                      "model.dropout=0", "model.dropout=0.0"])
def test_valid_overrides_that_look_odd_pass_the_command_line_check(override):
    """An interpolation, a list item and a zero dropout are the user's to set (they were refused)."""

    argv = ["experiment=smoke_copy", override]
    assert preflight(argv) == argv


# Settings where 0 is a valid choice: off (eval_every, checkpoint_every, the SpecAugment masks,
# beam_size: greedy), none (dropout, warmup, patience), all (n_samples), a seed
ZERO_IS_VALID = {"eval_every", "checkpoint_every", "dropout", "embedding_dropout", "warmup",
                 "n_samples", "patience", "time_mask", "freq_mask", "n_masks", "eval_seed", "seed", "beam_size"}


def _numeric_keys(cfg):
    from omegaconf import OmegaConf

    out = []

    def walk(node, prefix):
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict):
                walk(v, key)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append(key)
    container = OmegaConf.to_container(cfg, resolve=False)
    walk({k: v for k, v in container.items() if k in ("task", "trainer", "model", "attention")}, "")
    return out


@pytest.mark.slow  # composes every preset with each bad value: about 25 s
def test_every_numeric_option_refuses_zero_negative_and_non_finite_values_in_one_line():
    """Every number of every task's config, set to 0, -1, nan and inf: refused before any work
    (repro.cli.validate, which run.py calls before Hydra starts) with one line naming it, except
    0 where 0 means off, none or all. It used to go through for dozens of them (lr=-1,
    grad_clip=nan, a batch size of 0), failing later with a traceback or, worse, running."""
    from hydra import compose, initialize_config_dir

    from repro.cli.validate import validate

    seen = set()  # a key the tasks share (trainer.*, model.*) is tried in the first task that has it
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for task in ("copy", "mnist", "cifar", "asr", "benchmark", "throughput", "kernels"):
            keys = [k for k in _numeric_keys(compose("config", overrides=[f"task={task}"])) if k not in seen]
            seen.update(keys)
            assert task in ("cifar", "mnist") or len(keys) >= 3, (task, keys)
            _refused(compose, validate, task, keys)
    assert len(seen) > 60


@pytest.mark.parametrize("task,key", [("mnist", "task.resize"), ("mnist", "task.max_train"),
                                      ("copy", "trainer.scheduler.milestones"), ("copy", "trainer.eval_batches")])
def test_options_that_default_to_null_or_a_list_are_checked_too(task, key):
    """Keys the table above cannot walk (null by default, or a list): an image size of 0 used to
    end in a traceback, max_train=0 or -5 trained on (nearly) every image, a negative milestone
    never decayed the learning rate, and eval_batches=0 reported a NaN held-out loss as ok."""
    from hydra import compose, initialize_config_dir

    from repro.cli.validate import validate

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for value in ("0", "-5") if not key.endswith("milestones") else ("[-5]", "[0]"):
            cfg = compose("config", overrides=[f"task={task}", f"{key}={value}"])
            with pytest.raises(ConfigError) as err:
                validate(cfg)
            assert key.rsplit(".", 1)[-1] in str(err.value) and "\n" not in str(err.value)


def _refused(compose, validate, task, keys):
    for key in keys:
        for value in ("0", "-1", "nan", "inf"):
            if value == "0" and key.rsplit(".", 1)[-1] in ZERO_IS_VALID:
                continue
            cfg = compose("config", overrides=[f"task={task}", f"{key}={value}"])
            with pytest.raises(ConfigError) as err:
                validate(cfg)
            assert key.rsplit(".", 1)[-1] in str(err.value) and "\n" not in str(err.value), (task, key, value)
