"""task=conformance (repro/attention/conformance.py, repro/tasks/conformance.py): every config of
conf/attention checked (the list read from the folder at test time, so an attention added there
is checked the day it is added), attentions broken on purpose (tests/conformance_attentions.py:
each fails, and the check names, the property it breaks), torch's nn.MultiheadAttention as a
reference that conforms, and the custom route from the command line with a user's class from a
temporary package."""
import importlib.util
import json
import os
import shutil
import signal
from pathlib import Path

import conformance_attentions as toy
import pandas as pd
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf
from run_cli import ENV, SMOKE_COPY, run_py
from torch import nn

from repro.attention.conformance import LENGTH, PROPERTIES, check, first_failure
from repro.attention.contract import zero_dropout
from repro.attention.noncausal import NonCausalAttention
from repro.conf import compose_group
from repro.conf.attention import named_attentions

# the task's batch, a narrower layer; the toys at a short length (quick), the suite's attentions at the default
SIZES = {"d_model": 32, "n_heads": 4, "batch": 3, "length": 37}
# Failures that are the algorithm's, not a bug, each with why: Reformer's LSH sorts every token
# by its hash before cutting the sequence into chunks, so a later token's hash moves the chunk
# boundaries, and with them which earlier keys an earlier query sees (its causal mask only stops
# a query reading a later position's value).
KNOWN = {"repro.attention.lsh.LSHAttention": {"causality"}}
HERE = Path(__file__).resolve().parents[1]  # tests/: the shared fixtures


def table_of(factory, **kw):
    return check(factory, **{**SIZES, **kw})


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith("lsh") else n  # 13-50 s each
                                  for n in named_attentions()])
def test_every_attention_config_conforms(name):
    cfg = compose_group("attention", name)
    table = table_of(instantiate(cfg), length=LENGTH)
    results = {row["property"]: row["result"] for row in table}
    assert [row["property"] for row in table] == list(PROPERTIES)
    failed = {p for p, r in results.items() if r == "fail"}
    assert failed == KNOWN.get(cfg._target_, set()), [row for row in table if row["result"] == "fail"]
    assert set(results.values()) <= {"pass", "skip", "fail"}
    assert all(row["detail"] for row in table)
    # the table agrees with what the layer is
    layer = instantiate(cfg)(d_model=SIZES["d_model"], n_heads=SIZES["n_heads"])
    assert (results["causality"] == "skip") == isinstance(layer, NonCausalAttention) or name == "rfa"
    assert results["recurrent == parallel"] == ("pass" if layer.recurrent else "skip")
    assert results["gradients"] == "pass" and results["float32 == float64"] == "pass"


@pytest.mark.parametrize("name", ["gla", "delta"])
def test_the_causal_only_ones_run_both_directions_conform(name):
    """attention.bidirectional=true (the speech task's gla and delta): the non-causal form that
    it adds is checked too, padding invariance included."""
    cfg = OmegaConf.merge(compose_group("attention", name), {"bidirectional": True})
    table = table_of(instantiate(cfg))
    assert first_failure(table) is None, table
    results = {row["property"]: row for row in table}
    # padding invariance is skipped for a layer that refuses causal=False: here it ran
    assert results["padding invariance"]["result"] == results["causality"]["result"] == "pass"


# each broken attention: the property it breaks (named first), and any other it breaks with it
BROKEN = [(toy.Leaky, "causality", {"recurrent == parallel"}),  # its step stayed causal
          (toy.IgnoresPadding, "padding invariance", set()), (toy.StepOff, "recurrent == parallel", set()),
          (toy.Cancels, "float32 == float64", set()), (toy.NoKeys, "gradients", set()),
          # every comparison after it fails too: why `repeatable` comes first
          (toy.Drifts, "repeatable", {"causality", "padding invariance", "batch independence",
                                      "recurrent == parallel", "float32 == float64"}),
          (toy.WrongShape, "interface", set()), (toy.NoMaskArgument, "interface", set()),
          (toy.LeaksInTraining, "causality", set()),
          (toy.MixesBatch, "batch independence", set()), (toy.ExitsInForward, "interface", set()),
          (toy.ExitsWhenBuilt, "interface", set()),
          # a train-mode forward that exits: every check that trains fails, saying so; the others run
          (toy.ExitsInTraining, "repeatable", {"causality", "padding invariance", "batch independence"})]


