"""python -m repro.reproduction.model_memory and its report section: one training step per
(preset, attention) in a fresh process, rounds interleaved; linear set against softmax."""
import json
import subprocess
import sys

import pandas as pd
import pytest
from report_manifest import write_manifest

from repro.common.results import REPO
from repro.reproduction.report import build
from repro.reproduction.report.memory import against
from repro.training.memory import saved_bytes


@pytest.mark.slow  # a fresh process per point
def test_one_step_per_point_interleaved_and_kept_bytes_exact(tmp_path):
    out = tmp_path / "mm"
    proc = subprocess.run([sys.executable, "-m", "repro.reproduction.model_memory", "--presets", "smoke_copy",
                           "--attentions", "softmax,linear", "--rounds", "2", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin"})
    assert proc.returncode == 0, proc.stderr
    rounds = [line for line in proc.stdout.splitlines() if line.startswith("round")]
    order = [[w.rstrip(":") for w in line.split()[2:4]] for line in rounds]
    assert order == [["smoke_copy", "softmax"], ["smoke_copy", "linear"]] * 2  # interleaved rounds
    df = pd.read_csv(out / "model_memory.csv")
    assert df.attention.tolist() == ["softmax", "linear"] and (df.rounds == 2).all()
    assert (df.peak_min_mb <= df.peak_mb).all() and (df.peak_mb <= df.peak_max_mb).all()
    assert "--presets smoke_copy" in (out / "command.txt").read_text()
    # the kept bytes are what saved_bytes counts for the same step, in this process
    import torch
    from hydra import compose, initialize_config_dir

    from repro.conf import CONF_DIR
    from repro.reproduction.model_memory import _batch_and_loss

    torch.manual_seed(0)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=smoke_copy", "attention=linear"])
    model, batch, loss_fn, _ = _batch_and_loss(cfg)
    assert df.kept_mb.iloc[1] == pytest.approx(saved_bytes(loss_fn, model, batch)[0] / 2**20)


def test_the_section_sets_linear_against_softmax(tmp_path):
    (tmp_path / "mm").mkdir()
    rows = [{"preset": p, "attention": a, "n": 24, "batch": 8, "kept_mb": k, "peak_alloc_mb": x, "peak_mb": m,
             "peak_min_mb": m - 1, "peak_max_mb": m + 1, "device": "AMD EPYC (2 cores, 1 threads)"}
            for p, a, k, x, m in (("a", "softmax", 4.0, 5.0, 10.0), ("a", "linear", 3.0, 5.5, 10.5),
                                  ("b", "softmax", 4.0, 5.0, 10.0), ("b", "linear", 5.0, 10.0, 20.0))]
    pd.DataFrame(rows).to_csv(tmp_path / "mm" / "model_memory.csv", index=False)
    (tmp_path / "mm" / "command.txt").write_text("python -m repro.reproduction.model_memory\n")
    write_manifest(tmp_path, memory=["mm"])
    md = build(tmp_path, tmp_path / "R.md")
    section = md.split("## Memory of whole models in training", 1)[1]
    assert "| a | 24 | 8 | linear | 3 | 5.5 | 10.5 (9.5-11.5) |" in section
    assert "| a | 24 | 8 | linear / softmax | 0.75x | 1.1x | within the spread |" in section
    assert "| b | 24 | 8 | linear / softmax | 1.25x | 2x | above by 10 MB (beyond the spread) |" in section
    # a table from before the exact peak was recorded: that cell is empty, the rest as before
    pd.DataFrame(rows).drop(columns="peak_alloc_mb").to_csv(tmp_path / "mm" / "model_memory.csv", index=False)
    section = build(tmp_path, tmp_path / "R.md").split("## Memory of whole models in training", 1)[1]
    assert "| b | 24 | 8 | linear / softmax | 1.25x | — | above by 10 MB (beyond the spread) |" in section
    lin = pd.Series({"peak_mb": 5.0, "peak_min_mb": 4.0, "peak_max_mb": 6.0})
    soft = pd.Series({"peak_mb": 8.0, "peak_min_mb": 7.0, "peak_max_mb": 9.0})
    assert against(lin, soft) == "below"
    assert json.dumps(against(soft, lin)).startswith('"above by 3')
