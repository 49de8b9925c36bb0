"""A training run's rows on disk: <run dir>/results.jsonl, one JSON object per line, appended
and flushed row by row.

Appending keeps the bytes written linear in the rows: a paper-scale run logs tens of thousands of
rows, and rewriting the whole file for each one (as every other results file here is written)
would write hundreds of GB. The price of appending is that a crash (kill -9, a full disk) can
leave the last line half written: read_rows ignores such a torn last line, and a resume rewrites
the file (atomically) with exactly the rows its checkpoint had seen before appending again.
"""
import json
import os
from pathlib import Path

from repro.common.results import atomic_write, read_jsonl
from repro.training.checkpoint import run_dir_of


def _line(row) -> str:
    return json.dumps(row, default=str) + "\n"


def read_rows(path) -> list[dict]:
    """The rows of a results.jsonl; a torn last line (no newline, not valid JSON) is left out."""
    return read_jsonl(path)


def append_row(path, row: dict):
    """One row appended to a results.jsonl (e.g. a task's summary after fit's rows)."""
    with open(path, "a") as f:
        f.write(_line(row))


class RowLog:
    """results.jsonl of one run: starts as `history` (written atomically; a resume's rows so far,
    or nothing), then each append() adds one line and flushes it to the OS. `len()` counts the
    rows in the file, history included: a checkpoint records it, so a resume keeps exactly the
    rows that preceded its checkpoint (tests/training/test_rows.py)."""

    def __init__(self, path, history=(), write=True):
        self.path, self.count, self.write = Path(path), len(history), write
        self._file = None
        if write:
            atomic_write(self.path, "".join(_line(r) for r in history))
            self._file = open(self.path, "a")

    def append(self, row: dict):
        self.count += 1
        if self._file is not None:
            self._file.write(_line(row))
            self._file.flush()

    def sync(self):
        """Down to the disk (before a checkpoint names this many rows)."""
        if self._file is not None:
            os.fsync(self._file.fileno())

    def __len__(self):
        return self.count

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None


def resumed_history(ckpt: dict) -> list[dict]:
    """The rows a checkpoint had seen: the first ckpt["rows_written"] rows of the results.jsonl
    beside it (<run dir>/results.jsonl for <run dir>/checkpoints/last.pt). Checkpoints written
    before rows left them (they carried every row) give theirs."""
    if "rows" in ckpt:
        return list(ckpt["rows"])
    n = ckpt.get("rows_written", 0)
    path = Path(ckpt["path"])
    source = run_dir_of(path) / "results.jsonl"
    rows = read_rows(source) if source.is_file() else []
    if len(rows) < n:
        print(f"warning: the checkpoint {path} follows {n} result rows but {source} holds {len(rows)}; "
              f"the resumed results.jsonl starts with those {len(rows)}")
    return rows[:n]
