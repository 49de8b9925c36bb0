"""The report's section for task=norms, docs/extending.md's example report table: it declares
the table it reads (norms.csv and its columns) and renders one part of REPORT.md. Copied to
repro/reproduction/report/norms.py by tests/test_extending.py."""
from repro.reproduction.report.format import code, command, md_table
from repro.reproduction.report.schema import Table

TABLES = [Table("norms.csv", {"attention": str, "n": float, "output_norm": float})]


def norms(ctx) -> str:
    found = ctx.named("norms", "norms.csv")  # the folders results/claims.yaml lists under report.norms
    out = ["## Output norms (task=norms)"]
    for folder, df in found:
        rows = [[r.attention, int(r.n), r.output_norm] for _, r in df.iterrows()]
        out.append(f"### {folder.relative_to(ctx.root)}\n\nCommand: {code(command(folder, ctx.root))}\n\n"
                   + md_table(["attention", "N", "output norm"], rows))
    return "\n\n".join(out) if found else ""


SECTIONS = [(95, "norms", norms)]  # (its place in REPORT.md, its name for docs blocks, the renderer)
