"""The copy-task generator, its loss, and task=copy end to end (single run and multirun)."""
import json
import math
import subprocess
import sys

import pandas as pd
import pytest
import torch

from repro.common.results import REPO, read_jsonl
from repro.data import PAD, SEP, CopyTask
from repro.tasks.copy import copy_loss


@pytest.mark.parametrize("batch,max_len,n_symbols,lo,hi", [(64, 128, 10, None, None), (7, 37, 3, None, None),
                                                          (5, 21, 10, 1, 10), (3, 9, 2, 4, 4)])
def test_generator_layout(batch, max_len, n_symbols, lo, hi):
    data = CopyTask(batch, max_len, n_symbols, lo, hi, seed=3)
    lo = max_len // 4 if lo is None else lo
    hi = (max_len - 1) // 2 - 1 if hi is None else hi
    for _ in range(5):
        b = next(data)
        assert all(b[k].shape == (batch, max_len) for k in ("tokens", "targets", "mask"))
        for s, y, m in zip(b["tokens"].tolist(), b["targets"].tolist(), b["mask"].tolist()):
            n = sum(m)
            assert lo <= n <= hi and 2 * n + 1 <= max_len
            assert all(1 <= a <= n_symbols for a in s[:n])
            assert s[n] == SEP and s[n + 1:2 * n + 1] == s[:n] and all(p == PAD for p in s[2 * n + 1:])
            # the mask covers exactly the n positions whose next token is the copy
            assert [i for i, v in enumerate(m) if v] == list(range(n, 2 * n))
            assert [y[i] for i in range(n, 2 * n)] == s[:n] and y[:-1] == s[1:] and y[-1] == PAD


def test_score_separator_scores_what_the_authors_script_scores():
    """The authors' layout written out independently: for copy length n, targets are the next
    tokens and their loss mask covers positions n-1 .. 2n-1 (the separator's prediction, then the
    copy); with score_separator the mask is exactly that, the targets unchanged, and the extra
    scored target is the separator."""
    ours, theirs = CopyTask(6, 23, 5, seed=4), CopyTask(6, 23, 5, seed=4, score_separator=True)
    for _ in range(3):
        a, b = next(ours), next(theirs)
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["targets"], b["targets"])
        for s, y, m in zip(b["tokens"].tolist(), b["targets"].tolist(), b["mask"].tolist()):
            n = s.index(SEP)
            expected = [0] * 23
            expected[n - 1:2 * n] = [1] * (n + 1)
            assert m == [bool(v) for v in expected] and y[n - 1] == SEP


def test_the_presets_choose_the_scoring():
    from hydra import compose, initialize_config_dir

    from repro.conf import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        assert compose("config", ["task=copy"]).task.score_separator is False
        assert compose("config", ["experiment=paper_copy"]).task.score_separator is True  # the authors' script
        assert compose("config", ["task=copy", "experiment=paper_authors"]).task.score_separator is True
        assert compose("config", ["experiment=copy_claims_n128_cpu"]).task.score_separator is False


def test_default_lengths_cover_the_authors_range():
    ns = torch.cat([next(CopyTask(256, 128, seed=s))["mask"].sum(1) for s in range(4)])
    assert ns.min() == 32 and ns.max() == 62  # the authors' [N // 4, (N - 1) // 2 - 1] at N = 128
    symbols = next(CopyTask(256, 128, seed=0))["tokens"][:, :32]
    assert set(symbols.unique().tolist()) == set(range(1, 11))


def test_stream_is_seeded_and_resumable():
    a, b = CopyTask(4, 30, seed=11), CopyTask(4, 30, seed=11)
    for _ in range(3):
        assert torch.equal(next(a)["tokens"], next(b)["tokens"])
    state = a.state_dict()
    expected = [next(a)["tokens"] for _ in range(3)]
    c = CopyTask(4, 30, seed=999)
    c.load_state_dict(state)
    assert all(torch.equal(next(c)["tokens"], e) for e in expected)
    assert not torch.equal(next(CopyTask(4, 30, seed=12))["tokens"], next(CopyTask(4, 30, seed=11))["tokens"])


@pytest.mark.parametrize("kwargs,bad", [({"max_len": 10, "max_copy": 5}, "max_copy=5"),
                                        ({"max_len": 10, "min_copy": 0}, "min_copy=0"),
                                        ({"batch_size": 0}, "batch_size=0")])
