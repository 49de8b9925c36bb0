"""What the report reads, declared: each section lists the tables it reads (a Table: the file
name, the columns it needs with their kinds, the columns it may use), and every CSV under
results/ is read once and checked against those declarations. A renamed or dropped column, a
number column holding text, a CSV that does not parse: one error naming the file and the column,
never a section that quietly reads another folder or a table that loses a row."""
import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd


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


ARCHIVE = "archive"  # results/archive/: runs superseded by newer ones, kept but never reported


def current_files(root: Path, pattern: str) -> list[Path]:
    """The files under root matching pattern, in path order, leaving out results/archive/."""
    return sorted(p for p in Path(root).rglob(pattern) if ARCHIVE not in p.relative_to(root).parts[:1])


def read_checked(root: Path, tables) -> list[tuple[Path, pd.DataFrame]]:
    """(path, table) of every CSV under root (archive/ aside), in path order, each checked against
    every declared Table it matches. A file that does not parse is a SchemaError naming it."""
    out = []
    for path in current_files(root, "*.csv"):
        try:
            df = pd.read_csv(path)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
            where = path.relative_to(root) if Path(root) in path.parents else path
            raise SchemaError(f"{where}: not a readable CSV ({str(err).splitlines()[0]})") from err
        for table in tables:
            if table.matches(path, df):
                table.check(path, df, Path(root))
        out.append((path, df))
    return out


def named(csvs, name: str) -> list[tuple[Path, pd.DataFrame]]:
    """(folder, table) of the CSVs called `name`, in path order."""
    return [(path.parent, df) for path, df in csvs if path.name == name]
