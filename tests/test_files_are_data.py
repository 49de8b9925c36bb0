"""Files are data, never code. A checkpoint is read with torch.load(weights_only=True); a model is
built with the classes of the suite's configs and the command line, never with a `_target_` a
checkpoint names; a sweep imports no module that a config found on disk names; a second,
different sweep into a used sweep dir is refused. Each hostile file here would create a marker
file if its code ran: the marker stays absent, and the run ends in one line."""
import hashlib
import io
import json
import pickle
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from run_cli import ENV, SMOKE_COPY, run_py

from repro.cli import jobs
from repro.cli.callbacks import AggregateSweep
from repro.common.errors import ConfigError
from repro.common.results import read_jsonl
from repro.tasks import image
from repro.tasks.copy import run as copy_run
from repro.training.checkpoint import FORMAT, TRAILER, load_checkpoint, save_checkpoint


class Plant:
    """Unpickled, it opens (so creates) the marker file: code run by loading a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def with_checksum(data: bytes) -> bytes:
    """data with the trailer save_checkpoint writes: a valid one, as anyone can append."""
    return data + TRAILER + hashlib.sha256(data).hexdigest().encode() + b"\n"


def hostile(path, marker, kind="torch file"):
    """A file that runs code if unpickled: a torch.save'd checkpoint of this format with a valid
    checksum, or a bare pickle."""
    if kind == "torch file":
        buf = io.BytesIO()
        torch.save({"format": FORMAT, "step": 0, "config": {}, "model": {}, "rng": Plant(marker)}, buf)
        path.write_bytes(with_checksum(buf.getvalue()))
    else:
        path.write_bytes(pickle.dumps(Plant(marker)))
    return path


def one_error_line(res) -> str:
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert res.returncode == 2 and len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    return errors[0]


def tree(d):
    return sorted((str(p.relative_to(d)), p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*"))


# ----------------------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("kind", ["torch file", "bare pickle"])
def test_a_checkpoint_that_would_run_code_is_refused_unread(tmp_path, kind):
    marker = tmp_path / "marker"
    path = hostile(tmp_path / "last.pt", marker, kind)
    with pytest.raises(ConfigError) as err:
        load_checkpoint(path)
    assert not marker.exists()
    assert "is not data only" in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)
    assert ("(it names io.open)" if kind == "torch file" else "(Unsupported operand") in str(err.value)


@pytest.mark.slow  # run.py runs
@pytest.mark.parametrize("where", ["run dir named", "fresh run dir"])
def test_a_hostile_resume_runs_no_code_from_the_command_line(tmp_path, where):
    """trainer.resume=<hostile file>: refused before Hydra writes (a named run dir: repro.cli.rundir)
    or by the trainer (a fresh run dir, which is then removed)."""
    marker = tmp_path / "marker"
    path = hostile(tmp_path / "last.pt", marker)
    run_dir = tmp_path / "run" if where == "run dir named" else tmp_path / "runs" / "${now:%H%M%S%f}"
    res = run_py(*SMOKE_COPY, "trainer.max_steps=2", f"trainer.resume={path}", f"hydra.run.dir={run_dir}")
    assert not marker.exists()
    line = one_error_line(res)
    assert "is not data only" in line and str(path) in line
    assert not (tmp_path / "run").exists() and not any((tmp_path / "runs").glob("*/*"))


@pytest.mark.slow  # run.py runs
def test_a_hostile_checkpoint_to_sample_from_runs_no_code(tmp_path):
    """task.mode=sample task.checkpoint=<hostile file> used to run it, then fail with a KeyError."""
    marker = tmp_path / "marker"
    path = hostile(tmp_path / "last.pt", marker)
    res = run_py("task=mnist", "task.mode=sample", f"task.checkpoint={path}", "device=cpu",
                 f"hydra.run.dir={tmp_path / 'sampled'}")
    assert not marker.exists()
    assert "is not data only" in one_error_line(res)


def test_the_trainer_refuses_a_hostile_resume(compose_cfg, tmp_path):
    marker = tmp_path / "marker"
    path = hostile(tmp_path / "last.pt", marker)
    with pytest.raises(ConfigError) as err:
        copy_run(compose_cfg(*SMOKE_COPY, "trainer.max_steps=2", f"trainer.resume={path}",
                             f"+task.out_dir={tmp_path / 'run'}"))
    assert not marker.exists()
    assert "is not data only" in str(err.value)


def test_save_writes_plain_values_that_load_back_equal(tmp_path):
    """What a checkpoint holds beyond tensors (RNG tuples, a scheduler's Counter, a state_dict's
    OrderedDict and its _metadata, NumPy numbers) is written as values weights_only reads back."""
    sd = OrderedDict(w=torch.randn(3, 5))
    sd._metadata = {"": {"version": 2}}
    state = {"step": 7, "sd": sd, "milestones": Counter({6: 1, 9: 2}), "rng": (3, tuple(range(5)), None),
             "np": np.float64(0.25), "arr": np.arange(4, dtype=np.int32), "dir": Path("a/b"), "flags": {True, 1.5},
             "raw": b"\x00\x01", "z": 1 + 2j, "size": torch.Size([2, 3])}
    save_checkpoint(tmp_path / "c.pt", state)
    back = load_checkpoint(tmp_path / "c.pt")
    assert type(back["sd"]) is OrderedDict and back["sd"]._metadata == {"": {"version": 2}}
    assert torch.equal(back["sd"]["w"], sd["w"])
    assert type(back["milestones"]) is Counter and back["milestones"] == Counter({6: 1, 9: 2})
    assert back["milestones"][5] == 0  # a Counter still: MultiStepLR asks for steps that are no milestone
    assert back["rng"] == (3, (0, 1, 2, 3, 4), None) and type(back["np"]) is float and back["np"] == 0.25
    assert torch.equal(back["arr"], torch.arange(4, dtype=torch.int32)) and back["dir"] == str(Path("a/b"))
    assert back["flags"] == {True, 1.5} and back["raw"] == b"\x00\x01" and back["z"] == 1 + 2j
    assert back["size"] == torch.Size([2, 3]) and back["step"] == 7


def test_save_refuses_an_object_that_is_not_data(tmp_path):
    class Thing:
        pass

    with pytest.raises(TypeError, match=r"checkpoint\.last_eval\.x is a .*Thing: a checkpoint holds tensors"):
        save_checkpoint(tmp_path / "c.pt", {"step": 1, "last_eval": {"x": Thing()}})
    assert not (tmp_path / "c.pt").exists()


def test_a_checkpoint_holding_pickled_objects_is_one_line_saying_what_to_do(tmp_path):
    """A checkpoint of this format written with a pickled object in it (a NumPy scalar in its last
    evaluation) is refused, not unpickled: the line names the object and what to do."""
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "step": 3, "last_eval": {"loss": np.float64(2.5)}}, buf)
    (tmp_path / "old.pt").write_bytes(with_checksum(buf.getvalue()))
    with pytest.raises(ConfigError, match=r"not data only \(it names numpy.*resume from a checkpoint this suite "
                                          r"wrote, or train afresh") as err:
        load_checkpoint(tmp_path / "old.pt")
    assert "\n" not in str(err.value)


def test_a_checkpoint_without_what_a_run_writes_is_one_line(compose_cfg, tmp_path):
    """Plain data but no config (it used to end in KeyError: 'config'), or no optimizer state."""
    save_checkpoint(tmp_path / "c.pt", {"step": 1, "model": {}})
    with pytest.raises(ConfigError, match="holds no config: it was not written by a training run"):
        image.run(compose_cfg("task=mnist", "task.mode=sample", f"task.checkpoint={tmp_path / 'c.pt'}",
                              f"+run_dir={tmp_path / 's'}"))
    with pytest.raises(ConfigError, match="holds no optimizer, data, rng, fingerprint"):
        copy_run(compose_cfg(*SMOKE_COPY, "trainer.max_steps=2", f"trainer.resume={tmp_path / 'c.pt'}",
                             f"+task.out_dir={tmp_path / 'run'}"))


def test_a_missing_checkpoint_to_sample_from_names_task_checkpoint(compose_cfg, tmp_path):
    """It used to be reported as trainer.resume=..., an option the user never gave."""
    with pytest.raises(ConfigError) as err:
        image.run(compose_cfg("task=mnist", "task.mode=sample", f"task.checkpoint={tmp_path / 'nowhere'}",
                              f"+run_dir={tmp_path / 's'}"))
    assert str(err.value).startswith(f"task.checkpoint='{tmp_path / 'nowhere'}': no checkpoint at ")
    assert "trainer.resume" not in str(err.value)


# ----------------------------------------------------------------------------- a checkpoint's saved config

SAMPLE = ("task=mnist", "attention=linear", "model=tiny", "task.dataset=digits8", "task.n_layers=1", "device=cpu")


def trained_checkpoint(compose_cfg, path, attention=None, **model):
    """A checkpoint as an image run writes it (a tiny linear model, its saved config), its saved
    attention replaced by `attention` where given."""
    cfg = compose_cfg(*SAMPLE)
    saved = OmegaConf.to_container(cfg, resolve=True)
    if attention is not None:
        saved["attention"] = attention
    saved["model"].update(model)
    net = image.build_model(cfg)
    save_checkpoint(path, {"step": 5, "model": net.state_dict(), "config": saved})
    return path


def tampered(marker):
    return {"os.system": {"_target_": "os.system", "_args_": [f"touch {marker}"]},
            "a marker-writing callable": {"_target_": "builtins.open", "file": str(marker), "mode": "w"}}


@pytest.mark.slow  # trains, then run.py resumes
@pytest.mark.parametrize("how", ["os.system", "a marker-writing callable"])
def test_a_tampered_saved_config_builds_nothing_it_names(compose_cfg, tmp_path, how):
    marker = tmp_path / "marker"
    path = trained_checkpoint(compose_cfg, tmp_path / "last.pt", attention=tampered(marker)[how])
    res = run_py(*SAMPLE, "task.mode=sample", f"task.checkpoint={path}", f"hydra.run.dir={tmp_path / 'sampled'}")
    assert not marker.exists()
    line = one_error_line(res)
    target = tampered(marker)[how]["_target_"]
    assert (f"was trained with attention._target_='{target}', this run composes "
            f"attention._target_='repro.attention.LinearAttention'") in line and "no entry builds it" in line


def test_a_saved_target_in_the_model_settings_is_refused_too(compose_cfg, tmp_path):
    marker = tmp_path / "marker"
    path = trained_checkpoint(compose_cfg, tmp_path / "last.pt", extra=tampered(marker)["os.system"])
    with pytest.raises(ConfigError, match=r"model\.extra\._target_='os\.system', this run composes "
                                          r"model\.extra\._target_=None"):
        image.run(compose_cfg(*SAMPLE, "task.mode=sample", f"task.checkpoint={path}", f"+run_dir={tmp_path / 's'}"))
    assert not marker.exists()


def test_sampling_needs_the_attention_it_was_trained_with_and_keeps_its_settings(compose_cfg, tmp_path, monkeypatch):
    """Another attention composed now is refused naming both (and the entries that build the
    checkpoint's); the one it was trained with samples, its saved settings kept."""
    trained = OmegaConf.to_container(compose_cfg(*SAMPLE).attention, resolve=True)
    trained["eps"] = 1e-3  # a setting of the trained attention: data, kept
    path = trained_checkpoint(compose_cfg, tmp_path / "last.pt", attention=trained)
    with pytest.raises(ConfigError, match=r"attention\._target_='repro\.attention\.LinearAttention', this run "
                                          r"composes attention\._target_='repro\.attention\.SoftmaxAttention'.*"
                                          r"\(conf/attention: attention=linear\)"):
        image.run(compose_cfg(*SAMPLE, "attention=softmax", "task.mode=sample", f"task.checkpoint={path}",
                              f"+run_dir={tmp_path / 'x'}"))
    built = []
    real = image.build_model

    def spy(cfg, *a):
        model = real(cfg, *a)
        built.append(model)
        return model

    monkeypatch.setattr(image, "build_model", spy)
    image.run(compose_cfg(*SAMPLE, "task.mode=sample", f"task.checkpoint={path}", "task.n_samples=1",
                          f"+run_dir={tmp_path / 's'}"))
    from repro.attention import LinearAttention

    layers = [m for m in built[0].modules() if isinstance(m, LinearAttention)]
    assert layers and all(m.eps == 1e-3 for m in layers)
    assert read_jsonl(tmp_path / "s" / "results.jsonl")[0]["status"] == "ok"


# ----------------------------------------------------------------------------- sweeps

PLANTED = "import pathlib\npathlib.Path({marker!r}).write_text('imported')\n\ndef run(cfg):\n    return 0.0\n\n" \
          "def aggregate(rows, out_dir):\n    pathlib.Path({marker!r}).write_text('aggregated')\n"


def plant_job(sweep, name, module_dir, marker, rows=None):
    """A job folder whose .hydra/config.yaml names a module that writes the marker when imported
    (and rows, where given)."""
    module_dir.mkdir(parents=True, exist_ok=True)
    (module_dir / "plantedmod.py").write_text(PLANTED.format(marker=str(marker)))
    job = sweep / name
    (job / ".hydra").mkdir(parents=True, exist_ok=True)
    (job / ".hydra" / "config.yaml").write_text("task:\n  _target_: plantedmod.run\n  name: plantedmod\n")
    if rows is not None:
        (job / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_sweep_summary_imports_no_module_a_job_folder_names(compose_cfg, tmp_path, monkeypatch):
    """The aggregate comes from the running sweep's config and the suite's conf/task: a job whose
    .hydra/config.yaml was replaced has its copy rows summarised by the copy task's own module;
    rows of a task no trusted config names are gathered, summarised by nothing; the module the
    planted configs name is never imported."""
    sweep, marker = tmp_path / "sweep", tmp_path / "marker"
    monkeypatch.setattr(jobs, "summary_error", None)
    cfg = compose_cfg(*SMOKE_COPY, "trainer.max_steps=1", "trainer.checkpoint=false")
    copy_run(compose_cfg(*SMOKE_COPY, "trainer.max_steps=1", "trainer.checkpoint=false",
                         f"+task.out_dir={sweep / '0'}"))
    plant_job(sweep, "0", tmp_path / "mods", marker)
    plant_job(sweep, "1", tmp_path / "mods", marker, [{"task": "plantedmod", "kind": "final"}])
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))  # importable, were anything to import it
    config = OmegaConf.create({**OmegaConf.to_container(cfg),
                               "hydra": {"sweep": {"dir": str(sweep)}, "overrides": {"task": list(SMOKE_COPY)}}})
    AggregateSweep().on_multirun_end(config)
    assert not marker.exists() and jobs.summary_error is None
    assert (sweep / "copy_final.csv").is_file() and read_jsonl(sweep / "plantedmod.jsonl")[0]["task"] == "plantedmod"


