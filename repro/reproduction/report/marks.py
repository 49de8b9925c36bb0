"""How the report marks a measured value it shows: "extrapolated" where the run stopped at its
time budget and extrapolated the rest, "loaded" where the machine had more runnable processes than
cores while it ran (its wall-clock values are inflated). Every section that prints a speed reads
these marks from the run's rows here."""
import re

from repro.common.results import run_load
from repro.reproduction.report.format import num


def extrapolated(r) -> bool:
    return str(r.get("extrapolated", "")).lower() == "true"


def _cores(device: str) -> int | None:
    m = re.search(r"\((\d+) cores", str(device))
    return int(m.group(1)) if m else None


def loaded(r) -> bool:
    """More runnable processes than cores while it ran: its wall-clock values are inflated."""
    load, cores = run_load(r), _cores(r.get("device", ""))
    return load is not None and cores is not None and load > cores


def names(is_extrapolated: bool, is_loaded: bool) -> list[str]:
    """The marks that apply, in the order every section prints them."""
    return [m for m, on in (("extrapolated", is_extrapolated), ("loaded", is_loaded)) if on]


def with_marks(text, is_extrapolated: bool, is_loaded: bool):
    """`text (extrapolated, loaded)`, with the marks that apply; text unchanged when none does or it is empty."""
    on = names(is_extrapolated, is_loaded)
    return f"{text} ({', '.join(on)})" if text and on else text


def marked(value, r) -> str:
    """A measured value, marked where it stands when the run was extrapolated or loaded."""
    return with_marks(num(float(value)), extrapolated(r), loaded(r))
