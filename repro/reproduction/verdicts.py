"""The verdict rules, in one place. A claim is judged only over at least MIN_SEEDS seeds of one
declared run: each side is its seeds' mean ± standard deviation, and a gap counts only when it
is larger than the spread of a difference of one seed of each (sqrt(sd_a^2 + sd_b^2)); a gap
inside it is a tie. Three verdicts:

    reproduced               the runs show what the paper says, by more than the spread
    contradicted             they show the opposite, by more than the spread
    undecided at this scale  the gap is inside the spread (with, where the curves still move,
                             how many more steps their last slopes would need to clear it)

With fewer seeds a result is shown as a measurement, not judged. Rules are pure functions of
numbers, tested one outcome at a time (tests/test_claims.py)."""
import math
from dataclasses import dataclass

REPRODUCED, CONTRADICTED, UNDECIDED = "reproduced", "contradicted", "undecided at this scale"
MEASURED, NOT_TESTABLE = "measured, not judged", "not testable here"
MIN_SEEDS = 3
SLOPE_TOL = 0.25  # a log-log slope within this of the paper's counts as the same growth


@dataclass(frozen=True)
class Seeds:
    """One attention's final value over the seeds of a run (NaN never counts as a value)."""
    values: tuple

    def __post_init__(self):
        bad = [v for v in self.values if not math.isfinite(v)]
        if bad:
            raise ValueError(f"a verdict is never computed from a non-finite value: {bad}")

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return sum(self.values) / self.n

    @property
    def sd(self) -> float:
        if self.n < 2:
            return 0.0
        m = self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values) / (self.n - 1))

    def text(self, fmt="{:.3g}") -> str:
        return f"{fmt.format(self.mean)} ± {fmt.format(self.sd)} ({self.n} seeds)"


def spread(a: Seeds, b: Seeds) -> float:
    """The standard deviation of the difference of one seed of a and one of b."""
    return math.hypot(a.sd, b.sd)


def steps_to_clear(gap: float, rate: float, margin: float) -> float | None:
    """How many more steps until a gap moving by `rate` per step passes `margin` (in the claimed
    direction, gap > 0 meaning as claimed); None when it never does at that rate."""
    if gap > margin:
        return 0.0
    if rate <= 0:
        return None
    return (margin - gap) / rate


def below(low: Seeds, high: Seeds, rate: float | None = None) -> tuple[str, str]:
    """Claim: `low` ends below `high` (lower is better). rate: how fast high - low grows per step
    at the end of the curves (for the undecided case). Returns (verdict, why)."""
    if min(low.n, high.n) < MIN_SEEDS:
        return MEASURED, f"{min(low.n, high.n)} seed(s); judged from {MIN_SEEDS}"
    gap, s = high.mean - low.mean, spread(low, high)
    if gap > s:
        return REPRODUCED, f"gap {gap:.3g} > spread {s:.3g}"
    if gap < -s:
        return CONTRADICTED, f"the other way round by {-gap:.3g} > spread {s:.3g}"
    why = f"gap {gap:.3g} within spread {s:.3g}"
    if rate is not None:
        more = steps_to_clear(gap, rate, s)
        why += ("; the last slopes would not clear it" if more is None
                else f"; at the last slopes it clears the spread after ~{more:,.0f} more steps")
    return UNDECIDED, why


def slopes(ours: dict[str, float], paper: dict[str, float], tol: float = SLOPE_TOL) -> tuple[str, str]:
    """Claim: log time grows against log N with the paper's slopes (a measurement of one sweep,
    its own fit over many N): reproduced when every slope is within tol of the paper's,
    contradicted when the ordering of the slopes is the other way round, else undecided."""
    off = {a: ours[a] - paper[a] for a in paper}
    if all(abs(d) <= tol for d in off.values()):
        return REPRODUCED, f"every slope within {tol} of the paper's"
    (lo, p_lo), (hi, p_hi) = sorted(paper.items(), key=lambda kv: kv[1])
    if ours[lo] >= ours[hi]:
        return CONTRADICTED, f"{lo}'s slope {ours[lo]:.2f} is not below {hi}'s {ours[hi]:.2f}"
    worst = max(off, key=lambda a: abs(off[a]))
    return UNDECIDED, f"{worst}'s slope {ours[worst]:.2f} is {abs(off[worst]):.2f} from the paper's {paper[worst]:g}"


def reaches(a: Seeds, reference: Seeds, tol: float, still_falling: bool) -> tuple[str, str]:
    """Claim: `a` reaches `reference`'s value (lower is better): its excess over the reference is
    at most `tol` or inside the spread. Above both, it is contradicted when a's curve has stopped
    falling, and undecided (a still on its way down) otherwise."""
    if min(a.n, reference.n) < MIN_SEEDS:
        return MEASURED, f"{min(a.n, reference.n)} seed(s); judged from {MIN_SEEDS}"
    excess, s = a.mean - reference.mean, spread(a, reference)
    if excess <= max(tol, s):
        return REPRODUCED, f"{excess:.3g} above, within {max(tol, s):.3g}"
    if still_falling:
        return UNDECIDED, f"{excess:.3g} above (spread {s:.3g}) and still falling"
    return CONTRADICTED, f"{excess:.3g} above (spread {s:.3g}), no longer falling"


MATCHES = "matches the authors' script"
LOWER, HIGHER = "lower than the authors' script", "higher than the authors' script"


def matches(ours: Seeds, theirs: Seeds) -> tuple[str, str]:
    """Fidelity, not a claim of the paper: does a run of ours end where the authors' own script
    does at matched settings? A gap inside the spread is a tie (matches); outside it, which side
    ends lower (for a loss or bits/dim, lower is better). Fewer runs: a measurement."""
    if min(ours.n, theirs.n) < MIN_SEEDS:
        return MEASURED, f"{min(ours.n, theirs.n)} run(s); judged from {MIN_SEEDS}"
    gap, s = ours.mean - theirs.mean, spread(ours, theirs)
    if abs(gap) <= s:
        return MATCHES, f"gap {gap:+.3g} within spread {s:.3g}"
    return (LOWER if gap < 0 else HIGHER), f"gap {gap:+.3g} outside spread {s:.3g}"