@pytest.mark.slow
def test_a_sweep_into_a_folder_with_a_planted_job_runs_no_code(tmp_path):
    sweep, marker = tmp_path / "sweep", tmp_path / "marker"
    plant_job(sweep, "7", tmp_path / "mods", marker, [{"task": "plantedmod", "kind": "final"}])
    before = tree(sweep)
    res = run_py(*SMOKE_COPY, "trainer.max_steps=1", "trainer.checkpoint=false", f"hydra.sweep.dir={sweep}",
                 multirun=True, env={**ENV, "PYTHONPATH": str(tmp_path / "mods")})
    assert not marker.exists()
    line = one_error_line(res)
    assert tree(sweep) == before
    assert f"{sweep} already holds runs ({sweep / '7'}) and no readable record of the sweep" in line


@pytest.mark.slow
def test_another_sweep_into_a_used_sweep_dir_is_refused_and_the_same_one_resumes(tmp_path):
    """A second, different sweep into a sweep dir would mix both sweeps' rows in one table and
    count both sweeps' jobs: refused before Hydra writes. The same sweep run again (a resume may
    raise trainer.max_steps) resumes each of its jobs."""
    sweep = tmp_path / "sweep"
    args = [*SMOKE_COPY, f"hydra.sweep.dir={sweep}"]
    first = run_py(*args, "trainer.max_steps=2", "seed=0,1", multirun=True)
    assert first.returncode == 0, first.stderr[-2000:]
    before = tree(sweep)
    other = run_py(*args, "trainer.max_steps=2", "seed=2", multirun=True)
    line = one_error_line(other)
    assert f"{sweep} already holds another sweep (" in line and "seed=0,1), not this one (" in line
    assert "seed=2)" in line and tree(sweep) == before
    again = run_py(*args, "trainer.max_steps=3", "seed=0,1", multirun=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("this sweep job has a checkpoint; resuming it") == 2
    finals = [r for r in read_jsonl(sweep / "copy.jsonl") if r["kind"] == "final"]
    assert sorted((r["seed"], r["steps"]) for r in finals) == [(0, 3), (1, 3)]
