"""Docs that cannot rot: README.md and docs/*.md are checked against the code and results/.

1. Every `python run.py ...` command (code blocks and inline code; `-m`, quotes, line
   continuations, env-var prefixes such as OMP_NUM_THREADS=1, `torchrun ... run.py ...`)
   composes with Hydra's compose API and passes repro.cli.preflight.preflight (existing groups, options
   and keys, values of the right type, the composed config valid), with the folders of its
   `PYTHONPATH=...` prefix, if any, on the path (a user's attention class, attention=custom). A sweep `a,b` is checked
   value by value. `hydra/launcher=X` must name a launcher; other `hydra.*` keys are Hydra's.
   Placeholders, the one documented form: `<words>` in a value (`trainer.resume=<run dir>`: the
   key must exist, the value is the reader's), `group=<group>` (the group must exist), an
   argument `<words>` or `...` (more of the reader's arguments), and `[arg]` (optional: checked
   as arg). Every `python -m repro.X` names a module that exists.
2. Every repository path the docs name (inline code starting with repro/, conf/, results/,
   scripts/, tests/, docs/ or .ci/, with `{a,b}` expanded; links `](...)` to files, with their
   `#anchor` a heading of the linked page) exists. A path with a `<placeholder>` names what a run
   makes: the part before the placeholder must exist.
3. Every results table (every table of docs/results.md, and any table elsewhere whose cells
   hold a measured quantity: ms, MB, GB, ×, bits/dim, images/s) is either a block that
   `python -m repro.report --docs` writes (`<!-- report:NAME -->` ... `<!-- /report:NAME -->`,
   and it must be current) or follows a `<!-- csv: PATH ... -->` line naming the CSV/JSON files
   it quotes: each number in its cells (first column and columns headed aim, hardware, run or
   command aside) must be a value of those files, in the units shown (× s→ms, ×100 fraction→%,
   bytes→MB...), rounded as shown, or a number of the paper's (repro/common/paper.py); a number
   followed by × is a ratio of two values of one column.
4. README's "What we found" table quotes the files results/claims.yaml lists under `readme`, in
   its order: the manifest says which run answers which claim, and the README cites no other.
5. No page repeats a heading (its anchor would point at the first), generated blocks included;
   and prose names no CPU model: the machine of a run is data, carried by the generated blocks,
   the tables quoting its files and its folder's README, so prose cannot drift from it.
"""
import ast
import contextlib
import functools
import itertools
import json
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from repro.common.errors import ConfigError
from repro.conf import CONF_DIR
from repro.reproduction import manifest, report

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))

# ----------------------------------------------------------------------------- reading markdown

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
PLACEHOLDER = re.compile(r"<[^<>]+>")


def code_blocks(text: str) -> list[str]:
    """Fenced blocks and indented (4-space) blocks, each with continuation lines joined."""
    blocks = [m[0].split("\n", 1)[1].rsplit("```", 1)[0] for m in FENCE.finditer(text)]
    rest, block = FENCE.sub("", text), []
    for line in rest.split("\n") + [""]:
        if line.startswith("    ") and not line.lstrip().startswith(("-", "*")):
            block.append(line[4:])
        elif block:
            blocks.append("\n".join(block))
            block = []
    return [re.sub(r"\\\n\s*", " ", b) for b in blocks]


def prose(text: str) -> str:
    """The text outside code blocks (inline code kept)."""
    return "\n".join(line for line in FENCE.sub("", text).split("\n") if not line.startswith("    "))


def command_lines(text: str) -> list[tuple[str, str | None]]:
    """(line, the error it is documented to give, or None): a `$ command` line followed by an
    `error: ...` line shows a bad command and its one-line message."""
    out = []
    for block in code_blocks(text):
        lines = block.split("\n")
        for line, after in zip(lines, lines[1:] + [""]):
            shown = line.startswith("$ ") and after.startswith("error: ")
            out.append((line, after.removeprefix("error: ").strip() if shown else None))
    return out + [(span, None) for span in INLINE.findall(prose(text))]