@pytest.mark.parametrize("cls, prop, also", BROKEN, ids=[b[0].__name__ for b in BROKEN])
def test_a_broken_attention_fails_naming_the_property(cls, prop, also):
    table = table_of(cls)
    assert first_failure(table)["property"] == prop, table
    assert {row["property"] for row in table if row["result"] == "fail"} == {prop} | also, table
    if prop == "interface":
        assert {row["result"] for row in table[1:]} == {"not run"}


def test_the_correct_one_and_torch_multihead_attention_conform():
    for cls in (toy.Plain, toy.TorchMultihead):
        table = table_of(cls)
        assert first_failure(table) is None, table
    results = {row["property"]: row for row in table_of(toy.TorchMultihead)}
    assert "not an AttentionLayer, same call" in results["interface"]["detail"]
    assert results["recurrent == parallel"]["result"] == "skip"
    assert "mha.in_proj_bias" not in results["gradients"]["detail"] or "rounding" in results["gradients"]["detail"]


def test_named_details():
    leaky = {row["property"]: row for row in table_of(toy.Leaky)}
    assert "t=1 " in leaky["causality"]["detail"] and "sees the future" in leaky["causality"]["detail"]
    dead = {row["property"]: row for row in table_of(toy.NoKeys)}["gradients"]["detail"]
    assert dead == "no gradient reaches: k_proj.weight, k_proj.bias"
    softmax = {row["property"]: row for row in table_of(instantiate(compose_group("attention", "softmax")))}
    assert softmax["gradients"]["detail"].endswith("at rounding level (the attention is invariant to them): "
                                                   "k_proj.bias")  # softmax(q.(k + b)) = softmax(q.k)


def test_an_attention_drawing_in_every_call_is_seeded_and_not_compared_across_dtypes():
    """Seeded, its calls repeat (so causality and padding are checked fairly); float32 against
    float64 is skipped, saying why, since one seed draws other numbers in each dtype."""
    rows = {row["property"]: row for row in table_of(toy.DrawsEachCall)}
    assert "draws random numbers in every call" in rows["repeatable"]["detail"]
    assert rows["causality"]["result"] == rows["padding invariance"]["result"] == "pass"
    assert rows["float32 == float64"]["result"] == "skip"
    assert rows["float32 == float64"]["detail"].startswith("not comparable: it draws random numbers in every call")
    assert "draws" not in {row["property"]: row for row in table_of(toy.Plain)}["repeatable"]["detail"]


