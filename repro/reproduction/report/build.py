"""The report put together: every section from one reading of the folders results/claims.yaml
names (repro.reproduction.manifest), written to results/REPORT.md, and the docs' report blocks
(`<!-- report:NAME -->`) filled from the same."""
import argparse
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from repro.common.results import REPO, atomic_write
from repro.reproduction import manifest as manifests
from repro.reproduction.manifest import Manifest, ManifestError
from repro.reproduction.report import images
from repro.reproduction.report.format import code, command, hw_class
from repro.reproduction.report.schema import SchemaError, named, read_checked
from repro.reproduction.report.sections import section_modules


@dataclass
class Context:
    """What every section gets: the results folder, links relative to the report being written,
    the manifest (which folders each section shows), every CSV of those folders (read once,
    checked), and what sections computed for others (memo)."""
    root: Path
    rel: object  # path -> link text relative to the report
    manifest: Manifest
    csvs: list
    memo: dict = field(default_factory=dict)

    def tables(self, section: str, part: str | None = None) -> list:
        """(path, table) of the CSVs of the folders (or the files) the manifest names for a section
        or one of its parts, in the manifest's order."""
        return [(p, df) for at in self.manifest.paths(section, part) for p, df in self.csvs
                if p == at or p.parent == at]

    def named(self, section: str, name: str, part: str | None = None) -> list:
        """(folder, table) of the CSV `name` in each folder the manifest names for a section (or
        part), in its order; a named folder without it is a ManifestError naming both."""
        found = dict(named(self.tables(section, part), name))
        for at in self.manifest.paths(section, part):
            if at not in found:
                raise ManifestError(f"report.{section}" + (f".{part}" if part else "")
                                    + f": {at.relative_to(self.root)} holds no {name}")
        return list(found.items())


def others(ctx) -> str:
    """The folders the manifest lists under "Other results", each with its command."""
    rest = ctx.manifest.paths("others")
    if not rest:
        return ""
    lines = ["## Other results", "Folders under results/ with no table of the paper (kernels, ablations, ...):"]
    for d in rest:
        readme = d / "README.md"
        link = f"[{d.relative_to(ctx.root)}]({ctx.rel(readme if readme.is_file() else d)})"
        lines.append(f"- {link}: {code(command(d, ctx.root))}")
    return "\n\n".join([lines[0], lines[1], "\n".join(lines[2:])])


def claims(ctx) -> str:
    """The paper's claims, one verdict each, from the runs the manifest names (repro.reproduction.claims)."""
    from repro.reproduction import claims as claims_module

    return ("## Does it reproduce the paper's claims?\n\nEach claim a CPU can speak to, put to the one CPU-sized run "
            "`results/claims.yaml` names for it (the `*_claims_cpu` presets in `conf/experiment/`; each folder's "
            "README holds its command, git SHA and machine load). The learning claims are judged over at least 5 "
            "seeds a side, each "
            "seed's final value unsmoothed, from Welch's 95 % interval of the gap: reproduced or contradicted "
            "only where the interval excludes 0 on that side, else undecided at this scale with the smallest "
            "gap the runs could have detected; fewer seeds are shown as a measurement with their interval. Rules: "
            "`repro/reproduction/verdicts.py`, their use: "
            "`repro/reproduction/claims.py`.\n\n" + claims_module.section(ctx.root, ctx.manifest).rstrip())


def sections(results: Path, out: Path, manifest: Manifest | None = None) -> dict[str, str]:
    """The report's sections by name, in order (title, claims: the answer first, figure1, figure2,
    tables_1_2, table_4, table_5, table_3, kernels, cpu_speed, gpu_runs, others), links made relative to `out`;
    "" where a section has nothing. `manifest`: the results folder's claims.yaml unless given."""
    results, out = Path(results).resolve(), Path(out).resolve()
    manifest = manifest or manifests.load(results)

    def rel(path):
        return Path(os.path.relpath(Path(path).resolve(), out.parent)).as_posix()

    modules = section_modules()
    # the CSVs of the folders the manifest names, read once for every section, each checked against what the
    # sections declare they read; a section takes its own folders from the manifest (ctx.tables)
    every = read_checked(results, manifest.read(), [t for m in modules for t in getattr(m, "TABLES", [])])
    ctx = Context(results, rel, manifest, every)
    parts = sorted([entry for m in modules for entry in m.SECTIONS] + [(5, "claims", claims)], key=lambda e: e[0])
    rendered = {name: render(ctx) for _, name, render in parts}
    gpu = {hw_class(str(v)) for _, df in ctx.csvs if "device" in df for v in df.device.dropna()}
    gpu = sorted((gpu | {cls for (_, _, cls) in images.chosen_bpd(ctx)}) - {"CPU"})
    shown = results.relative_to(REPO) if REPO in results.parents else results
    title = "\n\n".join([
        "# Report: the paper's tables and figures beside ours",
        f"Generated by `python -m repro.report` from `{shown}`, the runs `{shown}/claims.yaml` names. "
        "Paper values: repro/common/paper.py (from the paper; figure values read off its plots). "
        "Ours: the committed runs, each with the hardware it ran on and the command that produced it. "
        "CPU-sized runs are smaller than the paper's settings: compare shapes (slopes, orderings), "
        "not absolute values. "
        + (f"GPU results: {', '.join(gpu)}." if gpu else
           "GPU: not measured yet (no GPU rows under results/; `python -m repro.reproduce_gpu` makes them).")])
    return {"title": title, **rendered, "others": others(ctx)}


def build(results: Path, out: Path, manifest: Manifest | None = None) -> str:
    return "\n\n".join(p for p in sections(results, out, manifest).values() if p) + "\n"


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
    if args.out and Path(args.out).is_dir():  # the report is one file: say which, before anything is written
        raise SystemExit(f"error: --out {args.out} is a folder; name the file to write, e.g. "
                         f"--out {Path(args.out) / 'REPORT.md'}")
    targets = [results / "REPORT.md"] + ([Path(args.out)] if args.out else [])
    try:  # all read before any is written
        docs = [(page, render_blocks(page, results)) for page in doc_pages()] if args.docs else []
        pages = [(target, build(results, target)) for target in targets]
    except (SchemaError, ManifestError) as err:  # a damaged results file or manifest: one line naming it
        raise SystemExit(f"error: {err}") from None
    for page, text in docs:
        if text != page.read_text():
            atomic_write(page, text)
            print(f"wrote {page}")
    for target, text in pages:
        atomic_write(target, text)
        print(f"wrote {target}")
