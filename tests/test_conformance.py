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
from pathlib import Path

import conformance_attentions as toy
import pandas as pd
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf
from run_cli import ENV, run_py

from repro.attention.conformance import PROPERTIES, check, first_failure
from repro.attention.noncausal import NonCausalAttention
from repro.cli.attention import named_attentions
from repro.cli.config import compose_group

SIZES = {"d_model": 32, "n_heads": 4, "batch": 3, "length": 37}  # the task's batch and length; a narrower layer
# Failures that are the algorithm's, not a bug, each with why: Reformer's LSH sorts every token
# by its hash before cutting the sequence into chunks, so a later token's hash moves the chunk
# boundaries, and with them which earlier keys an earlier query sees (its causal mask only stops
# a query reading a later position's value).
KNOWN = {"repro.attention.lsh.LSHAttention": {"causality"}}
HERE = Path(__file__).resolve().parent


def table_of(factory, **kw):
    return check(factory, **{**SIZES, **kw})


@pytest.mark.parametrize("name", named_attentions())
def test_every_attention_config_conforms(name):
    cfg = compose_group("attention", name)
    table = table_of(instantiate(cfg))
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
          (toy.Drifts, "repeatable", {"causality", "padding invariance", "recurrent == parallel",
                                      "float32 == float64"}), (toy.WrongShape, "interface", set()),
          (toy.NoMaskArgument, "interface", set())]


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


def custom(userpkg, *args):
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(userpkg), ENV.get("PYTHONPATH", "")])}
    return run_py("task=conformance", "attention=custom", *args, env=env)


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
