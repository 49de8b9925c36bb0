"""Every commit a committed result quotes exists in this repository: the git SHA of every results
row (JSONL, JSON, CSV) and every short SHA written in the results' READMEs, tables, REPORT.md, README.md and docs/
must resolve (`git cat-file -e`). A run made in another worktree names the commit of main whose
tree it ran; otherwise it is run again."""
import csv
import json
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
DOCS = REPO / "docs"
SHA_KEYS = {"git_sha", "commit"}          # our own commit; authors_commit / library_commit name other repositories
FOREIGN_KEYS = {"authors_commit", "library_commit"}
TEXT = re.compile(r"(?<![\w-])([0-9a-f]{7,12})(?:-dirty)?(?![\w])")

pytestmark = pytest.mark.skipif(
    subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True,
                   text=True).stdout.strip() != "false",
    reason="needs the repository's whole history (not a git checkout, or a shallow clone)")


@cache
def exists(sha: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=REPO, capture_output=True).returncode == 0


def quoted(path: Path, foreign: set) -> set[str]:
    """The commits `path` quotes: SHA fields of its rows, or short SHAs in its text."""
    found = set()

    def walk(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k in SHA_KEYS and isinstance(v, str) and v:
                    found.add(v.removesuffix("-dirty"))
                elif k in FOREIGN_KEYS and isinstance(v, str):
                    foreign.add(v[:7])
                else:
                    walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    text = path.read_text(errors="replace")
    if path.suffix == ".jsonl":
        for line in text.splitlines():
            if line.strip():
                walk(json.loads(line))
    elif path.suffix == ".json":
        walk(json.loads(text))
    elif path.suffix == ".csv":
        csv.field_size_limit(1 << 30)
        for row in csv.DictReader(text.splitlines()):
            walk(row)
    elif path.suffix in (".md", ".txt", ".yaml"):
        found |= {m for m in TEXT.findall(text) if re.search(r"\d", m) and re.search(r"[a-f]", m)}
    return found


def unresolved() -> dict[str, set[str]]:
    foreign, out = set(), {}
    files = sorted(p for p in RESULTS.rglob("*") if p.is_file())
    data = [p for p in files if p.suffix in (".jsonl", ".json", ".csv")]
    text = [p for p in files if p.suffix in (".md", ".txt", ".yaml")] + [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
    for path in data + text:  # rows first: they name the other repositories' commits the text may quote
        missing = {s for s in quoted(path, foreign) if not exists(s) and s[:7] not in foreign}
        if missing:
            out[str(path.relative_to(RESULTS) if path.is_relative_to(RESULTS) else path.relative_to(REPO))] = missing
    return out


def test_every_quoted_commit_exists():
    bad = unresolved()
    assert not bad, "results quoting commits absent from the repository (run them again at a commit of main):\n" + \
        "\n".join(f"  {f}: {', '.join(sorted(s))}" for f, s in sorted(bad.items()))


def test_the_scan_sees_a_missing_commit(tmp_path):
    """The check can fail: a row naming a commit that is not in the repository, and a README quoting one."""
    row, readme = tmp_path / "rows.jsonl", tmp_path / "README.md"
    row.write_text(json.dumps({"git_sha": "0123456789ab-dirty", "authors_commit": "fedcba9876543210"}) + "\n")
    readme.write_text("| run | fedcba9 | 0123abc | data tts-4cdf4fae9520 |\n")
    foreign = set()
    assert quoted(row, foreign) == {"0123456789ab"} and foreign == {"fedcba9"}
    assert quoted(readme, foreign) == {"fedcba9", "0123abc"}
    assert not exists("0123456789ab") and exists(subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO,
                                                               capture_output=True, text=True).stdout.strip()[:12])
