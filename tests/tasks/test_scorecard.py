"""The scorecard (repro/tasks/scorecard.py, repro/reproduction/report/scorecard.py): every causal
attention composes the card's sweep and every run it plans passes run.py's checks; the card's
verdicts against a direct Welch interval from scipy; references reused by a second card; a failed
part recorded while the others go on; and (slow) the quick card end to end on a user's class and
on a broken one."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from scipy import stats

from repro.common import results
from repro.common.errors import RunFailed
from repro.conf import CONF_DIR
from repro.conf.attention import build_attention, named_attentions
from repro.reproduction.report import scorecard as card
from repro.tasks import scorecard

REPO = Path(__file__).resolve().parents[2]
PARTS = "conformance,figure1,copy,mnist,speech,generation"


def composed(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def causal_attentions() -> list[str]:
    from repro.attention.noncausal import NonCausalAttention

    out = []
    for name in named_attentions():
        cfg = composed(f"attention={name}")
        if not isinstance(build_attention(cfg, 64, 4), NonCausalAttention):
            out.append(name)
    return out


CAUSAL = causal_attentions()


def test_the_causal_attentions_are_found():
    assert {"softmax", "linear", "gla", "delta", "retention", "lsh-4"} <= set(CAUSAL)
    assert "linformer" not in CAUSAL


@pytest.mark.parametrize("name", CAUSAL)
def test_every_causal_attention_composes_the_card(name):
    """The sweep of both presets composes, and every run the card plans for the attention passes
    run.py's own checks (repro.cli.preflight: keys, types, the composed config, the attention
    built at each task's width)."""
    from repro.cli.preflight import preflight

    plans = []
    for experiment in ("scorecard", "scorecard_quick"):
        cfg = composed(f"experiment={experiment}", f"attention={name}")
        assert cfg.task._target_ == "repro.tasks.scorecard.run"
        assert cfg.hydra.sweeper.params["task.part"] == PARTS
        assert cfg.hydra.sweep.subdir == cfg.task.part == "conformance"  # a job dir per part
        assert str(cfg.hydra.sweep.dir).startswith(f"multirun/{experiment}/{name}/")
        assert cfg.task.quick == (experiment == "scorecard_quick")
        for part in PARTS.split(","):
            runs, skip = scorecard.plan(cfg, part, [f"attention={name}"])
            assert runs or skip, part
            if experiment == "scorecard" or name == "linear":  # the quick preset's runs: once
                plans += [r["overrides"] for r in runs if r["role"] == scorecard.SUBJECT][:1]
            if part != "conformance" and runs:
                timed = {"linear-torch"} if part in ("figure1", "generation") else set()
                assert {r["role"] for r in runs} == {scorecard.SUBJECT, "linear", "softmax"} | timed
    for overrides in plans:
        assert preflight(overrides) == overrides, overrides


def test_the_speech_part_runs_both_directions_or_says_why_not():
    cfg = composed("experiment=scorecard", "attention=gla")
    runs, skip = scorecard.plan(cfg, "speech", ["attention=gla"])
    assert skip is None and "++attention.bidirectional=true" in runs[0]["overrides"]
    cfg = composed("experiment=scorecard", "attention=lsh-4")
    assert scorecard.plan(cfg, "speech", ["attention=lsh-4"])[1] is None  # LSH has a non-causal form
    cfg = composed("experiment=scorecard", "attention=lsh-4")
    runs, skip = scorecard.plan(cfg, "generation", ["attention=lsh-4"])
    assert runs == [] and "no recurrent form" in skip


