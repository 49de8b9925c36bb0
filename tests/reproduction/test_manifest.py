"""results/claims.yaml, the one manifest of which results folder answers which claim and which
table: the committed one names folders that are there and accounts for every committed folder;
a mistake in one is one line naming the key and the folder; the report built from a results tree
shows exactly the folders its manifest names (never a folder it leaves out, however complete)."""
import json
import re
import subprocess
from pathlib import Path, PurePosixPath

import pandas as pd
import pytest
from report_manifest import write_manifest

from repro.common.results import REPO
from repro.reproduction import manifest
from repro.reproduction.manifest import ManifestError
from repro.reproduction.report import build, main
from repro.reproduction.report import claims as claims_module

CPU, GPU = "AMD EPYC (2 cores, 1 threads)", "NVIDIA H100 80GB HBM3"


def committed_folders() -> set[str]:
    """The folders under results/ holding a committed file other than a README (relative to results/)."""
    files = subprocess.run(["git", "ls-files", "results"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    return {str(PurePosixPath(f).parent.relative_to("results")) for f in files
            if PurePosixPath(f).name != "README.md" and PurePosixPath(f).parent != PurePosixPath("results")}


def unaccounted(folders, named: manifest.Manifest) -> list[str]:
    """The folders that neither lie in (or are) a folder the manifest cites nor an archived one."""
    known = set(manifest.cited(named)) | set(named.archived)
    return sorted(f for f in folders if not any(f == k or f.startswith(k + "/") for k in known))


# ----------------------------------------------------------------------------- the committed manifest

def test_the_committed_manifest_names_only_folders_that_are_there():
    named = manifest.load(REPO / "results")
    paths = [REPO / "results" / f for f in [*named.claims.values(), *named.runs, *named.archived, *named.readme]]
    paths += [p for section in named.report for p in named.paths(section)]
    assert paths and all(p.exists() for p in paths), [str(p) for p in paths if not p.exists()]
    assert set(named.claims) == set(manifest.CLAIMS)  # every claim judged from a named run


def test_every_committed_results_folder_is_cited_or_archived():
    folders = committed_folders()
    assert "images/mnist_claims_seeds_cpu" in folders and "gpu/NVIDIA_H100_80GB_HBM3/mnist/runs" in folders
    named = manifest.load(REPO / "results")
    assert unaccounted(folders, named) == []
    # the check can fail: a folder nothing cites is reported
    assert unaccounted(folders | {"throughput/new_cpu"}, named) == ["throughput/new_cpu"]


def test_the_committed_claims_cite_the_manifests_folders():
    """The claims table cites exactly the folders the manifest names for the claims."""
    named = manifest.load(REPO / "results")
    text = claims_module.section(REPO / "results", named)
    for key, folder in named.claims.items():
        assert f"(`{folder}`)" in text, key


# ----------------------------------------------------------------------------- mistakes: one line each

def _tree(root: Path):
    for folder in ("copy/a", "copy/b", "throughput/t"):
        (root / folder).mkdir(parents=True)
        (root / folder / "command.txt").write_text(f"python run.py task.publish=results/{folder}\n")
    (root / "copy" / "old").mkdir()
    (root / "copy" / "a" / "copy_final.csv").write_text("x\n1\n")


GOOD = {"claims": {"copy": "copy/a"}, "report": {"figure2": ["copy/a", "copy/b"],
                                                "table_5": [{"folder": "throughput/t", "batch": 1}]},
        "readme": ["copy/a/copy_final.csv"],
        "runs": {"copy/a": "command.txt", "copy/b": "command.txt", "throughput/t": "command.txt"},
        "archived": {"copy/old": "superseded by copy/a"}}


def _with(**change) -> dict:
    data = json.loads(json.dumps(GOOD))
    for key, value in change.items():
        *parents, last = key.split(".")
        at = data
        for p in parents:
            at = at[p]
        if value is None:
            del at[last]
        else:
            at[last] = value
    return data


@pytest.mark.parametrize("change, expect", [
    ({"claims.copy": "copy/nope"}, "claims.copy: no folder copy/nope under "),
    ({"claims.speed": "copy/a"}, "claims.speed: no such claim; valid: figure1, copy, copy_sweep, copy_authors, "
                                 "mnist, asr, batch,"),
    ({"report.figure3": ["copy/a"]}, "report.figure3: no such section; valid: "),
    ({"report.figure2": ["copy/a", "copy/nope"]}, "report.figure2[1]: no folder copy/nope under "),
    ({"report.figure2": "copy/a"}, "report.figure2: 'copy/a': a list of folders is needed"),
    ({"report.table_5": [{"folder": "throughput/t"}]}, "report.table_5[0]: {'folder': 'throughput/t'}: a column is"),
    ({"report.table_5": [{"folder": "throughput/t", "batch": "one"}]}, "report.table_5[0]: batch 'one' is not a"),
    ({"report.table_5": [{"folder": "throughput/t", "batch": 1, "colour": 2}]},
     "report.table_5[0]: unknown key 'colour'; valid: folder, batch, quiet"),
    ({"report.figure2": ["../copy/a"]}, "report.figure2[0]: ../copy/a is not a path inside the results folder"),
    ({"runs.copy/b": None}, "report.figure2: copy/b has no entry in runs (the command that made it)"),
    ({"runs.copy/old": "command.txt"}, "runs.copy/old: cited by no claim or section"),
    ({"report.figure2": ["copy/a"]}, "runs.copy/b: cited by no claim or section: cite it, or move it to archived"),
    ({"runs.copy/b": "README.md"}, "runs.copy/b: copy/b has a command.txt, which the report shows: say command.txt"),
    ({"archived.copy/b": "old"}, "archived.copy/b: cited by report.figure2: a folder is either cited or archived"),
    ({"archived.copy/old": ""}, "archived.copy/old: no reason given"),
    ({"readme": ["copy/old/x.csv"]}, "readme[0]: no file copy/old/x.csv under "),
    ({"tables": {}}, "tables: unknown key; valid: claims, report, readme, runs, archived"),
])
def test_a_manifest_mistake_is_one_line_naming_the_key_and_the_folder(tmp_path, change, expect):
    _tree(tmp_path)
    assert manifest.check(tmp_path, GOOD, "claims.yaml").claim("copy") == "copy/a"  # the good one loads
    with pytest.raises(ManifestError) as err:
        manifest.check(tmp_path, _with(**change), "claims.yaml")
    assert str(err.value).startswith(f"claims.yaml: {expect}") and "\n" not in str(err.value), str(err.value)


def test_the_command_line_says_the_mistake_in_one_line(tmp_path, capsys):
    """python -m repro.report and python -m repro.reproduction.report.claims: a manifest naming a missing
    folder, a claim key that is not one, no manifest, YAML that does not parse: `error: ...`, one
    line, nothing written."""
    _tree(tmp_path)
    for text, expect in (("claims: {copy: copy/nope}\n", r"claims.yaml: claims.copy: no folder copy/nope under "),
                         ("claims: {fig1: copy/a}\n", r"claims.yaml: claims.fig1: no such claim; valid: figure1"),
                         ("claims: [copy\n", r"claims.yaml: not valid YAML \("),
                         (None, r"claims.yaml: no such file: the report and the claims show only the runs it names")):
        path = tmp_path / "claims.yaml"
        path.unlink(missing_ok=True)
        if text is not None:
            path.write_text(text)
        with pytest.raises(SystemExit) as stop:
            main(["--results", str(tmp_path)])
        line = str(stop.value.code)
        assert line.startswith("error: ") and "\n" not in line and re.search(expect, line), line
        assert not (tmp_path / "REPORT.md").exists()
    path.write_text("claims: {copy: copy/nope}\n")
    result = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "repro.reproduction.report.claims",
                             str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0
    assert "claims.copy: no folder copy/nope under" in result.stderr


# ----------------------------------------------------------------------------- the report reads what it names

def _bpd(root, folder, values, device=CPU):
    (root / folder).mkdir(parents=True)
    pd.DataFrame([{"dataset": "mnist", "attention": a, "eval_bits_per_dim": v, "device": device, "status": "ok"}
                  for a, v in values.items()]).to_csv(root / folder / "bpd_final.csv", index=False)
    (root / folder / "command.txt").write_text(f"python run.py task.publish=results/{folder}\n")


def _throughput(root, folder, rows, load=1.0):
    (root / folder).mkdir(parents=True)
    pd.DataFrame([{"size": "mnist", "method": m, "batch": b, "images_per_s": v, "seconds_per_image": 1 / v,
                   "extrapolated": False, "device": CPU, "loadavg_1min_start": load, "loadavg_1min_end": load,
                   "status": "ok"} for m, b, v in rows]).to_csv(root / folder / "throughput.csv", index=False)
    (root / folder / "command.txt").write_text(f"python run.py task=throughput task.publish=results/{folder}\n")


def _cells(md, first, section) -> dict:
    part = md.split(section, 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    lines = [ln for ln in part.splitlines() if ln.startswith("|")]
    split = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    return dict(zip(split[0], next(r for r in split[2:] if r[0] == first)))


def test_the_report_shows_exactly_the_folders_the_manifest_names(tmp_path):
    """Two CPU bits/dim folders: the one named holds two attentions, the other all four (the old
    rule took "the folder holding the most attentions", here `b_all`). Three CPU throughput runs:
    the one named fills the fewest cells (the old ranking took the most complete, `t_full`). A copy
    run not named, even a damaged one, is never read. Each column takes the named folder alone."""
    _bpd(tmp_path, "images/a_two", {"softmax": 1.9, "linear": 1.8})
    _bpd(tmp_path, "images/b_all", {"softmax": 1.7, "linear": 1.65, "lsh-4": 1.6, "lsh-1": 1.66})
    _throughput(tmp_path, "throughput/t_full", [(m, 10, v) for m, v in (("softmax", 0.01), ("linear", 0.3),
                                                                        ("stateful-softmax", 0.2), ("lsh-1", 0.02))])
    _throughput(tmp_path, "throughput/t_linear", [("linear", 1, 0.5)], load=0.5)
    _throughput(tmp_path, "throughput/t_other", [("linear", 64, 99.0)])
    (tmp_path / "copy" / "torn").mkdir(parents=True)
    (tmp_path / "copy" / "torn" / "copy_final.csv").write_text("max_len,attention\n32,lin")  # torn: no newline
    write_manifest(tmp_path, tables_1_2={"bits_per_dim": ["images/a_two"],
                                         "images_per_s": [{"folder": "throughput/t_linear", "batch": 1}]},
                   table_4=[{"folder": "throughput/t_linear", "batch": 1}],
                   table_5=[{"folder": "throughput/t_linear", "batch": 1}])
    md = build(tmp_path, tmp_path / "REPORT.md")
    t1 = {m: _cells(md, m, "### Table 1: MNIST") for m in ("softmax", "linear", "lsh-4")}
    assert [t1[m]["our bits/dim, CPU"] for m in t1] == ["1.9", "1.8", "not yet run"]
    assert [t1[m]["our images/s, CPU, batch 1"] for m in t1] == ["not in this run", "0.5", "not in this run"]
    assert _cells(md, "stateful-softmax", "### Table 4, MNIST")["our images/s, CPU, batch 1"] == "not in this run"
    assert _cells(md, "linear", "### Table 5, MNIST")["our s/image, CPU, batch 1"] == "2"
    for unnamed in ("b_all", "t_full", "t_other", "torn", "1.65", "99"):
        assert unnamed not in md, unnamed
    assert "Our bits/dim, CPU: one run, `images/a_two` (AMD EPYC (2 cores, 1 threads)): " in md
    assert "left out" not in md and "most attentions" not in md
    assert "## Figure 2: the copy task\n\nPaper" in md and "not yet run" in md.split("## Figure 2", 1)[1]


def test_a_folder_that_cannot_answer_its_part_is_one_line(tmp_path):
    """Two named bits/dim folders on one hardware, a column at a batch its run never measured, a
    folder named for a section without the table that section reads: each one line naming the key
    and the folder (a section used to pass over a folder without its table)."""
    _bpd(tmp_path, "images/a", {"linear": 1.8})
    _bpd(tmp_path, "images/b", {"linear": 1.7})
    _throughput(tmp_path, "throughput/t", [("linear", 1, 0.5)])
    for report, expect in (
            ({"tables_1_2": {"bits_per_dim": ["images/a", "images/b"]}},
             "report.tables_1_2.bits_per_dim: images/a and images/b both hold mnist bits/dim on CPU"),
            ({"table_5": [{"folder": "throughput/t", "batch": 10}]},
             "report.table_5: throughput/t at batch 10 holds no rows"),
            ({"table_4": [{"folder": "images/a", "batch": 1}]}, "report.table_4: images/a holds no throughput.csv"),
            ({"figure1": ["images/a"]}, "report.figure1: images/a holds no benchmark.csv"),
            ({"figure2": ["images/a"]}, "report.figure2: images/a holds no copy_final.csv"),
            ({"table_3": ["images/a"]}, "report.table_3: images/a holds no table of PER per model"),
            ({"kernels": ["images/a"]}, "report.kernels: images/a holds no bench.csv or kernels.csv"),
            ({"memory": ["images/a"]}, "report.memory: images/a holds no model_memory.csv"),
            ({"scorecards": ["throughput/t"]}, "report.scorecards: throughput/t holds no scorecard.csv"),
            ({"gpu_runs": ["images/a"]}, "report.gpu_runs[0]: images/a holds no step of python -m repro.reproduce_gpu"),
    ):
        write_manifest(tmp_path, **report)
        with pytest.raises(SystemExit) as stop:
            main(["--results", str(tmp_path)])
        assert str(stop.value.code).startswith(f"error: {expect}"), stop.value.code


def test_accessors_keep_the_manifests_order(tmp_path):
    _tree(tmp_path)
    named = manifest.check(tmp_path, _with(**{"report.figure2": ["copy/b", "copy/a"]}), "claims.yaml")
    assert named.paths("figure2") == [tmp_path / "copy/b", tmp_path / "copy/a"]
    assert named.columns("table_5") == [manifest.Column(tmp_path / "throughput/t", 1)]
    assert named.paths("scorecards") == [] and named.claim("mnist") is None
    assert named.read() == [tmp_path / "copy/b", tmp_path / "copy/a", tmp_path / "throughput/t"]


def test_a_folder_holding_several_runs_of_one_command_shows_their_range(tmp_path):
    """Three runs of one throughput command published into one folder: a cell they all measured is
    their range with the count, by the one rule (never the slowest, never the last), and the note
    under the table says how many runs; a cell one run measured is its value."""
    s_per_image = {"stateful-softmax": (62.0, 52.1, 54.5), "linear": (42.4, 42.1, 42.5)}
    rows = [(m, 1, 1 / v[i]) for i in range(3) for m, v in s_per_image.items()] + [("softmax", 1, 1 / 300.0)]
    _throughput(tmp_path, "throughput/quiet", rows)
    write_manifest(tmp_path, table_5=[{"folder": "throughput/quiet", "batch": 1, "quiet": True}])
    md = build(tmp_path, tmp_path / "REPORT.md")
    cells = {m: _cells(md, m, "### Table 5, MNIST")["our s/image, CPU, batch 1, quiet run"]
             for m in ("stateful-softmax", "linear", "softmax")}
    assert cells == {"stateful-softmax": "52.1–62 (3 runs)", "linear": "42.1–42.5 (3 runs)", "softmax": "300"}
    assert "quiet run: 3 runs of one command (a cell they all measured: their range)" in md