# ----------------------------------------------------------------------------- 1. commands

def run_py_args(line: str) -> list[str] | None:
    """The arguments after run.py when `line` runs it with python or torchrun, else None."""
    line = PLACEHOLDER.sub(lambda m: m[0].replace(" ", "_"), line.strip().removeprefix("$ "))  # one token each
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: not a command
        return None
    for i, tok in enumerate(tokens):
        launcher = [t for t in tokens[:i] if Path(t).name in ("python", "python3", "torchrun")]
        if tok == "run.py" and launcher:
            args = list(itertools.takewhile(lambda t: t not in (";", "&&", "||", "|", ">"), tokens[i + 1:]))
            return args
    return None


def python_path(line: str) -> tuple[str, ...]:
    """The folders (relative to the repository) a `PYTHONPATH=a:b python run.py ...` line adds."""
    m = re.search(r"(?:^|\s)PYTHONPATH=(\S+)\s", line.strip().removeprefix("$ "))
    return tuple(m[1].split(":")) if m else ()


@contextlib.contextmanager
def on_path(folders: tuple[str, ...]):
    """The folders on sys.path for a while; the modules imported from them forgotten after."""
    added = [str(REPO / f) for f in folders]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            sys.path.remove(p)
        for name, module in list(sys.modules.items()):
            if any(str(getattr(module, "__file__", None) or "").startswith(p + "/") for p in added):
                del sys.modules[name]


def module_names(text: str) -> list[str]:
    found = []
    for line, _ in command_lines(text):
        found += re.findall(r"python3? -m (repro(?:\.\w+)*)", line)
    return found


@functools.cache
def _launchers() -> list[str]:
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return GlobalHydra.instance().config_loader().get_group_options("hydra/launcher")


def _variants(overrides):
    """Single-run override lists covering every option of every group sweep (each in turn, the
    other sweeps at their first value): each composes a different config. A value sweep
    (seed=0,1,2) runs at its first value; preflight has type-checked every value."""
    from repro.cli.preflight import _is_group

    values = [[f"{o.get_key_element()}={v}" for v in _sweep_values(o)] if o.is_sweep_override() else [o.input_line]
              for o in overrides]
    values = [vs if _is_group(o.key_or_group) else vs[:1] for o, vs in zip(overrides, values)]
    firsts = [v[0] for v in values]
    out = [firsts]
    for i, vs in enumerate(values):
        out += [firsts[:i] + [v] + firsts[i + 1:] for v in vs[1:]]
    return out


def _sweep_values(o):
    from hydra.core.override_parser.types import Glob

    from repro.cli.preflight import _values
    from repro.conf import group_options

    if isinstance(o.value(), Glob):  # group=glob(...): the group's options it matches, each in turn
        matched = o.value().filter(group_options(o.key_or_group))
        if not matched:
            raise ConfigError(f"{o.input_line} matches no option of {o.key_or_group}")
        return matched
    return [v if isinstance(v, str) else _override_text(v) for v in _values(o)]


def _override_text(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, list):
        return "[" + ",".join(_override_text(x) for x in v) + "]"
    return str(v)


def check_command(args: list[str], pythonpath: tuple[str, ...] = ()) -> str | None:
    """Why the command `PYTHONPATH=<pythonpath> python run.py <args>` would not compose (None: it does)."""
    return _check_command(tuple(args), tuple(pythonpath))