def test_the_timed_parts_run_linear_on_its_pytorch_path_too():
    """Figure 1 and generation time linear twice: its default path and REPRO_KERNEL=torch (the
    same overrides otherwise); the trained parts do not."""
    cfg = composed("experiment=scorecard", "attention=delta")
    for part in ("figure1", "generation"):
        runs, _ = scorecard.plan(cfg, part, ["attention=delta"])
        by = {r["role"]: r for r in runs}
        assert by["linear-torch"]["overrides"] == by["linear"]["overrides"]
        assert by["linear-torch"]["env"] == {"REPRO_KERNEL": "torch"} and by["linear"]["env"] == {}
    runs, _ = scorecard.plan(cfg, "copy", ["attention=delta"])
    assert "linear-torch" not in {r["role"] for r in runs}
    with open_dict(cfg):
        cfg.task.torch_path = []
    assert "linear-torch" not in {r["role"] for r in scorecard.plan(cfg, "figure1", ["attention=delta"])[0]}
    with open_dict(cfg):
        cfg.task.torch_path, cfg.task.references = ["figure1"], ["softmax"]  # no linear: nothing to pair it with
    assert "linear-torch" not in {r["role"] for r in scorecard.plan(cfg, "figure1", ["attention=delta"])[0]}


# ----------------------------------------------------------------------------- the card from hand-made parts

def part(name, measures, seeds=(0, 1, 2), status="ok", reason=None, **extra):
    return {"task": "scorecard", "part": name, "attention": "mine", "target": "pkg.Mine", "status": status,
            "reason": reason, "quick": False, "references": ["linear", "softmax"], "seeds": list(seeds),
            "tolerance": {"copy": 0.01, "mnist": 0.02, "speech": 1.0}, "machine": "a test CPU",
            "commit": "abc123", "command": "python run.py -m experiment=scorecard attention=mine",
            "runs": [], "measures": measures, "conformance": [], **extra}


def values(role, measure, vals, judged=True, cell=None, unit="nats/symbol"):
    return [{"measure": measure, "cell": cell, "value": v, "unit": unit, "judged": judged, "lower_is_better": True,
             "role": role, "seed": s} for s, v in enumerate(vals)]


def welch_interval(a, b):
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    return float(ci.low), float(ci.high)


def write_parts(folder: Path, *summaries):
    folder.mkdir(parents=True, exist_ok=True)
    for s in summaries:
        (folder / f"scorecard_{s['part']}.json").write_text(json.dumps(s))


def test_card_verdicts_match_a_direct_welch_interval(tmp_path):
    rng = np.random.default_rng(7)
    mine = list(0.050 + 0.002 * rng.standard_normal(3))      # close to softmax, far below linear
    softmax = list(0.048 + 0.002 * rng.standard_normal(3))
    linear = list(0.300 + 0.010 * rng.standard_normal(3))
    far = list(0.9 + 0.3 * rng.standard_normal(3))           # a wide spread: undecided against both
    copy = part("copy", values("attention", "held-out loss", mine, cell="N = 64")
                + values("linear", "held-out loss", linear, cell="N = 64")
                + values("softmax", "held-out loss", softmax, cell="N = 64"))
    mnist = part("mnist", values("attention", "held-out bits/dim", far, unit="bits/dim")
                 + values("linear", "held-out bits/dim", [0.95, 0.97, 0.96], unit="bits/dim")
                 + values("softmax", "held-out bits/dim", [0.90, 0.91, 0.92], unit="bits/dim"))
    write_parts(tmp_path / "sweep", copy, mnist)
    text = card.build(tmp_path / "sweep", tmp_path / "out")
    rows = {(r["part"], r["measure"]): r for r in card.measure_rows("copy", copy) + card.measure_rows("mnist", mnist)}

    lo, hi = welch_interval(mine, softmax)
    assert 0 < hi <= 0.01  # the data are what the test says: within the tolerance, not below 0
    verdict, why = rows[("copy", "held-out loss, N = 64")]["vs softmax"]
    assert verdict == "as good as softmax" and f"[{lo:.3g}, {hi:.3g}]" in why
    lo, hi = welch_interval(mine, linear)
    assert hi < 0
    verdict, why = rows[("copy", "held-out loss, N = 64")]["vs linear"]
    assert verdict == "better than linear" and f"[{lo:.3g}, {hi:.3g}]" in why
    for ref, ref_vals in (("softmax", [0.90, 0.91, 0.92]), ("linear", [0.95, 0.97, 0.96])):
        lo, hi = welch_interval(far, ref_vals)
        assert lo < 0 < hi and hi > 0.02
        verdict, why = rows[("mnist", "held-out bits/dim")][f"vs {ref}"]
        assert verdict == "undecided" and f"[{lo:.3g}, {hi:.3g}]" in why and "could detect" in why
    # the page: the verdicts with their intervals, the seeds' warning, machine, commit, command
    assert "**as good as softmax**" in text and "**better than linear**" in text and "**undecided**" in text
    assert "3 seeds a side" in text and "wide" in text
    assert "a test CPU" in text and "abc123" in text and "experiment=scorecard attention=mine" in text
    assert (tmp_path / "out" / "scorecard.md").read_text() == text
    assert (tmp_path / "out" / "scorecard.png").stat().st_size > 1000
    csv = pd.read_csv(tmp_path / "out" / "scorecard.csv")
    mine_row = csv[(csv.part == "copy") & (csv.role == "attention")].iloc[0]
    assert mine_row.vs_softmax.startswith("as good as softmax") and mine_row.n == 3
    assert not (tmp_path / "sweep" / "scorecard.md").exists()  # --out: written there, not into the sweep dir


