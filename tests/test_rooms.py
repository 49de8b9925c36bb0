"""Each room of the package holds what its name says: the command line (repro/cli) sits on top of
the experiments' floor, so the training loop, the data, the models, the attentions and the
kernels never import it (what they share with it lives below: repro.common, repro.conf)."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BELOW_THE_CLI = ("training", "data", "models", "attention", "kernels")


def cli_imports(path: Path) -> list[str]:
    """The statements of `path`, at any depth, that import repro.cli or a module of it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                 if isinstance(node, ast.ImportFrom) else [])
        if any(n == "repro.cli" or n.startswith("repro.cli.") for n in names):
            found.append(node.lineno)
    where = path.relative_to(REPO) if REPO in path.parents else path.name
    return [f"{where}:{line}" for line in sorted(found)]


def test_training_and_data_never_import_repro_cli():
    found = [hit for room in BELOW_THE_CLI for p in sorted((REPO / "repro" / room).rglob("*.py"))
             for hit in cli_imports(p)]
    assert not found, found


def test_the_check_sees_a_cli_import(tmp_path):
    """The check above can fail: each way of naming repro.cli is caught, and nothing else."""
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nfrom repro.common.errors import ConfigError\n\ndef f():\n"
                     "    from repro.cli.jobs import error_line\nfrom repro import cli\nimport repro.cli.publish\n")
    assert cli_imports(probe) == ["probe.py:5", "probe.py:6", "probe.py:7"]