@functools.cache  # pages repeat commands; each check composes the config twice or more
def _check_command(args: tuple[str, ...], pythonpath: tuple[str, ...]) -> str | None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from repro.cli.preflight import preflight

    plain, keys_only, flags = [], [], iter(args)
    for arg in flags:
        if arg.startswith("[") or arg.endswith("...]"):  # [optional]: checked as if given
            arg = arg.removeprefix("[")
            arg = arg.removesuffix("]") if arg.count("]") > arg.count("[") else arg
        if arg in ("-m", "--multirun", "..."):
            continue
        if arg in ("--help", "-h", "--hydra-help", "--version", "--resolve"):
            return None  # Hydra prints and exits
        if arg in ("--cfg", "-c", "--info", "-i", "--package", "-p"):
            next(flags, None)  # the flag's value (job, hydra, all, ...)
            continue
        if arg.startswith("-"):
            return f"unknown flag {arg}"
        key, _, value = arg.partition("=")
        if PLACEHOLDER.fullmatch(arg) or PLACEHOLDER.search(key):
            continue  # the reader's own arguments
        if key == "hydra/launcher":
            if value not in _launchers():
                return f"unknown hydra/launcher {value!r}; valid: {', '.join(_launchers())}"
            continue
        if key.startswith("hydra."):
            continue  # Hydra's own settings
        if PLACEHOLDER.search(value) or value == "...":
            if (CONF_DIR / key.lstrip("+~")).is_dir():
                continue  # group=<group>: the group exists
            keys_only.append(key)
            continue
        plain.append(arg)
    try:
        parsed = OverridesParser.create().parse_overrides(plain)
        if any(o.is_sweep_override() for o in parsed):
            with on_path(pythonpath):
                preflight(["-m"] + plain, pin_sweep_dir=False)  # every value of every sweep: keys, types, options
    except HydraException as e:
        return f"does not parse: {e}"
    except ConfigError as e:
        return f"{' '.join(plain)}: {e}"
    try:
        variants = _variants(parsed)
    except ConfigError as e:
        return str(e)
    for variant in variants:
        why = _check_single(tuple(variant), tuple(keys_only), pythonpath)
        if why:
            return why
    return None


@functools.cache  # one run's overrides, shared by several commands and sweeps
def _check_single(variant: tuple[str, ...], keys_only: tuple[str, ...], pythonpath: tuple[str, ...]) -> str | None:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from repro.cli.preflight import _has_key, preflight

    try:
        with on_path(pythonpath):
            preflight(list(variant), pin_sweep_dir=False)  # repro.cli.preflight's one-line messages first
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=list(variant), return_hydra_config=True)
    except (HydraException, ConfigError) as e:
        return f"{' '.join(variant)}: {str(e).splitlines()[0]}"
    missing = [key for key in keys_only if not _has_key(cfg, key.lstrip("+"))]
    return f"{missing[0]} is not a setting of this config" if missing else None


def commands(page: Path) -> list[tuple[str, list[str], str | None]]:
    """(line, arguments after run.py, the error it is documented to give or None)."""
    return [(line, args, error) for line, error in command_lines(page.read_text())
            if (args := run_py_args(line)) is not None]


# ----------------------------------------------------------------------------- 2. paths

PATH_START = ("repro/", "conf/", "results/", "scripts/", "tests/", "docs/", ".ci/")
MADE_BY_RUNS = ("results/gpu",)  # python -m repro.reproduce_gpu writes it; nothing committed there yet


def expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for part in m[1].split(",") for q in expand_braces(path[:m.start()] + part + path[m.end():])]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to -."""
    heads = re.findall(r"^#+\s+(.*)$", prose(page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def missing_paths(page: Path, repo: Path = REPO) -> list[str]:
    text, out = prose(page.read_text()), []
    named = [span for span in INLINE.findall(text) if span.startswith(PATH_START) and " " not in span.split("<")[0]]
    for span in named:
        for path in expand_braces(span):
            stem = path.split("<")[0].rsplit("/", 1)[0] if "<" in path else path
            if not (repo / stem).exists() and not stem.rstrip("/").startswith(MADE_BY_RUNS):
                out.append(f"`{span}`")
                break
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        if not linked.exists():
            out.append(f"]({target})")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            out.append(f"]({target}) (no such heading)")
    for module in module_names(page.read_text()):
        base = repo / module.replace(".", "/")
        if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()):
            out.append(f"python -m {module}")
    return out


# ----------------------------------------------------------------------------- 3. results tables

MEASURED = re.compile(r"(?<![\w\-])\d+(?:[,.]\d+)*\s*(ms|MB|GB|×|bits/dim|images/s)(?!\w)")
# The one measured table with no rows to check it against; a new one has to be added here, with its reason.
UNCHECKED = {("training.md", "command")}
NUMBER = re.compile(r"(?<![\w.\-])\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
SKIP_COLUMNS = ("aim", "hardware", "run", "command")
SCALES = (1, 1e3, 1e-3, 100, 1 / 2**20, 1e-6, 1 / 2**30, 1e-9)


def tables(text: str) -> list[tuple[int, list[list[str]]]]:
    """(line index of the header, rows of cells) of every markdown table outside code blocks."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"\|\s*-", lines[i + 1]):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            rows = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]] for line in lines[i:j]]
            out.append((i, [rows[0]] + rows[2:]))
            i = j
        else:
            i += 1
    return out


def _columns_of(path: Path) -> dict[str, np.ndarray]:
    """The numbers of a CSV file by column (of a JSON file: all under one name)."""
    if path.suffix == ".json":
        def walk(v):
            if isinstance(v, dict):
                return [x for u in v.values() for x in walk(u)]
            if isinstance(v, list):
                return [x for u in v for x in walk(u)]
            return [float(v)] if isinstance(v, (int, float)) and not isinstance(v, bool) else []
        return {"": np.array(walk(json.loads(path.read_text())))}
    df = pd.read_csv(path)
    return {c: df[c].dropna().to_numpy(float) for c in df.select_dtypes("number").columns}


def paper_numbers() -> set:
    tree = ast.parse((REPO / "repro" / "common" / "paper.py").read_text())
    return {float(n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, (int, float)) and not isinstance(n.value, bool)}


def _shown(s: str) -> tuple[float, float]:
    """The value a cell shows and half its last digit (trailing zeros of an integer are rounding)."""
    digits = s.replace(",", "")
    if "." in digits or "e" in digits:
        decimals = len(digits.split("e")[0].split(".")[1]) if "." in digits else 0
        return float(digits), 0.5 * 10 ** -decimals * (10 ** int(digits.split("e")[1]) if "e" in digits else 1)
    zeros = len(digits) - len(digits.rstrip("0")) if len(digits) > 1 else 0
    return float(digits), 0.5 * 10 ** zeros