def test_the_docs_toy_mean_attention_fails_gradients():
    """docs/extending.md's MeanAttention ignores queries and keys: the check says so."""
    spec = importlib.util.spec_from_file_location("mean_attention", HERE / "extending" / "mean_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = table_of(module.MeanAttention)
    assert first_failure(table) == {"property": "gradients", "result": "fail", "detail": "no gradient reaches: "
                                    "q_proj.weight, q_proj.bias, k_proj.weight, k_proj.bias"}


def test_train_mode_is_checked_with_its_dropout_at_zero():
    """A leak only in training is caught, and named as such; a layer's dropout is set to 0 for
    those calls (names listed), torch's Dropout modules and dropout attributes alike."""
    row = {r["property"]: r for r in table_of(toy.LeaksInTraining)}["causality"]
    assert row["detail"].startswith("changing x at t=1 moved outputs before t by ")
    assert "in float64, train mode" in row["detail"], row
    cfg = OmegaConf.merge(compose_group("attention", "softmax"), {"attention_dropout": 0.5})
    table = table_of(instantiate(cfg))
    assert first_failure(table) is None, table
    assert "eval and train mode, dropout set to 0 (attention_dropout)" in table[1]["detail"]
    mha = nn.Sequential(nn.MultiheadAttention(8, 2, dropout=0.3), nn.Dropout(0.2), nn.Dropout(0.0))
    assert zero_dropout(mha) == ["0.dropout", "1"]
    assert mha[0].dropout == mha[1].p == mha[2].p == 0.0


def test_lsh_is_random_by_design_in_training_and_not_failed_for_it():
    """LSH redraws its hash planes in every training call (redraw=train): reported in `repeatable`,
    seeded so its train-mode comparisons are fair; only Reformer's own causality fails."""
    rows = {r["property"]: r for r in table_of(instantiate(compose_group("attention", "lsh-1")))}
    assert rows["repeatable"]["result"] == "pass"
    assert rows["repeatable"]["detail"].endswith("random by design in training: it draws random numbers in every "
                                                 "training call (the same ones under the seed)")
    assert rows["padding invariance"]["result"] == rows["batch independence"]["result"] == "pass"
    assert "random by design" not in {r["property"]: r for r in table_of(toy.Plain)}["repeatable"]["detail"]


def test_a_leak_past_64_tokens_needs_the_default_length():
    """The former 37 tokens never reach position 64; the default length runs past 2 x 64 and 128."""
    assert LENGTH >= 130
    assert first_failure(table_of(toy.LeaksFrom64)) is None  # 37 tokens
    table = check(toy.LeaksFrom64, d_model=32, n_heads=4)  # the defaults: LENGTH tokens, batch 3
    failed = [row["property"] for row in table if row["result"] == "fail"]
    assert failed == ["causality", "recurrent == parallel"], table  # its step stays causal
    assert first_failure(table)["detail"].startswith("changing x at t=65 moved outputs before t by ")


def test_batch_mixing_is_caught_naming_the_sequence():
    row = {r["property"]: r for r in table_of(toy.MixesBatch)}["batch independence"]
    assert row["detail"].startswith("replacing sequence 0 moved the other sequences' outputs by "), row
    assert row["detail"].endswith("the batch's sequences mix")
    ok = {r["property"]: r for r in table_of(toy.Plain)}["batch independence"]
    assert ok["result"] == "pass" and ok["detail"].startswith("each of 3 sequences replaced in turn, eval and train")


def test_a_system_exit_from_the_attention_is_a_failure_not_the_end():
    rows = {r["property"]: r for r in table_of(toy.ExitsInForward)}
    assert rows["interface"]["detail"] == "forward(causal=True) in float64: SystemExit(0)"
    rows = {r["property"]: r for r in table_of(toy.ExitsWhenBuilt)}
    assert rows["interface"]["detail"] == "building it as the model does, Class(d_model=32, n_heads=4): SystemExit(3)"
    rows = {r["property"]: r for r in table_of(toy.ExitsInTraining)}
    assert rows["repeatable"]["detail"] == "raised SystemExit(0)"
    assert rows["recurrent == parallel"]["result"] == "pass"  # eval-mode checks still run


class StopsTheRun(toy.Plain):
    def forward(self, x, causal=False, key_padding_mask=None):
        signal.raise_signal(signal.SIGTERM)  # the user stops the run mid-check
        return super().forward(x, causal, key_padding_mask)


def test_a_stop_signal_during_the_check_still_stops_it():
    """run.py turns SIGTERM into SystemExit in its handler: that one is not the attention's."""
    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(SystemExit) as err:
            table_of(StopsTheRun)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert err.value.code == 128 + signal.SIGTERM


def test_bad_sizes_are_one_line():
    with pytest.raises(ValueError, match="batch=1, length=37: need batch >= 2"):
        check(toy.Plain, d_model=32, n_heads=4, batch=1, length=37)


# ------------------------------------------------------------------ from the command line

@pytest.fixture(scope="module")
def userpkg(tmp_path_factory):
    """A user's package in a folder of its own: put on PYTHONPATH, never inside the repository."""
    root = tmp_path_factory.mktemp("user")
    (root / "userpkg").mkdir()
    (root / "userpkg" / "__init__.py").write_text("")
    shutil.copy(HERE / "conformance_attentions.py", root / "userpkg" / "attentions.py")
    return root


def as_user(userpkg, *args):
    """run.py with the user's package on the Python path."""
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(userpkg), ENV.get("PYTHONPATH", "")])}
    return run_py(*args, env=env)


def custom(userpkg, *args):
    return as_user(userpkg, "task=conformance", "attention=custom", *args)


