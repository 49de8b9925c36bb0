"""The report's sections: every module of this package with a SECTIONS list of (order, name,
render(ctx)). Adding a table is adding such a module; the report (build.py) renders them and the
manifest (repro.reproduction.manifest) takes their names as the sections it may name."""
import importlib
import pkgutil
from pathlib import Path


def section_modules() -> list:
    here = [str(Path(__file__).parent)]
    found = [importlib.import_module(f"{__package__}.{m.name}") for m in pkgutil.iter_modules(here)
             if not m.name.startswith("_")]  # not __main__
    return [m for m in found if hasattr(m, "SECTIONS")]