def table_problems(page: Path, repo: Path = REPO) -> list[str]:
    text, out = page.read_text(), []
    lines = text.split("\n")
    blocks = [(text[:m.start()].count("\n"), text[:m.end()].count("\n")) for m in report.DOC_BLOCK.finditer(text)]
    paper = np.array(sorted(paper_numbers()))
    shown, ratios_to_check = {}, []  # (file, column) -> the values of it the page shows; the × numbers
    for at, rows in tables(text):
        header, body = rows[0], rows[1:]
        if any(a <= at <= b for a, b in blocks):
            continue  # written by repro.reproduction.report, checked by test_report_blocks_current
        before = next((line for line in reversed(lines[:at]) if line.strip()), "").strip()
        if re.fullmatch(r"<!-- unchecked: .+ -->", before) and (page.name, header[0]) in UNCHECKED:
            continue
        marker = re.fullmatch(r"<!-- csv: (.+?) -->", before)
        if not marker:
            if page.name == "results.md" or any(MEASURED.search(c) for r in body for c in r[1:]):
                out.append(f"line {at + 1}: a results table ({' | '.join(header)}) with neither a "
                           "<!-- csv: ... --> line nor a <!-- report:NAME --> block")
            continue
        columns = {}
        for name in marker[1].split():
            if not (repo / name).is_file():
                out.append(f"line {at + 1}: <!-- csv: {name} -->: no such file")
                continue
            columns |= {(name, c): v for c, v in _columns_of(repo / name).items()}
        for row in body:
            for head, cell in list(zip(header, row))[1:]:
                if head.lower().startswith(SKIP_COLUMNS):
                    continue
                for m in NUMBER.finditer(cell.replace("**", "")):
                    x, tol = _shown(m[0])
                    where = f"line {at + 1}: {row[0]} | {head}: {m[0]}"
                    if cell[m.end():].lstrip().startswith("×"):
                        ratios_to_check.append((x, tol, where + "×", marker[1]))
                        continue
                    hits = [(abs(v * s - x), key, v) for key, vs in columns.items() for s in SCALES
                            for v in vs[np.abs(vs * s - x) <= tol * (1 + 1e-9)]]
                    # the value it shows: in each file, the closest (a number can round several;
                    # a table citing several files may match one number in more than one of them)
                    for file in {key[0] for _, key, _ in hits}:
                        _, key, v = min((h for h in hits if h[1][0] == file), key=lambda h: h[0])
                        shown.setdefault(key, set()).add(v)
                    if not hits and not np.any(np.abs(paper - x) <= tol * (1 + 1e-9)):
                        out.append(f"{where} is not in {marker[1]}")
    # a ratio is one of two values of one column that the page shows (a speed-up of its own numbers)
    for x, tol, where, files in ratios_to_check:
        ratios = np.array([a / b for (file, _), vs in shown.items() if file in files.split()
                           for a in vs for b in vs if b] or [np.nan])
        if not np.any(np.abs(ratios - x) <= tol * (1 + 1e-9)):
            out.append(f"{where} is not a ratio of two values of one column of {files} that the page shows")
    return out


def stale_blocks(page: Path, results: Path = REPO / "results") -> bool:
    return report.render_blocks(page, results) != page.read_text()


# ----------------------------------------------------------------------------- 4. README's files, the manifest's

def readme_problems(readme: Path, results: Path = REPO / "results") -> list[str]:
    """How the files README's "What we found" quotes (its <!-- csv: --> line) differ from the
    manifest's `readme` list (paths under results/, in order)."""
    section = readme.read_text().split("## What we found", 1)[-1].split("\n## ", 1)[0]
    found = re.search(r"<!-- csv: (.+?) -->", section)
    quoted = found[1].split() if found else []
    named = [f"results/{f}" for f in manifest.load(results).readme]
    out = [f"quotes {f}, which results/claims.yaml's readme does not list" for f in quoted if f not in named]
    out += [f"does not quote {f}, which results/claims.yaml's readme lists" for f in named if f not in quoted]
    if not out and quoted != named:
        out.append("quotes the manifest's files in another order")
    return out


# ----------------------------------------------------------------------------- 5. headings, CPU names

# The model names of the CPUs runs have seen or are likely to; a run's rows and README carry its machine.
CPU_MODEL = re.compile(r"\b(Xeon|EPYC|Ryzen|Threadripper|Opteron|Core i\d|Graviton)\b")


def repeated_headings(page: Path) -> list[str]:
    """Headings (outside code, generated blocks included) whose anchor an earlier heading has."""
    seen, out = set(), []
    for head in re.findall(r"^#+\s+(.*)$", prose(page.read_text()), re.M):
        anchor = re.sub(r"[^\w\- ]", "", head.strip().lower()).replace(" ", "-")
        if anchor in seen:
            out.append(head.strip())
        seen.add(anchor)
    return out