def test_a_published_card_names_its_folders_as_the_command_did(tmp_path):
    """Published elsewhere, a card keeps the sweep folder and the runs' logs relative to the
    directory the command ran in, not that machine's absolute paths; its page shows the figure."""
    ran_in = tmp_path / "checkout"
    sweep = ran_in / "multirun" / "scorecard" / "mine" / "pkg.Mine"
    runs = [{"role": "attention", "seed": s, "status": "ok",
             "dir": f"multirun/scorecard/mine/pkg.Mine.runs/copy/attention-N64-seed{s}",
             "log": str(sweep / "copy" / "logs" / f"0{s}-attention-N64-seed{s}.log")} for s in range(3)]
    runs.append({"role": "linear", "seed": 0, "status": "ok", "dir": "outputs/scorecard_refs/abc/x",
                 "log": str(ran_in / "multirun" / "scorecard" / "other" / "pkg.Other" / "copy" / "logs" / "03.log")})
    runs.append({"role": "softmax", "seed": 0, "status": "ok", "dir": "/elsewhere/y", "log": "/elsewhere/y.log"})
    copy = part("copy", values("attention", "held-out loss", [0.05, 0.051, 0.052], cell="N = 64")
                + values("linear", "held-out loss", [0.3, 0.31, 0.29], cell="N = 64"), runs=runs)
    figure1 = part("figure1", [{"measure": "time per sample", "cell": "N = 512", "value": 1.0, "unit": "ms",
                                "judged": False, "lower_is_better": True, "role": "attention", "seed": None,
                                "n": 512}])
    write_parts(sweep, copy, figure1)
    text = card.build(sweep, tmp_path / "published")
    assert "Folder: `multirun/scorecard/mine/pkg.Mine`" in text and str(tmp_path) not in text
    logs = [r["log"] for r in json.loads((tmp_path / "published" / "scorecard_copy.json").read_text())["runs"]]
    assert logs == [f"multirun/scorecard/mine/pkg.Mine/copy/logs/0{s}-attention-N64-seed{s}.log" for s in range(3)] \
        + ["multirun/scorecard/other/pkg.Other/copy/logs/03.log", "/elsewhere/y.log"]  # outside it: as recorded
    assert "](scorecard.png)" in text  # published into a new folder, the page still shows its figure
    rebuilt = card.build(tmp_path / "published")  # rebuilt where it was published: the same page
    assert rebuilt == text