@pytest.mark.slow
def test_a_users_class_passes_from_the_command_line(userpkg, tmp_path):
    res = custom(userpkg, "attention._target_=userpkg.attentions.Plain", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr
    assert "custom     gradients              pass" in res.stdout
    csv, js = pd.read_csv(tmp_path / "conformance.csv"), json.loads((tmp_path / "conformance.json").read_text())
    assert list(csv.property) == list(PROPERTIES) == [row["property"] for row in js]
    assert set(csv.result) == {"pass"} and set(csv.target) == {"userpkg.attentions.Plain"}
    assert not list(tmp_path.glob(".*.tmp"))  # written whole


def test_a_users_broken_class_fails_naming_the_property(userpkg, tmp_path):
    res = custom(userpkg, "attention._target_=userpkg.attentions.Leaky", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: attention custom (userpkg.attentions.Leaky) fails causality: changing x at t=1 ")
    table = pd.read_csv(tmp_path / "conformance.csv")  # written, failures and all
    assert table[table.result == "fail"].property.tolist() == ["causality", "recurrent == parallel"]


@pytest.mark.parametrize("args, line", [
    ((), "error: attention=custom needs your class: attention._target_=package.module.Class (the folder holding "
         "its package must be on the Python path"),
    (("attention._target_=nopkg.mod.Cls",), "error: attention._target_=nopkg.mod.Cls: cannot be imported "
                                            "(ModuleNotFoundError(\"No module named 'nopkg'\"))"),
    (("attention._target_=userpkg.attentions.Plain", "+attention.window=3"),
     "error: attention._target_=userpkg.attentions.Plain: cannot be built as the model builds every attention, "
     "Class(d_model=64, n_heads=4, <its settings>): "),
])
def test_custom_without_a_usable_class_is_one_line(userpkg, tmp_path, args, line):
    res = custom(userpkg, *args, f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 2 and res.stderr.strip().startswith(line), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.slow  # run.py: the check and a training
def test_a_plain_module_runs_every_task_it_fits(userpkg, tmp_path):
    """torch's nn.MultiheadAttention behind the call: no causal_only, recurrent or step, and
    nothing else the suite's own layers carry. It checks, and it trains (the copy task,
    evaluation included)."""
    target = "attention._target_=userpkg.attentions.TorchMultihead"
    res = custom(userpkg, target, "model.d_model=32", f"hydra.run.dir={tmp_path / 'check'}")
    assert res.returncode == 0, res.stderr
    table = pd.read_csv(tmp_path / "check" / "conformance.csv")
    assert set(table.result) == {"pass", "skip"} and table.set_index("property").result["batch independence"] == "pass"
    smoke = [a for a in SMOKE_COPY if not a.startswith("attention=")]
    res = as_user(userpkg, *smoke, "attention=custom", target, "trainer.max_steps=4", "trainer.eval_every=2",
                  "trainer.eval_batches=1", "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path / 'copy'}")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (tmp_path / "copy" / "results.jsonl").read_text().splitlines()]
    assert rows[-1]["status"] == "ok" and rows[-1]["target"] == "userpkg.attentions.TorchMultihead", rows[-1]


@pytest.mark.parametrize("cls, line", [
    ("NoMaskArgument", "error: attention._target_=userpkg.attentions.NoMaskArgument: NoMaskArgument.forward takes "
                       "no key_padding_mask: forward(x, causal=..., key_padding_mask=...) is the call"),
    ("ExitsWhenBuilt", "error: attention._target_=userpkg.attentions.ExitsWhenBuilt: Class(d_model=64, n_heads=4) "
                       "raised SystemExit(3)"),
])
def test_a_class_the_model_cannot_call_stops_training_in_one_line(userpkg, tmp_path, cls, line):
    smoke = [a for a in SMOKE_COPY if not a.startswith("attention=")]
    res = as_user(userpkg, *smoke, "attention=custom", f"attention._target_=userpkg.attentions.{cls}",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 2 and res.stderr.strip().startswith(line), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_forward_that_exits_fails_the_check_from_the_command_line(userpkg, tmp_path):
    res = custom(userpkg, "attention._target_=userpkg.attentions.ExitsInForward", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert res.stderr.strip().splitlines()[-1] == ("error: attention custom (userpkg.attentions.ExitsInForward) fails "
                                                   "interface: forward(causal=True) in float64: SystemExit(0)")
    assert pd.read_csv(tmp_path / "conformance.csv").result.tolist() == ["fail"] + ["not run"] * 7
