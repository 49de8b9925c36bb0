"""The manifest of a results tree a test writes: write_manifest(root, ...) writes root/claims.yaml
naming the folders given (the report and the claims show only those), each folder's command taken
from where it lies: its command.txt, a README that gives it, the JSON beside a run file, or none."""
from pathlib import Path

from omegaconf import OmegaConf

from repro.reproduction import manifest
from repro.reproduction.report.format import command


def source(root: Path, folder: str) -> str:
    """Where `folder`'s command is, as a manifest's runs say it."""
    here = root / folder
    if (here / manifest.COMMAND_TXT).is_file():
        return manifest.COMMAND_TXT
    if not command(here, root).startswith("not recorded"):
        return manifest.README
    if any(f.with_suffix(".json").is_file() for f in here.glob("cpu_speed_*.csv")):
        return manifest.RUN_JSON
    return "not recorded"


def write_manifest(root, claims=None, readme=(), archived=None, runs=None, **report) -> Path:
    """root/claims.yaml with these claims, report sections (as keyword arguments: figure1=[...],
    tables_1_2={...}, ...), README files and archived folders; `runs` derived unless given."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    named = manifest.Manifest(root, dict(claims or {}), report, tuple(readme), {}, {})
    runs = runs if runs is not None else {f: source(root, f) for f in manifest.cited(named)}
    data = {"claims": dict(claims or {}), "report": report, "readme": list(readme), "runs": runs,
            "archived": dict(archived or {})}
    path = root / manifest.NAME
    OmegaConf.save(OmegaConf.create(data), path)
    return path