def test_worse_and_one_seed(tmp_path):
    worse = part("copy", values("attention", "held-out loss", [0.5, 0.51, 0.52])
                 + values("linear", "held-out loss", [0.1, 0.11, 0.12])
                 + values("softmax", "held-out loss", [0.01, 0.011, 0.012]))
    rows = card.measure_rows("copy", worse)
    assert rows[0]["vs linear"][0] == "worse than linear" and rows[0]["vs softmax"][0] == "worse than softmax"
    one = part("mnist", values("attention", "bpd", [0.9]) + values("linear", "bpd", [0.95])
               + values("softmax", "bpd", [0.9]), seeds=(0,), quick=True)
    write_parts(tmp_path, one)
    text = card.build(tmp_path)
    assert card.verdicts.MEASURED in text and "One seed a side" in text
    assert "smoke test" in text.splitlines()[0] and "**A smoke test**" in text


def test_a_time_measured_under_load_is_marked(tmp_path):
    """A run's load average rides with its times (tasks.scorecard.measures); the card marks a time
    whose run had more runnable processes than the machine's cores, and only that one."""
    rows = [{"task": "benchmark", "status": "ok", "n": 512, "time_per_sample_ms": 2.0, "mem_per_sample_mb": 1.0,
             "loadavg_1min_start": 1.2, "loadavg_1min_end": 3.4}]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = {m["measure"]: m for m in scorecard.measures("figure1", {"dir": tmp_path / "run", "cell": None})}
    assert got["time per sample"]["load"] == 3.4 and "load" not in got["peak memory per sample"]

    machine = {"machine": "AMD EPYC (2 cores, 1 threads)"}
    point = {"unit": "ms", "judged": False, "lower_is_better": True, "cell": None, "n": 512}
    figure1 = part("figure1", [{**point, "measure": "time per sample", "role": "attention", "value": 5.0, "load": 2.9},
                               {**point, "measure": "time per sample", "role": "linear", "value": 1.0, "load": 1.1},
                               {**point, "measure": "time per sample", "role": "softmax", "value": 3.0}], **machine)
    copy = part("copy", values("attention", "held-out loss", [0.1, 0.11, 0.12])
                + values("linear", "held-out loss", [0.2, 0.21, 0.22]) + values("softmax", "held-out loss", [0.01] * 3)
                + [{**v, "load": 2.5 if v["role"] == "linear" and v["seed"] == 1 else 1.0}
                   for r in ("attention", "linear", "softmax")
                   for v in values(r, "time per update", [30.0, 31.0, 32.0], judged=False, unit="ms")], **machine)
    write_parts(tmp_path / "sweep", figure1, copy)
    text = card.build(tmp_path / "sweep")
    assert "5 (loaded) · 1 · 3" in text  # the subject's point only: linear's load 1.1 is below 2 cores
    time_row = next(line for line in text.splitlines() if line.startswith("| time per update"))
    assert time_row.count("(loaded)") == 1 and "31 ± 1 (3 seeds) (loaded)" in time_row.split("|")[3]
    assert text.count(card.LOADED) == 2  # under Figure 1's table and under the copy task's
    csv = pd.read_csv(tmp_path / "sweep" / "scorecard.csv")
    marked = csv[csv.loaded.astype(str) == "True"]
    assert set(zip(marked.part, marked.role)) == {("figure1", "attention"), ("copy", "linear")}
    # no cores in the machine's name, or no load recorded: nothing is marked
    write_parts(tmp_path / "plain", {**figure1, "machine": "a test CPU"}, part("copy", copy["measures"][:9]))
    assert "(loaded)" not in card.build(tmp_path / "plain")


def test_a_folder_without_parts_is_one_line(tmp_path, capsys):
    from repro.reproduction.report.build import main

    with pytest.raises(SystemExit) as stop:
        main(["--scorecard", str(tmp_path)])
    assert str(stop.value).startswith("error: ") and "scorecard_<part>.json" in str(stop.value)
    assert "\n" not in str(stop.value)


