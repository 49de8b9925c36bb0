"""What every section of the report shares: markdown tables and numbers, the hardware a table
ran on, and the command that produced a results folder."""
import math
import re
from pathlib import Path


def num(v: float) -> str:
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"


def md_table(header, rows) -> str:
    def cell(v):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "—"
        if isinstance(v, float):
            return num(v)
        return str(v).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def _commands_in(text: str) -> list[tuple[str, str]]:
    """(line, command) for every `python ...` command in a README: indented or fenced lines (with
    backslash continuations) and inline `...` spans."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        for span in re.findall(r"`([^`]*python [^`]*)`", line):
            out.append((line, span))
        m = re.match(r"^\s+((?:[A-Z_]+=\S+ )*python .*)$", line)
        if m:
            parts, j = [m.group(1)], i
            while parts[-1].endswith("\\") and j + 1 < len(lines):
                j += 1
                parts[-1] = parts[-1][:-1].rstrip()
                parts.append(lines[j].strip())
            out.append((line, " ".join(parts)))
    return out


def command(folder: Path, root: Path) -> str:
    """The command that produced `folder` (see the module docstring)."""
    if (folder / "command.txt").is_file():
        # one command a line, a trailing backslash continuing it; several come back one a line
        text = re.sub(r"\s*\\\s*\n\s*", " ", (folder / "command.txt").read_text())
        return "\n".join(line.strip() for line in text.splitlines() if line.strip())
    d = folder
    while True:
        found = _commands_in((d / "README.md").read_text()) if (d / "README.md").is_file() else []
        if d != folder:  # a parent's README: only a command on a line naming this folder (its first
            # command may be another folder's: a run published beside them would be credited with it)
            found = [(line, c) for line, c in found if f"{folder.relative_to(d).as_posix()}" in line]
        if found:
            return found[0][1]
        if d == root or root not in d.parents:
            return "not recorded (add a command.txt)"
        d = d.parent


def hardware(df) -> str:
    if "device" not in df:
        return "not recorded"
    return "; ".join(sorted(set(map(str, df.device.dropna()))))[:200] or "not recorded"


def is_gpu(device: str) -> bool:
    return bool(re.search(r"nvidia|cuda|tesla|geforce|\b[AHVLP]\d{2,3}\b", device, re.I))


def hw_class(device: str) -> str:
    """The hardware a result is shown under: "CPU" for every CPU (their device strings differ by
    thread count), else the GPU's own name (two GPUs are two columns)."""
    return device.strip() if is_gpu(device) else "CPU"


def dataset_of(value) -> str | None:
    v = str(value).lower()
    return "cifar10" if "cifar" in v else "mnist" if "mnist" in v else None


def code(text) -> str:
    """Commands as code spans, one span each (text: one command a line), so that each one can be
    copied and run as it is."""
    return "; ".join(f"`{line}`" for line in str(text).splitlines())


def commands_of(folders, root) -> str | None:
    cmds = "\n".join(dict.fromkeys(c for f in folders for c in command(f, root).splitlines()))
    return code(cmds) if cmds else None


def run_rows(folder):
    """The run rows (.jsonl) beside a table, as dicts."""
    from repro.reproduction.report.schema import read_rows

    return [r for path in sorted(folder.glob("*.jsonl")) for r in read_rows(path, folder.parent)]