def test_generator_rejects_bad_settings(kwargs, bad):
    kwargs = {"batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=bad):
        CopyTask(**kwargs)


class Fixed(torch.nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, tokens):
        return self.logits


def test_copy_loss_matches_float64_reference():
    b = next(CopyTask(5, 19, 4, seed=1))
    logits = torch.randn(5, 19, 5, dtype=torch.float64, requires_grad=True)
    loss, metrics = copy_loss(Fixed(logits), b)
    # reference: a loop over the scored positions only
    terms, right = [], []
    for i in range(5):
        for j in range(19):
            if b["mask"][i, j]:
                lp = logits[i, j] - torch.logsumexp(logits[i, j], 0)
                terms.append(-lp[b["targets"][i, j]])
                right.append(float(logits[i, j].argmax() == b["targets"][i, j]))
    ref = torch.stack(terms).mean()
    torch.testing.assert_close(loss.double(), ref)
    assert metrics["accuracy"].item() == pytest.approx(sum(right) / len(right))
    g, = torch.autograd.grad(loss, logits)
    g_ref, = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(g, g_ref)
    assert g[~b["mask"]].abs().max() == 0  # padding and the first half get no gradient
    perfect = torch.nn.functional.one_hot(b["targets"], 5).double() * 50
    loss, metrics = copy_loss(Fixed(perfect), b)
    assert loss.item() < 1e-6 and metrics["accuracy"] == 1 and metrics["seq_accuracy"] == 1


def test_training_lowers_the_loss(compose_cfg, tmp_path):
    from repro.tasks.copy import run

    cfg = compose_cfg("experiment=smoke_copy", "attention=softmax", "trainer.max_steps=100", "trainer.log_every=10",
                      "trainer.eval_every=50", "trainer.progress=false", f"+task.out_dir={tmp_path}")
    run(cfg)
    rows = read_jsonl(tmp_path / "results.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    final = rows[-1]
    assert final["kind"] == "final" and final["status"] == "ok" and final["steps"] == 100
    assert train[0]["loss"] > math.log(10) - 0.3  # starts near chance over 10 symbols
    assert train[-1]["loss"] < train[0]["loss"] - 0.3 and evals[-1]["loss"] < evals[0]["loss"]
    assert {"device", "git_sha", "versions", "attention", "seed", "max_len"} <= set(final)
    assert (tmp_path / "copy_curves.png").stat().st_size > 0 and (tmp_path / "checkpoints/last.pt").is_file()


@pytest.mark.slow
def test_multirun_aggregates_over_seeds(tmp_path):
    """A real Hydra multirun (2 attentions x 2 seeds) ends in the callback's aggregate."""
    cmd = [sys.executable, "run.py", "-m", "experiment=smoke_copy", "attention=softmax,linear", "seed=0,1",
           "trainer.max_steps=6", "trainer.log_every=3", "trainer.eval_every=6", "trainer.eval_batches=1",
           "trainer.checkpoint=false", "trainer.progress=false", f"hydra.sweep.dir={tmp_path}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"WANDB_MODE": "disabled", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "copy.jsonl")]
    curves = pd.read_csv(tmp_path / "copy_curves.csv")
    for att in ("softmax", "linear"):
        losses = [r["loss"] for r in rows if r["kind"] == "train" and r["attention"] == att and r["step"] == 6]
        c = curves[(curves.attention == att) & (curves.kind == "train") & (curves.metric == "loss")
                   & (curves.step == 6)]
        assert len(losses) == 2 and c.n_seeds.item() == 2
        assert c["mean"].item() == pytest.approx(sum(losses) / 2) and c["min"].item() == min(losses)
    final = pd.read_csv(tmp_path / "copy_final.csv")
    assert set(final.attention) == {"softmax", "linear"} and (final.n_seeds == 2).all()
    assert (tmp_path / "copy_curves.png").is_file()


@pytest.mark.slow
def test_length_sweep_table_and_plot(compose_cfg, tmp_path):
    from repro.tasks.copy import aggregate, run

    rows = []
    for n in (12, 20):
        for att in ("softmax", "linear"):
            d = tmp_path / f"{att}{n}"
            run(compose_cfg("experiment=smoke_copy", f"attention={att}", f"task.max_len={n}", "trainer.max_steps=4",
                            "trainer.eval_every=4", "trainer.eval_batches=1", "trainer.checkpoint=false",
                            "trainer.progress=false", f"+task.out_dir={d}"))
            rows += read_jsonl(d / "results.jsonl")
    f = aggregate(rows, tmp_path)
    assert sorted(zip(f.max_len, f.attention)) == [(12, "linear"), (12, "softmax"), (20, "linear"), (20, "softmax")]
    soft = f.set_index(["max_len", "attention"])
    for n in (12, 20):
        assert soft.loc[(n, "linear"), "speedup_vs_softmax"] == pytest.approx(
            soft.loc[(n, "softmax"), "time_per_step_ms"] / soft.loc[(n, "linear"), "time_per_step_ms"])
    assert (tmp_path / "copy_lengths.png").stat().st_size > 0 and (tmp_path / "table.txt").is_file()