# ----------------------------------------------------------------------------- the parts, run in process

FAKE_LOSS = {"attention": 0.05, "linear": 0.3, "linear-torch": 0.3, "softmax": 0.04}


class FakeRunPy:
    """Stands in for `python run.py ...`: writes the rows a finished run writes (a final row of the
    copy, MNIST or speech task), or fails as run.py does (`error: ...`, exit 1) for the attentions
    in `broken`. Counts the runs of each attention."""

    def __init__(self, broken=()):
        self.calls, self.broken = [], set(broken)

    def __call__(self, argv, log, env=None):
        args = dict(a.split("=", 1) for a in argv if "=" in a)
        where = Path(args["hydra.run.dir"])
        attention = args.get("attention", "?") + ("-torch" if (env or {}).get("REPRO_KERNEL") == "torch" else "")
        self.calls.append(attention)
        if attention in self.broken:
            log.write_text("Traceback (most recent call last):\n  File x\nerror: the run diverged: loss nan at step 3")
            return 1
        where.mkdir(parents=True, exist_ok=True)
        seed = int(args.get("seed", 0))
        role = "attention" if attention == "retention" else attention
        final = {"kind": "final", "steps": 10, "eval_loss": FAKE_LOSS[role] + 0.001 * seed, "eval_accuracy": 0.9,
                 "eval_bits_per_dim": 1 + FAKE_LOSS[role], "time_per_step_ms": 5.0}
        summary = {"kind": "summary", "steps": 10, "valid_per": 0.2 + FAKE_LOSS[role], "time_per_epoch_s": 3.0}
        ms = {"attention": 40.0, "linear": 10.0, "linear-torch": 20.0, "softmax": 30.0}[role]
        points = [{"task": "benchmark", "status": "ok", "n": n, "time_per_sample_ms": ms * n / 512,
                   "mem_per_sample_mb": 1.0, "saved_per_sample_mb": 0.5} for n in (512, 1024)]
        results.write_jsonl(where / "results.jsonl", [final, summary, *points])
        return 0


@pytest.fixture
def fake_run(monkeypatch, tmp_path):
    monkeypatch.setenv("REPRO_GIT_SHA", "c0ffee")
    results.git_sha.cache_clear()
    yield
    results.git_sha.cache_clear()


def card_config(tmp_path, **task):
    cfg = composed("experiment=scorecard", "attention=retention")
    with open_dict(cfg):
        cfg.run_dir = str(tmp_path / "sweep")
        cfg.task.refs_dir = str(tmp_path / "refs")
        cfg.task.seeds = [0, 1]
        cfg.task.copy_lengths = [64]
        for k, v in task.items():
            cfg.task[k] = v
    return cfg


def run_part(cfg, name):
    with open_dict(cfg):
        cfg.task.part = name
    return scorecard.run(cfg)


def test_references_are_reused_by_a_second_card(tmp_path, monkeypatch, fake_run):
    fake = FakeRunPy()
    monkeypatch.setattr(scorecard, "run_py", fake)
    first = card_config(tmp_path)
    run_part(first, "copy")
    assert sorted(fake.calls) == ["linear"] * 2 + ["retention"] * 2 + ["softmax"] * 2
    refs = sorted((tmp_path / "refs" / "c0ffee").glob("*/" + scorecard.DONE))
    assert len(refs) == 4
    stamps = {p: p.stat().st_mtime_ns for p in refs}
    # the same card again: done, nothing runs
    fake.calls.clear()
    run_part(first, "copy")
    assert fake.calls == []
    # another card (a new sweep dir) at the same commit and settings: its own runs, the references read
    second = card_config(tmp_path)
    with open_dict(second):
        second.run_dir = str(tmp_path / "sweep2")
    run_part(second, "copy")
    assert fake.calls == ["retention"] * 2
    assert {p: p.stat().st_mtime_ns for p in refs} == stamps
    summary = json.loads((tmp_path / "sweep2" / "scorecard_copy.json").read_text())
    assert [r["reused"] for r in summary["runs"] if r["role"] != "attention"] == [True] * 4
    assert summary["commit"] == "c0ffee" and summary["machine"]
    text = card.build(tmp_path / "sweep2")
    assert "4 of their 4 runs reused" in text and "**better than linear**" in text
    # another commit: the references run again
    monkeypatch.setenv("REPRO_GIT_SHA", "beef")
    results.git_sha.cache_clear()
    third = card_config(tmp_path)
    with open_dict(third):
        third.run_dir = str(tmp_path / "sweep3")
    fake.calls.clear()
    run_part(third, "copy")
    assert sorted(fake.calls) == ["linear"] * 2 + ["retention"] * 2 + ["softmax"] * 2


