"""The report put together: every section from one reading of results/, written to
results/REPORT.md, and the docs' report blocks (`<!-- report:NAME -->`) filled from the same."""
import argparse
import importlib
import os
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path

from repro.common.results import REPO, atomic_write
from repro.reproduction import report as package
from repro.reproduction.report import images, successors
from repro.reproduction.report.format import code, command, hw_class
from repro.reproduction.report.schema import SchemaError, current_files, read_checked


@dataclass
class Context:
    """What every section gets: the results folder, links relative to the report being written,
    every CSV under results/ (read once, checked) outside the "Beyond the paper" section's folders
    (csvs: what the paper's sections read) and inside them (beyond: that section's own), what
    sections computed for others (memo), and the folders the sections showed (the rest is listed
    under "Other results")."""
    root: Path
    rel: object  # path -> link text relative to the report
    csvs: list
    beyond: list = field(default_factory=list)
    memo: dict = field(default_factory=dict)
    used: set = field(default_factory=set)


def section_modules() -> list:
    """Every module of this package that renders a part of the report (a SECTIONS list of
    (order, name, render(ctx))): adding a table is adding such a module."""
    found = [importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)
             if not m.name.startswith("_")]  # not __main__
    return [m for m in found if hasattr(m, "SECTIONS")]


def others(root, rel, used) -> str:
    rest = sorted({p.parent for p in current_files(root, "*") if p.is_file() and p.name != "REPORT.md"} - used)
    rest = [d for d in rest if d != root and not any(u in d.parents or d in u.parents for u in used)]
    if not rest:
        return ""
    lines = ["## Other results", "Folders under results/ with no table of the paper (kernels, ablations, ...):"]
    for d in rest:
        readme = d / "README.md"
        link = f"[{d.relative_to(root)}]({rel(readme if readme.is_file() else d)})"
        lines.append(f"- {link}: {code(command(d, root))}")
    return "\n\n".join([lines[0], lines[1], "\n".join(lines[2:])])


def claims(ctx) -> str:
    """The paper's claims, one verdict each, from the CPU-sized claim runs (repro.reproduction.claims)."""
    from repro.reproduction import claims as claims_module

    return ("## Does it reproduce the paper's claims?\n\nEach claim a CPU can speak to, put to one declared "
            "CPU-sized run (the `*_claims_cpu` presets in `conf/experiment/`; each folder's README holds its "
            "command, git SHA and machine load). The learning claims are judged over at least 5 seeds a side, each "
            "seed's final value unsmoothed, from Welch's 95 % interval of the gap: reproduced or contradicted "
            "only where the interval excludes 0 on that side, else undecided at this scale with the smallest "
            "gap the runs could have detected; fewer seeds are shown as a measurement with their interval. Rules: `repro/reproduction/verdicts.py`, their use: "
            "`repro/reproduction/claims.py`.\n\n" + claims_module.section(ctx.root).rstrip())


def sections(results: Path, out: Path) -> dict[str, str]:
    """The report's sections by name, in order (title, claims: the answer first, figure1, figure2,
    tables_1_2, table_4, table_5, table_3, kernels, cpu_speed, gpu_runs, others), links made relative to `out`;
    "" where a section has nothing."""
    results, out = Path(results).resolve(), Path(out).resolve()

    def rel(path):
        return Path(os.path.relpath(Path(path).resolve(), out.parent)).as_posix()

    modules = section_modules()
    # every CSV read once, for every section, each checked against what the sections declare they read;
    # the successors' folders go to their own section alone (in one place: no paper section can pick them up)
    every = read_checked(results, [t for m in modules for t in getattr(m, "TABLES", [])])
    ctx = Context(results, rel, [(p, df) for p, df in every if not successors.owned(p, results)],
                  [(p, df) for p, df in every if successors.owned(p, results)])
    ctx.used |= {results / f for f in successors.FOLDERS if (results / f).is_dir()}
    parts = sorted([entry for m in modules for entry in m.SECTIONS] + [(5, "claims", claims)], key=lambda e: e[0])
    rendered = {name: render(ctx) for _, name, render in parts}
    gpu = {hw_class(str(v)) for _, df in ctx.csvs + ctx.beyond if "device" in df for v in df.device.dropna()}
    gpu = sorted((gpu | {cls for (_, _, cls) in images.chosen_bpd(ctx)}) - {"CPU"})
    shown = results.relative_to(REPO) if REPO in results.parents else results
    title = "\n\n".join([
        "# Report: the paper's tables and figures beside ours",
        f"Generated by `python -m repro.report` from `{shown}`. "
        "Paper values: repro/common/paper.py (from the paper; figure values read off its plots). "
        "Ours: the committed runs, each with the hardware it ran on and the command that produced it. "
        "CPU-sized runs are smaller than the paper's settings: compare shapes (slopes, orderings), "
        "not absolute values. "
        + (f"GPU results: {', '.join(gpu)}." if gpu else
           "GPU: not measured yet (no GPU rows under results/; `python -m repro.reproduce_gpu` makes them).")])
    return {"title": title, **rendered, "others": others(results, rel, ctx.used)}


def build(results: Path, out: Path) -> str:
    return "\n\n".join(p for p in sections(results, out).values() if p) + "\n"


# A page of the docs embeds a section between `<!-- report:NAME -->` and `<!-- /report:NAME -->`
# (NAME a key of `sections`); `--docs` rewrites what lies between, tests/test_docs.py checks it is current.
DOC_BLOCK = re.compile(r"(<!-- report:(\w+) -->\n)(?:.*?\n)?(<!-- /report:\2 -->)", re.S)


def render_blocks(page: Path, results: Path) -> str:
    """The text of `page` with each report block filled from `results` (links relative to the page)."""
    text = Path(page).read_text()
    if not DOC_BLOCK.search(text):
        return text
    found = sections(results, page)
    unknown = sorted({m[2] for m in DOC_BLOCK.finditer(text)} - found.keys())
    if unknown:
        raise SystemExit(f"error: {page}: unknown report section {', '.join(unknown)}; valid: {', '.join(found)}")
    return DOC_BLOCK.sub(lambda m: m[1] + (found[m[2]] or "(nothing under results/ yet)") + "\n" + m[3], text)


def doc_pages() -> list[Path]:
    return [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m repro.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(REPO / "results"), help="the results folder (default: results/)")
    ap.add_argument("--out", default=None, help="also write the report here (figure links relative to it)")
    ap.add_argument("--docs", action="store_true",
                    help="also rewrite the <!-- report:NAME --> blocks of README.md and docs/*.md")
    args = ap.parse_args(argv)
    results = Path(args.results)
    if not results.is_dir():
        raise SystemExit(f"error: no results folder at {results}")
    if args.docs:
        for page in doc_pages():
            text = render_blocks(page, results)
            if text != page.read_text():
                atomic_write(page, text)
                print(f"wrote {page}")
    targets = [results / "REPORT.md"] + ([Path(args.out)] if args.out else [])
    try:
        pages = [(target, build(results, target)) for target in targets]  # all read before any is written
    except SchemaError as err:  # a damaged results file: one line naming it, nothing written
        raise SystemExit(f"error: {err}") from None
    for target, text in pages:
        atomic_write(target, text)
        print(f"wrote {target}")
