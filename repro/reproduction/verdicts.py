"""The verdict rules, in one place. A claim of the paper is judged only over at least MIN_SEEDS
seeds a side of one declared run, from each seed's final value, unsmoothed. Every verdict comes
from Welch's 95 % confidence interval of the gap between the two sides' means (unequal
variances, Welch-Satterthwaite degrees of freedom):

    reproduced               the interval lies wholly on the side the paper claims
    contradicted             it lies wholly on the other side
    undecided at this scale  it reaches across; the verdict then states the smallest gap these
                             runs could have detected (80 % power at the 5 % level)

Where a claim is "a reaches b" (the same loss), the claimed side is "at most `tol` above". A
side that is above beyond the interval is contradicted only when its curves have stopped
falling, judged seed by seed (still_falling: a fitted slope and its standard error over each
seed's own last evaluations). With fewer seeds a result is shown as a measurement, not judged.
The rules are pure functions of numbers, tested one outcome at a time (tests/reproduction/report/test_claims.py)."""
import math
from dataclasses import dataclass

from scipy import stats

REPRODUCED, CONTRADICTED, UNDECIDED = "reproduced", "contradicted", "undecided at this scale"
MEASURED, NOT_TESTABLE = "measured, not judged", "not testable here"
MIN_SEEDS = 5   # a claim of the paper: seeds a side
MIN_RUNS = 3    # a fidelity check against the authors' script: runs a side
LEVEL, POWER = 0.95, 0.80
FALLING_EVALS = 5  # still_falling: each seed's slope over its last this many evaluations
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


@dataclass(frozen=True)
class Gap:
    """Welch's interval of mean(a) - mean(b): the estimate, its standard error and degrees of
    freedom, the LEVEL interval [lo, hi], and the smallest gap the runs could detect."""
    diff: float
    se: float
    df: float
    lo: float
    hi: float
    detectable: float

    def text(self, fmt="{:.3g}", name="gap") -> str:
        f = fmt.format
        return f"{name} {f(self.diff)}, {LEVEL * 100:.0f} % CI [{f(self.lo)}, {f(self.hi)}]"


def welch(a: Seeds, b: Seeds, level: float = LEVEL, power: float = POWER) -> Gap:
    """mean(a) - mean(b) with Welch's interval; both sides need 2 values or more."""
    if min(a.n, b.n) < 2:
        raise ValueError(f"an interval needs at least 2 values a side; got {a.n} and {b.n}")
    va, vb = a.sd ** 2 / a.n, b.sd ** 2 / b.n
    se = math.sqrt(va + vb)
    # Welch-Satterthwaite; with no spread at all the pooled df stands in (the interval is a point)
    df = (va + vb) ** 2 / (va ** 2 / (a.n - 1) + vb ** 2 / (b.n - 1)) if se > 0 else a.n + b.n - 2
    t = stats.t.ppf(0.5 + level / 2, df)
    diff = a.mean - b.mean
    return Gap(diff, se, df, diff - t * se, diff + t * se, (t + stats.t.ppf(power, df)) * se)


def _detect(g: Gap) -> str:
    return f"these runs could detect a gap of {g.detectable:.2g}"


def _too_few(a: Seeds, b: Seeds, least: int, unit: str = "seed") -> tuple[str, str] | None:
    """A measurement, not a verdict, below `least` values a side: its interval still shown."""
    n = min(a.n, b.n)
    if n >= least:
        return None
    shown = f"; {welch(a, b).text()}" if n >= 2 else ""
    return MEASURED, f"{n} {unit}(s) a side; judged from {least}{shown}"


def below(low: Seeds, high: Seeds) -> tuple[str, str]:
    """Claim: `low` ends below `high` (lower is better). Returns (verdict, why)."""
    if few := _too_few(high, low, MIN_SEEDS):
        return few
    g = welch(high, low)
    if g.lo > 0:
        return REPRODUCED, g.text()
    if g.hi < 0:
        return CONTRADICTED, f"the other way round: {g.text()}"
    return UNDECIDED, f"{g.text()} includes 0; {_detect(g)}"


def reaches(a: Seeds, reference: Seeds, tol: float, falling: "Falling") -> tuple[str, str]:
    """Claim: `a` reaches `reference`'s value (lower is better), i.e. ends at most `tol` above
    it. Reproduced when the interval of the excess lies below tol; contradicted when it lies
    above tol and a's seeds have stopped falling; undecided otherwise."""
    if few := _too_few(a, reference, MIN_SEEDS):
        return few
    g = welch(a, reference)
    excess = g.text(name="excess")
    if g.hi <= tol:
        return REPRODUCED, f"{excess}, below the tolerance {tol:g}"
    if g.lo > tol:
        if falling.still:
            return UNDECIDED, f"{excess}, above the tolerance {tol:g}, but {falling.text}"
        return CONTRADICTED, f"{excess}, above the tolerance {tol:g}, and {falling.text}"
    return UNDECIDED, f"{excess} reaches across the tolerance {tol:g}; {_detect(g)}"


@dataclass(frozen=True)
class Falling:
    """Whether a side's curves still fall at the end: `still` when more than half of its seeds
    do, each judged from its own fitted slope; `text` says how many and at what rate."""
    still: bool
    text: str


def seed_slope(steps, values) -> tuple[float, float]:
    """Least-squares slope of values against steps, and its standard error."""
    if len(steps) < 3:
        raise ValueError(f"a slope with an error needs at least 3 evaluations; got {len(steps)}")
    fit = stats.linregress([float(s) for s in steps], [float(v) for v in values])
    return float(fit.slope), float(fit.stderr)


def still_falling(curves: list, last: int = FALLING_EVALS, level: float = LEVEL, per: int = 1000) -> Falling:
    """curves: one (steps, values) per seed, in step order. A seed still falls when its slope over
    its last `last` evaluations is below 0 beyond its one-sided `level` bound."""
    slopes, falls = [], 0
    for steps, values in curves:
        steps, values = list(steps)[-last:], list(values)[-last:]
        slope, se = seed_slope(steps, values)
        falls += slope + stats.t.ppf(level, len(steps) - 2) * se < 0
        slopes.append(slope * per)
    shown = ", ".join(f"{s:+.2g}" for s in slopes)
    text = (f"{falls} of {len(curves)} seeds still falling over their last {last} evaluations "
            f"(slopes per {per:,} steps: {shown})")
    return Falling(2 * falls > len(curves), text)


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


MATCHES = "matches the authors' script"
LOWER, HIGHER = "lower than the authors' script", "higher than the authors' script"


def matches(ours: Seeds, theirs: Seeds) -> tuple[str, str]:
    """Fidelity, not a claim of the paper: does a run of ours end where the authors' own script
    does at matched settings? An interval of the gap that includes 0 matches (with the smallest
    gap the runs could have told apart); otherwise which side ends lower (for a loss or
    bits/dim, lower is better). Fewer than MIN_RUNS runs a side: a measurement."""
    if few := _too_few(ours, theirs, MIN_RUNS, "run"):
        return few
    g = welch(ours, theirs)
    if g.lo <= 0 <= g.hi:
        return MATCHES, f"{g.text('{:+.3g}')} includes 0; {_detect(g)}"
    return (LOWER if g.hi < 0 else HIGHER), g.text("{:+.3g}")