def test_linear_on_its_pytorch_path_is_a_reference_of_its_own(tmp_path, monkeypatch, fake_run):
    """linear-torch runs under REPRO_KERNEL=torch (its command says so), is cached apart from
    linear, and the card shows it beside linear with the attention's ratio to each."""
    fake = FakeRunPy()
    monkeypatch.setattr(scorecard, "run_py", fake)
    monkeypatch.delenv("REPRO_KERNEL", raising=False)
    cfg = card_config(tmp_path)
    run_part(cfg, "figure1")
    assert sorted(fake.calls) == ["linear", "linear-torch", "retention", "softmax"]
    keys = [json.loads(p.read_text()) for p in (tmp_path / "refs" / "c0ffee").glob("*/key.json")]
    assert sorted(k["env"]["REPRO_KERNEL"] or "" for k in keys) == ["", "", "torch"]
    summary = json.loads((tmp_path / "sweep" / "scorecard_figure1.json").read_text())
    assert summary["references"] == ["linear", "softmax", "linear-torch"]
    torch_run = next(r for r in summary["runs"] if r["role"] == "linear-torch")
    assert torch_run["command"].startswith("REPRO_KERNEL=torch python run.py ") and "attention=linear " in \
        torch_run["command"]
    text = card.build(tmp_path / "sweep")
    assert "time per sample, ms (attention · linear · softmax · linear-torch)" in text
    assert "| 1,024 | 80 · 20 · 60 · 40 |" in text  # each role's own time at that N
    assert "also linear-torch, linear on its PyTorch path (REPRO_KERNEL=torch)" in text
    csv = pd.read_csv(tmp_path / "sweep" / "scorecard.csv")
    mine = csv[(csv.role == "attention") & (csv.measure == "time per sample, N = 1,024")]
    assert set(csv.role.dropna()) == {"attention", "linear", "softmax", "linear-torch"} and len(mine) == 1
    # a second card reads both linear runs from the cache
    fake.calls.clear()
    with open_dict(cfg):
        cfg.run_dir = str(tmp_path / "sweep2")
    run_part(cfg, "figure1")
    assert fake.calls == ["retention"]


def test_a_failed_part_is_recorded_and_the_others_go_on(tmp_path, monkeypatch, fake_run):
    fake = FakeRunPy(broken={"retention"})
    monkeypatch.setattr(scorecard, "run_py", fake)
    cfg = card_config(tmp_path)
    with pytest.raises(RunFailed, match="the run diverged"):
        run_part(cfg, "mnist")
    fake.broken.clear()
    run_part(cfg, "copy")  # the next part runs
    sweep = tmp_path / "sweep"
    mnist = json.loads((sweep / "scorecard_mnist.json").read_text())
    assert mnist["status"] == "failed" and mnist["reason"].startswith("attention-seed0: the run diverged")
    assert json.loads((sweep / "scorecard_copy.json").read_text())["status"] == "ok"
    text = card.build(sweep)
    assert "| mnist | failed: attention-seed0: the run diverged: loss nan at step 3" in text
    assert "| copy | ok |" in text and "Traceback" not in text
    # the failed part runs again on a re-run (its finished reference runs are read, not repeated)
    fake.calls.clear()
    run_part(cfg, "mnist")
    assert fake.calls == ["retention"] * 2
    assert json.loads((sweep / "scorecard_mnist.json").read_text())["status"] == "ok"