def cpu_models_in_prose(page: Path) -> list[str]:
    """'line N: <the line>' for each CPU model named outside the generated blocks and the tables
    that quote results files (a `<!-- csv: ... -->` line above them)."""
    text, out = page.read_text(), []
    lines = text.split("\n")
    data = [(text[:m.start()].count("\n"), text[:m.end()].count("\n")) for m in report.DOC_BLOCK.finditer(text)]
    data += [(at, at + len(rows)) for at, rows in tables(text) if at and lines[at - 1].startswith("<!-- csv: ")]
    for i, line in enumerate(lines):
        if CPU_MODEL.search(line) and not any(a <= i <= b for a, b in data):
            out.append(f"line {i + 1}: {line.strip()}")
    return out


# ----------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_commands_compose(page):
    bad = []
    for line, args, error in commands(page):
        why = check_command(args, python_path(line))
        if error is None and why:
            bad.append(f"{line.strip()}\n    -> {why}")
        elif error is not None and (why is None or error not in why):
            bad.append(f"{line.strip()}\n    -> documented to fail with: {error}\n    -> but: {why or 'it composes'}")
    assert not bad, f"{page.name}: commands that do not compose:\n" + "\n".join(bad)


def test_docs_have_commands():
    """The collector finds the commands (a regex that found none would pass every page)."""
    found = [args for page in PAGES for _, args, _ in commands(page)]
    assert len(found) > 40
    assert any(a[:1] == ["-m"] for a in found)  # sweeps
    assert any("trainer.resume=<run_dir>" in a for a in found)  # placeholders
    torchrun = [line for page in PAGES for line, _, _ in commands(page) if "torchrun" in line]
    assert torchrun


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_paths_exist(page):
    assert not missing_paths(page), f"{page.name} names what does not exist: {missing_paths(page)}"


TEST_PATH = re.compile(r"(?<![\w/])tests/[\w/]+\.py")


def missing_test_files(repo: Path = REPO) -> list[str]:
    """Test files that code comments, configs and pages point a reader to, and that do not exist
    (the tests moved into folders mirroring the package once: a stale pointer misleads quietly)."""
    files = [f for pattern in ("repro/**/*.py", "conf/**/*.yaml", "docs/*.md", "README.md") for f in repo.glob(pattern)]
    return sorted({f"{f.relative_to(repo)}: {m}" for f in files for m in TEST_PATH.findall(f.read_text())
                   if not (repo / m).exists()})


def test_named_test_files_exist():
    assert not missing_test_files(), missing_test_files()


def test_a_comment_naming_a_moved_test_fails(tmp_path):
    (tmp_path / "repro").mkdir()
    (tmp_path / "tests" / "training").mkdir(parents=True)
    (tmp_path / "tests" / "training" / "test_rows.py").write_text("")
    (tmp_path / "repro" / "rows.py").write_text('"""checked by tests/test_rows.py and tests/training/test_rows.py"""\n')
    assert missing_test_files(tmp_path) == ["repro/rows.py: tests/test_rows.py"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_results_tables(page):
    problems = table_problems(page)
    assert not problems, f"{page.name}:\n" + "\n".join(problems)


def test_report_blocks_current():
    stale = [p.name for p in PAGES if report.DOC_BLOCK.search(p.read_text()) and stale_blocks(p)]
    assert not stale, f"report blocks out of date in {stale}: run python -m repro.report --docs"


def test_what_we_found_quotes_the_files_the_manifest_lists():
    assert readme_problems(REPO / "README.md") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_page_repeats_a_heading(page):
    assert not repeated_headings(page), f"{page.name} repeats headings: {repeated_headings(page)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_prose_names_no_cpu_model(page):
    """Say "the 2-core machine of that run" and point at its block or folder README instead."""
    assert not cpu_models_in_prose(page), f"{page.name} names a CPU model in prose:\n" + "\n".join(
        cpu_models_in_prose(page))


def test_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.split("\n")) <= 220
    assert "    make test" in readme and "    make run" in readme  # the set-up and test commands .ci/run relies on


# ----------------------------------------------------------------------------- the checks fail

