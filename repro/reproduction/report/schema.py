"""What the report reads, declared: each section lists the tables it reads (a Table: the file
name, the columns it needs with their kinds, the columns it may use), and every CSV of the
folders results/claims.yaml names is read once and checked against those declarations. A
renamed or dropped column, a number column holding text, a CSV that does not parse: one error
naming the file and the column, never a section that quietly reads another folder or a table
that loses a row. A torn file (a
last line cut off: no newline at its end, or a row short of the header's fields; a JSON or JSONL
file that does not parse) is one error naming the file and the line: a write that did not finish
must never read as a row with missing values, which the report would then compare as numbers."""
import csv
import fnmatch
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from repro.training.parts import TIME_LIMIT


class SchemaError(ValueError):
    """A results file that is not what the section reading it declares."""


@dataclass(frozen=True)
class Table:
    """A results table a section reads. `name`: the file name (a glob, "*.csv" for any);
    `required`: column -> kind (float: numbers, NaN allowed; str: anything); `optional`: columns
    checked for their kind when present; `when`: for a name that matches many files, the column
    whose presence makes a file this table (a CSV with a bits/dim column is a bits/dim table)."""
    name: str
    required: dict
    optional: dict = field(default_factory=dict)
    when: str | None = None

    def matches(self, path: Path, df: pd.DataFrame) -> bool:
        return fnmatch.fnmatch(path.name, self.name) and (self.when is None or self.when in df.columns)

    def check(self, path: Path, df: pd.DataFrame, root: Path):
        where = path.relative_to(root) if root in path.parents else path
        missing = [c for c in self.required if c not in df.columns]
        if missing:
            raise SchemaError(f"{where}: no column {', '.join(map(repr, missing))} (read as a {self.name} table"
                              + (f" with a {self.when!r} column" if self.when else "")
                              + f", which needs {', '.join(self.required)})")
        for col, kind in {**self.required, **self.optional}.items():
            if kind is float and col in df.columns and not pd.api.types.is_numeric_dtype(df[col]) \
                    and not pd.api.types.is_bool_dtype(df[col]):
                values = pd.to_numeric(df[col], errors="coerce")
                bad = df[col][values.isna() & df[col].notna()]
                if len(bad):
                    line = int(bad.index[0]) + 2  # the header is line 1
                    raise SchemaError(f"{where}, line {line}: column {col!r} holds {bad.iloc[0]!r}, not a number")


def failed(status) -> bool:
    """A run's status says it failed (error: ..., oom, timeout, stopped by a signal): its numbers
    are shown as failed with that status, never as a result or in a verdict. A run that reached
    its time budget (trainer.max_time_s: the equal-time runs end so on purpose) has not failed."""
    return str(status) not in ("ok", TIME_LIMIT)


def read_checked(root: Path, paths, tables) -> list[tuple[Path, pd.DataFrame]]:
    """(path, table) of the CSVs the manifest names: each file of `paths` and each CSV directly in
    each folder of it, in that order, each checked against every declared Table it matches. A file
    that does not parse is a SchemaError naming it."""
    out, seen = [], set()
    for at in paths:
        for path in ([at] if at.is_file() else sorted(Path(at).glob("*.csv"))):
            if path in seen:
                continue
            seen.add(path)
            df = _read_csv(path, root)
            for table in tables:
                if table.matches(path, df):
                    table.check(path, df, Path(root))
            out.append((path, df))
    return out


def _read_csv(path: Path, root) -> pd.DataFrame:
    where = _where(path, root)
    try:
        _check_whole(path, where)
        return pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise SchemaError(f"{where}: not a readable CSV ({str(err).splitlines()[0]})") from err


def _where(path: Path, root) -> Path:
    return path.relative_to(root) if Path(root) in path.parents else path


def _check_whole(path: Path, where):
    """A CSV whose every row has the header's fields and whose last line ends (every writer here
    ends a file with a newline and writes it whole: anything else is a torn write)."""
    text = path.read_text()
    if not text.strip():
        raise pd.errors.EmptyDataError("the file is empty")
    rows = list(csv.reader(io.StringIO(text)))
    if not text.endswith("\n"):
        raise SchemaError(f"{where}, line {len(rows)}: the last line is cut off (no newline at its end): "
                          "a write that did not finish; rewrite the file from its run")
    width = len(rows[0])
    short = next(((i, len(r)) for i, r in enumerate(rows[1:], 2) if r and len(r) != width), None)
    if short:
        raise SchemaError(f"{where}, line {short[0]}: {short[1]} fields where the header has {width} "
                          "(a torn or hand-edited row)")


def read_json(path: Path, root) -> dict:
    """A JSON file the report reads (summary.json, status.json, env.json), or one SchemaError
    naming it and where it stops parsing."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        at = f", line {err.lineno}" if isinstance(err, json.JSONDecodeError) else ""
        raise SchemaError(f"{_where(Path(path), root)}{at}: not valid JSON ({str(err).splitlines()[0]}): "
                          "a torn write; rewrite it from its run") from err


@dataclass(frozen=True)
class Rows:
    """Run rows (a .jsonl file) a reader needs, declared as a Table is: `fields` maps a row's
    `kind` ("train", "eval", "final"; "*" for every row) to the fields every row of that kind must
    hold, with their kinds (float: a number or null, NaN allowed; str: anything)."""
    name: str
    fields: dict

    def check(self, rows: list[dict], where):
        if not rows:
            raise SchemaError(f"{where}: no rows (an empty file: a run that wrote nothing, or a torn write)")
        for line, r in enumerate(rows, 1):
            for kind, need in self.fields.items():
                if kind != "*" and r.get("kind") != kind:
                    continue
                missing = [f for f in need if f not in r]
                if missing:
                    what = "every row" if kind == "*" else f"a {kind!r} row"
                    raise SchemaError(f"{where}, line {line}: no field {', '.join(map(repr, missing))} ({what} of a "
                                      f"{self.name} needs {', '.join(need)})")
                bad = next((f for f, t in need.items() if t is float and not _number(r[f])), None)
                if bad:
                    raise SchemaError(f"{where}, line {line}: field {bad!r} holds {r[bad]!r}, not a number")


def _number(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def read_rows(path: Path, root, declared: Rows | None = None) -> list[dict]:
    """The rows of a JSONL file, every line whole (a torn last line is damage here: the run has
    finished, and a row silently missing changes a table or a verdict), checked against what the
    reader declares; anything else one SchemaError naming the file and the line."""
    from repro.common.results import read_jsonl

    where = _where(Path(path), root)
    try:
        rows = read_jsonl(path, strict=True)
    except (ValueError, UnicodeDecodeError) as err:
        raise SchemaError(f"{where}, {str(err).splitlines()[0]}") from err
    if declared is not None:
        declared.check(rows, where)
    return rows


def read_table(path: Path, root, table: Table) -> pd.DataFrame:
    """One CSV (outside the report's single reading of results/: the claims), checked as a
    section's tables are."""
    df = _read_csv(Path(path), root)
    table.check(Path(path), df, Path(root))
    return df


def named(csvs, name: str) -> list[tuple[Path, pd.DataFrame]]:
    """(folder, table) of the CSVs called `name`, in path order."""
    return [(path.parent, df) for path, df in csvs if path.name == name]