def test_a_conformance_failure_stops_the_other_parts_unless_go_on(tmp_path, monkeypatch, fake_run):
    fake = FakeRunPy(broken={"retention"})
    monkeypatch.setattr(scorecard, "run_py", fake)
    cfg = card_config(tmp_path)
    with pytest.raises(RunFailed):
        run_part(cfg, "conformance")
    fake.calls.clear()
    run_part(cfg, "copy")
    assert fake.calls == []
    copy = json.loads((tmp_path / "sweep" / "scorecard_copy.json").read_text())
    assert copy["status"] == "stopped" and "task.go_on=true" in copy["reason"]
    fake.broken.clear()
    with open_dict(cfg):
        cfg.task.go_on = True
    run_part(cfg, "copy")
    assert "retention" in fake.calls


def test_a_bad_part_is_one_line(tmp_path):
    from repro.common.errors import ConfigError

    cfg = card_config(tmp_path)
    with pytest.raises(ConfigError, match=r"task.part='cifar'; valid: conformance, figure1"):
        run_part(cfg, "cifar")


# ----------------------------------------------------------------------------- end to end (slow)

BROKEN = """from conformance_attentions import Leaky  # causality: the causal form reads the future
"""


@pytest.mark.slow
def test_the_quick_card_end_to_end(tmp_path):
    """The quick card of a user's class (tests/extending/my_attention), logged to wandb offline, and
    of a broken one (conformance fails: the card says what, with no traceback). Every part runs, with
    linear as the one reference (linear-torch in generation) and N = 64 alone: half the runs of the
    full quick card, whose plan the tests above check."""
    (tmp_path / "broken_pkg").mkdir()
    (tmp_path / "broken_pkg" / "__init__.py").write_text(BROKEN)
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "extending"), str(REPO / "tests"), str(tmp_path)])}
    refs = tmp_path / "refs"

    def card_of(target, name, *extra):
        sweep = tmp_path / name
        done = subprocess.run([sys.executable, "run.py", "-m", "experiment=scorecard_quick", "attention=custom",
                               f"attention._target_={target}", f"hydra.sweep.dir={sweep}", f"task.refs_dir={refs}",
                               "task.references=[linear]", "task.torch_path=[generation]", "task.copy_lengths=[64]",
                               *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
        return done, sweep

    done, sweep = card_of("broken_pkg.Leaky", "broken")
    assert done.returncode == 1, done.stderr[-2000:]
    text = (sweep / "scorecard.md").read_text()
    assert "fails causality" in text and "| causality | fail |" in text
    assert "| copy | stopped: not run: the attention failed conformance" in text
    assert "Traceback" not in text and "smoke test" in text

    done, sweep = card_of("my_attention.softplus.SoftplusAttention", "softplus", "logger=wandb")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = (sweep / "scorecard.md").read_text()
    for p in PARTS.split(","):
        assert f"| {p} | ok |" in text, p
    assert "smoke test" in text and "held-out loss, N = 64" in text and "validation PER" in text
    assert "seconds per image, batch 1" in text and "kept for backward" in text
    # linear-torch (REPRO_KERNEL=torch) ran
    assert "| measure | attention | linear | linear-torch | vs linear | vs linear-torch |" in text
    assert [p for p in sweep.rglob("*.table.json") if "scorecard" in p.name]  # the card's table, logged offline
    # the same command again continues the card: nothing runs again
    done, _ = card_of("my_attention.softplus.SoftplusAttention", "softplus", "logger=wandb")
    assert done.returncode == 0 and done.stdout.count("not repeated") == 6