def test_a_bad_command_fails():
    assert check_command(["experiment=smoke_copy", "attention=linear"]) is None
    assert check_command(["-m", "attention=softmax,linear", "task.lengths=512,1024"]) is None
    assert check_command(["trainer.resume=<run dir>", "experiment=smoke_copy"]) is None
    assert "unknown attention 'foo'" in check_command(["attention=foo"])
    assert "unknown attention 'nope'" in check_command(["-m", "attention=softmax,nope"])  # each sweep value
    assert "trainer.lr is not a setting" in check_command(["experiment=smoke_copy", "trainer.lr=1"])
    assert "trainer.nokey is not a setting" in check_command(["experiment=smoke_copy", "trainer.nokey=<value>"])
    assert "seed=1.5" in check_command(["seed=1.5"])
    assert "unknown hydra/launcher" in check_command(["-m", "hydra/launcher=nope", "seed=0,1"])
    assert check_command(["-m", "hydra/launcher=joblib_cpu", "hydra.launcher.n_jobs=2", "seed=0,1"]) is None
    # a glob sweep: each option it matches (custom needs a class; a glob matching nothing)
    assert check_command(["-m", "task=conformance", "attention=glob(*,exclude=custom)"]) is None
    assert "attention=custom needs your class" in check_command(["-m", "task=conformance", "attention=glob(*)"])
    assert "matches no option" in check_command(["-m", "task=conformance", "attention=glob(nope*)"])


def test_a_users_class_is_checked_with_the_commands_pythonpath():
    line = ("PYTHONPATH=tests/extending python run.py task=conformance attention=custom "
            "attention._target_=my_attention.softplus.SoftplusAttention")
    assert python_path(line) == ("tests/extending",) and python_path("python run.py task=copy") == ()
    assert check_command(run_py_args(line), python_path(line)) is None
    assert "cannot be imported" in check_command(run_py_args(line))  # off the path: the same command fails
    assert "my_attention" not in sys.modules


def test_collector_reads_every_form(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `OMP_NUM_THREADS=1 python run.py -m 'attention=softmax,linear' seed=0`.\n\n"
                    "    torchrun --standalone --nproc_per_node=2 run.py experiment=smoke_copy \\\n"
                    "        attention=linear   # two processes\n"
                    "    $ python run.py attention=foo\n\n"
                    "```\npython3 run.py task=copy\n```\n")
    assert sorted(args for _, args, _ in commands(page)) == sorted([
        ["-m", "attention=softmax,linear", "seed=0"], ["experiment=smoke_copy", "attention=linear"],
        ["attention=foo"], ["task=copy"]])


def test_a_missing_path_fails(tmp_path):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A heading, with: punctuation\n")
    page.write_text("See `repro/reproduction/report/build.py`, `conf/attention/{lsh,softmax}.yaml`, "
                    "`results/gpu/<device>/`, "
                    "[the other page](other.md#a-heading-with-punctuation) and `python -m repro.report`.\n")
    assert missing_paths(page, REPO) == []
    page.write_text("See `repro/nope.py`, `conf/attention/{lsh,nope}.yaml`, [x](../results/NOPE.md), "
                    "[y](#no-heading), `python -m repro.nope`.\n")
    bad = missing_paths(page, REPO)
    assert bad == ["`repro/nope.py`", "`conf/attention/{lsh,nope}.yaml`", "](../results/NOPE.md)",
                   "](#no-heading) (no such heading)", "python -m repro.nope"]


