"""The report's "Beyond the paper" section from published scorecards: a card published with
`--scorecard <sweep dir> --out <folder>` keeps its part summaries and command there and rebuilds
from them; the section shows each card's judged measures with the interval scipy's Welch test
gives, the others as a ratio of means, Figure 1 at the largest N all roles reached (not pooled
over N), and nothing when the manifest names no card."""
import numpy as np
import pandas as pd
from report_manifest import write_manifest
from scipy import stats

from repro.reproduction.report import scorecard as card
from repro.reproduction.report.build import sections
from tests.tasks.test_scorecard import part, values, write_parts

TITLE = "## Beyond the paper: linear attention's successors, by scorecard"


def figure1_points(role, at: dict):
    """Figure 1 measures of one role: {n: time per sample (ms)}, bytes kept for backward = time / 10."""
    return [{"measure": measure, "cell": None, "n": n, "value": v / div, "unit": unit, "judged": False,
             "lower_is_better": True, "role": role, "seed": None}
            for n, v in at.items() for measure, unit, div in (("time per sample", "ms", 1),
                                                              ("kept for backward per sample", "MB", 10))]


def published(tmp_path, rng):
    mine = list(0.10 + 0.01 * rng.standard_normal(3))
    linear = list(0.30 + 0.02 * rng.standard_normal(3))
    softmax = list(0.004 + 0.001 * rng.standard_normal(3))
    copy = part("copy", values("attention", "held-out loss", mine, cell="N = 128")
                + values("linear", "held-out loss", linear, cell="N = 128")
                + values("softmax", "held-out loss", softmax, cell="N = 128")
                + values("attention", "time per update", [30.0], judged=False, cell="N = 128", unit="ms")
                + values("linear", "time per update", [20.0], judged=False, cell="N = 128", unit="ms")
                + [{**m, "lower_is_better": False} for role, v in (("attention", [97.0]), ("linear", [90.0]))
                   for m in values(role, "symbols right", v, judged=False, cell="N = 128", unit="%")])
    # softmax stops before N = 4096: the section's Figure 1 row is N = 2048, the largest all three reached
    figure1 = part("figure1", figure1_points("attention", {1024: 8.0, 2048: 16.0, 4096: 32.0})
                   + figure1_points("linear", {1024: 4.0, 2048: 8.0, 4096: 16.0})
                   + figure1_points("softmax", {1024: 20.0, 2048: 80.0}), seeds=())
    write_parts(tmp_path / "sweep", copy, figure1)
    card.build(tmp_path / "sweep", tmp_path / "results" / "scorecards" / "mine")
    return mine, linear, softmax


def test_a_published_card_keeps_its_parts_and_command_and_rebuilds_from_them(tmp_path):
    published(tmp_path, np.random.default_rng(3))
    folder = tmp_path / "results" / "scorecards" / "mine"
    assert sorted(p.name for p in folder.iterdir()) == ["command.txt", "scorecard.csv", "scorecard.md",
                                                         "scorecard.png", "scorecard_copy.json",
                                                         "scorecard_figure1.json"]
    assert (folder / "command.txt").read_text() == "python run.py -m experiment=scorecard attention=mine\n"
    before = pd.read_csv(folder / "scorecard.csv")
    card.build(folder)  # from the published folder alone
    pd.testing.assert_frame_equal(pd.read_csv(folder / "scorecard.csv"), before)
    # a card published again without a part leaves no stale summary of it behind
    (tmp_path / "sweep" / "scorecard_figure1.json").unlink()
    card.build(tmp_path / "sweep", folder)
    assert not (folder / "scorecard_figure1.json").exists()
    # Figure 1: one row per point, never a mean over N
    row = before[(before.measure == "time per sample, N = 4,096") & (before.role == "linear")]
    assert len(row) == 1 and row["mean"].iloc[0] == 16.0 and row.n.iloc[0] == 1


def test_the_section_shows_each_card_with_its_verdicts(tmp_path):
    mine, linear, softmax = published(tmp_path, np.random.default_rng(3))
    root = tmp_path / "results"
    write_manifest(root, scorecards=["scorecards/mine"])
    text = sections(root, root / "REPORT.md")["scorecards"]
    assert text.startswith(TITLE) and "### mine" in text
    lines = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    loss = lines["copy: held-out loss, N = 128 (nats/symbol)"]
    ci = stats.ttest_ind(mine, linear, equal_var=False).confidence_interval(0.95)
    assert ci.high < 0 and f"**better than linear** (gap to linear {np.mean(mine) - np.mean(linear):.3g}" in loss
    assert f"[{ci.low:.3g}, {ci.high:.3g}]" in loss
    ci = stats.ttest_ind(mine, softmax, equal_var=False).confidence_interval(0.95)
    assert ci.low > 0.01 and "**worse than softmax**" in loss and f"[{ci.low:.3g}, {ci.high:.3g}]" in loss
    assert f"{np.mean(mine):.4g} ± {np.std(mine, ddof=1):.2g} (3 seeds)" in loss
    time = lines["copy: time per update, N = 128 (ms)"]
    assert "1.5x linear's" in time and time.endswith("| — |")  # not judged: the ratio; softmax not measured
    assert "1.08x linear's" in lines["copy: symbols right, N = 128 (%, higher is better)"]
    figure1 = [k for k in lines if k.startswith("figure1")]
    assert figure1 == ["figure1: time per sample, N = 2,048 (ms)", "figure1: kept for backward per sample, "
                       "N = 2,048 (MB)"], figure1
    assert "2x linear's" in lines["figure1: time per sample, N = 2,048 (ms)"]
    assert "0.2x softmax's" in lines["figure1: time per sample, N = 2,048 (ms)"]
    assert "commit `abc123`" in text and "experiment=scorecard attention=mine" in text
    assert "(scorecards/mine/scorecard.md)" in text and "(scorecards/mine/scorecard.png)" in text


def test_no_card_named_no_section(tmp_path):
    root = tmp_path / "results"
    write_manifest(root)
    assert sections(root, root / "REPORT.md")["scorecards"] == ""


def test_a_card_continued_at_another_commit_names_each_parts_commit(tmp_path):
    """Parts run again at a later commit (each with its references there): the card and the
    section name every commit with its parts, never one commit for all."""
    copy = part("copy", values("attention", "held-out loss", [0.1, 0.11, 0.12], cell="N = 64")
                + values("linear", "held-out loss", [0.3, 0.31, 0.32], cell="N = 64"))
    figure1 = part("figure1", figure1_points("attention", {1024: 8.0}) + figure1_points("linear", {1024: 4.0}),
                   seeds=(), commit="def456")
    write_parts(tmp_path / "sweep", copy, figure1)
    text = card.build(tmp_path / "sweep", tmp_path / "results" / "scorecards" / "mine")
    assert "Commit: `def456` (figure1); `abc123` (copy)" in text
    root = tmp_path / "results"
    write_manifest(root, scorecards=["scorecards/mine"])
    assert "commit `def456` (figure1); `abc123` (copy), command" in sections(root, root / "REPORT.md")["scorecards"]
    write_parts(tmp_path / "sweep", {**figure1, "commit": "abc123"})
    assert "Commit: `abc123`  \n" in card.build(tmp_path / "sweep")
