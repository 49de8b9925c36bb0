"""python -m repro.report --out: the report is one file, so a folder given as --out is one line,
before anything is read or written (it was an IsADirectoryError traceback, after REPORT.md had
been written into the results folder)."""
import subprocess
import sys

import pytest

from repro.common.results import REPO


@pytest.mark.parametrize("module", ["repro.report", "repro.reproduction.report"])
def test_out_a_folder_is_one_line_and_nothing_is_written(tmp_path, module):
    results, out = tmp_path / "results", tmp_path / "out"
    results.mkdir()
    out.mkdir()
    res = subprocess.run([sys.executable, "-m", module, "--results", str(results), "--out", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [f"error: --out {out} is a folder; name the file to write, e.g. "
                                               f"--out {out / 'REPORT.md'}"]
    assert not list(results.iterdir()) and not list(out.iterdir())