def test_a_readme_quoting_a_file_the_manifest_does_not_list_fails(tmp_path):
    results = tmp_path / "results"
    for f in ("a/x.csv", "b/y.csv"):
        (results / f).parent.mkdir(parents=True, exist_ok=True)
        (results / f).write_text("v\n1\n")
    (results / "claims.yaml").write_text("claims: {}\nreport: {figure2: [a, b]}\nreadme: [a/x.csv, b/y.csv]\n"
                                         "runs: {a: python run.py, b: python run.py}\n")
    page = tmp_path / "README.md"
    page.write_text("# R\n\n## What we found\n\n<!-- csv: results/a/x.csv results/b/y.csv -->\n| a | b |\n")
    assert readme_problems(page, results) == []
    page.write_text("# R\n\n## What we found\n\n<!-- csv: results/b/y.csv results/a/x.csv -->\n| a | b |\n")
    assert readme_problems(page, results) == ["quotes the manifest's files in another order"]
    page.write_text("# R\n\n## What we found\n\n<!-- csv: results/a/x.csv results/c/z.csv -->\n| a | b |\n")
    assert readme_problems(page, results) == [
        "quotes results/c/z.csv, which results/claims.yaml's readme does not list",
        "does not quote results/b/y.csv, which results/claims.yaml's readme lists"]


def test_a_stale_table_fails(tmp_path):
    csv = tmp_path / "r.csv"
    csv.write_text("attention,seconds_per_image,peak_bytes\nlinear,5.483114,13230000\nsoftmax,6.002,5277000\n")
    good = ("<!-- csv: r.csv -->\n| method | s / image | MB | speed-up |\n|---|---|---|---|\n"
            "| linear | 5.48 | 12.6 | 1.09× |\n| softmax | 6.00 | 5.03 | |\n")
    page = tmp_path / "results.md"
    page.write_text(good)
    assert table_problems(page, tmp_path) == []
    page.write_text(good.replace("5.48", "5.38"))  # a number typed by hand, or a rerun not copied over
    assert table_problems(page, tmp_path)[0] == "line 2: linear | s / image: 5.38 is not in r.csv"
    page.write_text(good.replace("1.09×", "1.19×"))
    assert table_problems(page, tmp_path) == [
        "line 2: linear | speed-up: 1.19× is not a ratio of two values of one column of r.csv that the page shows"]
    page.write_text(good.replace("<!-- csv: r.csv -->\n", ""))  # no source at all
    assert "neither a <!-- csv: ... --> line nor a <!-- report:NAME --> block" in table_problems(page, tmp_path)[0]
    # a block repro.reproduction.report writes: current when just written, stale once edited by hand
    page.write_text("<!-- report:table_5 -->\nold\n<!-- /report:table_5 -->\n")
    assert stale_blocks(page)
    page.write_text(report.render_blocks(page, REPO / "results"))
    assert not stale_blocks(page) and "Table 5, MNIST" in page.read_text()
    assert table_problems(page, tmp_path) == []
    page.write_text("<!-- report:tabel_5 -->\n<!-- /report:tabel_5 -->\n")  # a misspelt section: one line
    with pytest.raises(SystemExit, match="unknown report section tabel_5; valid: title, claims, figure1"):
        report.render_blocks(page, REPO / "results")


def test_a_repeated_heading_and_a_cpu_model_in_prose_fail(tmp_path):
    page = tmp_path / "page.md"
    block = "<!-- report:memory -->\n## Memory\n\nHardware: AMD EPYC (2 cores)\n<!-- /report:memory -->\n"
    table = "<!-- csv: r.csv -->\n| run | ms |\n|---|---|\n| Intel Xeon, 1 thread | 3 |\n"
    page.write_text("# Page\n\n## Memory!\n\n    # Memory (a comment in code)\n\n" + block + "\n" + table)
    assert repeated_headings(page) == ["Memory"] and cpu_models_in_prose(page) == []
    page.write_text("# Page\n\n## Whole models\n\nOn this 2-core Intel Xeon VM:\n\n" + block
                    + "\nOn a Ryzen, a Core i7 or an EPYC host.\n")
    assert repeated_headings(page) == []
    assert cpu_models_in_prose(page) == ["line 5: On this 2-core Intel Xeon VM:",
                                         "line 13: On a Ryzen, a Core i7 or an EPYC host."]
