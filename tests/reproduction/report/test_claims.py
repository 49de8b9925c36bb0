"""repro.reproduction.report.claims: the verdict rules, and the section rendered from results folders written here in
the formats the tasks publish (copy_final/copy_curves, bpd_curves + image_rows, asr_table +
asr_rows, throughput.csv) and named by the manifest (claims.yaml), with the expected numbers worked
out by hand."""
import json
import shutil

import numpy as np
import pandas as pd
import pytest
from report_manifest import write_manifest
from scipy import stats as scipy_stats

from repro.reproduction import verdicts
from repro.reproduction.report import claims
from repro.reproduction.report.claims import NOT_REPRODUCED, NOT_TESTABLE
from repro.reproduction.verdicts import CONTRADICTED, MEASURED, REPRODUCED, UNDECIDED, Seeds, below, reaches, slopes

# ----------------------------------------------------------------------------- the rules

def test_seeds_mean_and_spread_by_hand():
    s = Seeds((1.0, 2.0, 3.0))
    assert (s.n, s.mean, s.sd) == (3, 2.0, 1.0)
    assert s.text("{:.2f}") == "2.00 ± 1.00 (3 seeds)"
    with pytest.raises(ValueError, match="never computed from a non-finite value"):
        Seeds((1.0, float("nan"), 2.0))


@pytest.mark.parametrize("n_a, n_b", [(5, 5), (3, 7), (6, 4)])
def test_welch_interval_matches_scipy_and_a_hand_formula(n_a, n_b):
    """The interval against scipy's Welch test (ttest_ind(equal_var=False)) and against the
    formula in float64 by hand, on random values of unequal spread."""
    rng = np.random.default_rng(n_a * 10 + n_b)
    a, b = rng.normal(1.0, 0.3, n_a), rng.normal(0.7, 0.05, n_b)
    g = verdicts.welch(Seeds(tuple(a)), Seeds(tuple(b)))
    ref = scipy_stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert g.lo == pytest.approx(ref.low, rel=1e-9) and g.hi == pytest.approx(ref.high, rel=1e-9)
    va, vb = a.var(ddof=1) / n_a, b.var(ddof=1) / n_b
    df = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1))
    assert g.df == pytest.approx(df) and g.se == pytest.approx(np.sqrt(va + vb))
    assert g.diff == pytest.approx(a.mean() - b.mean())
    with pytest.raises(ValueError, match="at least 2 values a side"):
        verdicts.welch(Seeds((1.0,)), Seeds((1.0, 2.0)))


def test_the_detectable_gap_is_detected_four_times_in_five():
    """At a true gap equal to the stated detectable gap, Welch's test at the 5 % level rejects
    about 80 % of the time (simulated; the formula is the usual t approximation)."""
    rng = np.random.default_rng(0)
    sd, n = 0.1, 5
    g = verdicts.welch(Seeds(tuple(rng.normal(0, sd, n))), Seeds(tuple(rng.normal(0, sd, n))))
    gap = (scipy_stats.t.ppf(0.975, 2 * n - 2) + scipy_stats.t.ppf(0.8, 2 * n - 2)) * sd * np.sqrt(2 / n)
    a, b = rng.normal(gap, sd, (4000, n)), rng.normal(0.0, sd, (4000, n))
    power = (scipy_stats.ttest_ind(a, b, axis=1, equal_var=False).pvalue < 0.05).mean()
    assert 0.70 < power < 0.85, power
    assert g.detectable > 0


def _five(center, spread):
    return Seeds(tuple(center + spread * d for d in (-1.0, -0.5, 0.0, 0.5, 1.0)))


@pytest.mark.parametrize("low, high, verdict", [
    (_five(1.0, 0.1), _five(2.0, 0.1), REPRODUCED),        # the interval of 1.0 lies above 0
    (_five(2.0, 0.1), _five(1.0, 0.1), CONTRADICTED),      # the other way round
    (_five(1.0, 0.3), _five(1.1, 0.3), UNDECIDED),         # gap 0.1, interval across 0
    (Seeds((1.0, 1.1, 0.9, 1.0)), _five(2.0, 0.1), MEASURED),  # four seeds: shown, not judged
])
def test_below_has_three_outcomes_and_needs_five_seeds(low, high, verdict):
    got, why = below(low, high)
    assert got == verdict, why
    if verdict == UNDECIDED:
        assert "includes 0" in why and "these runs could detect a gap of" in why
    if verdict == MEASURED:
        assert "judged from 5" in why


def test_a_gap_larger_than_one_seed_spread_can_still_be_undecided():
    """What the old rule called reproduced (gap above sqrt(sd_a^2 + sd_b^2)) needs an interval now:
    gap 0.051 with spreads 0.054 / 0.028, three seeds a side: undecided, and too few seeds."""
    a, b = Seeds((1.645 - 0.028, 1.645, 1.645 + 0.028)), Seeds((1.696 - 0.054, 1.696, 1.696 + 0.054))
    assert below(a, b)[0] == MEASURED
    a5 = Seeds(tuple(1.645 + 0.028 * d for d in (-1.2, -0.6, 0, 0.6, 1.2)))
    b5 = Seeds(tuple(1.696 + 0.054 * d for d in (-1.2, -0.6, 0, 0.6, 1.2)))
    assert below(a5, b5)[0] == UNDECIDED


def _curves(slopes_per_step, noise=0.0, steps=(500, 1000, 1500, 2000, 2500, 3000, 3500, 4000)):
    rng = np.random.default_rng(1)
    return [(list(steps), [1.0 + s * x + noise * rng.normal() for x in steps]) for s in slopes_per_step]


def test_seed_slope_against_numpy():
    rng = np.random.default_rng(2)
    x, y = np.arange(7) * 250.0, rng.normal(size=7)
    slope, se = verdicts.seed_slope(x, y)
    fit, cov = np.polyfit(x, y, 1, cov=True)
    assert slope == pytest.approx(fit[0]) and se == pytest.approx(np.sqrt(cov[0, 0]))
    with pytest.raises(ValueError, match="at least 3 evaluations"):
        verdicts.seed_slope([1, 2], [1, 2])


def test_still_falling_is_judged_seed_by_seed():
    """Every seed falling steadily counts, even when the seed means hardly move against the
    spread between seeds (the old rule); flat seeds and one falling seed of three do not."""
    assert verdicts.still_falling(_curves([-1e-5] * 3, noise=1e-4)).still
    flat = verdicts.still_falling(_curves([0.0] * 3, noise=1e-3))
    assert not flat.still and "0 of 3 seeds still falling over their last 5 evaluations" in flat.text
    assert not verdicts.still_falling(_curves([-1e-5, 0.0, 0.0])).still


@pytest.mark.parametrize("a, falling, verdict", [
    (_five(0.005, 0.001), False, REPRODUCED),             # the excess's interval below tol 0.01
    (_five(0.3, 0.01), True, UNDECIDED),                  # far above, still on its way down
    (_five(0.3, 0.01), False, CONTRADICTED),              # far above and flat
    (_five(0.011, 0.01), False, UNDECIDED),               # the interval reaches across tol
])
def test_reaches_has_three_outcomes(a, falling, verdict):
    f = verdicts.Falling(falling, "3 of 5 seeds still falling" if falling else "0 of 5 seeds still falling")
    got, why = reaches(a, _five(0.0015, 0.0005), tol=0.01, falling=f)
    assert got == verdict, why
    if verdict == UNDECIDED and not falling:
        assert "these runs could detect a gap of" in why


def test_slopes_have_three_outcomes():
    paper = {"linear": 1.0, "softmax": 2.0}
    assert slopes({"linear": 1.1, "softmax": 1.9}, paper)[0] == REPRODUCED
    assert slopes({"linear": 1.1, "softmax": 1.5}, paper)[0] == UNDECIDED  # ordered, softmax 0.5 short
    assert slopes({"linear": 1.6, "softmax": 1.5}, paper)[0] == CONTRADICTED


def test_speedup_and_growth_verdicts():
    assert claims.speedup_verdict(3.3, 3.3) == REPRODUCED
    assert claims.speedup_verdict(2.3, 3.3, factor=1.5) == REPRODUCED  # 3.3 / 1.5 = 2.2
    assert claims.speedup_verdict(1.5, 3.3, factor=1.5).startswith(f"{NOT_REPRODUCED}: faster, but 1.50x")
    assert claims.speedup_verdict(0.9, 3.3) == f"{NOT_REPRODUCED}: not faster"
    assert claims.growth_verdict({1: 1.0, 64: 2.0}) == REPRODUCED
    assert claims.growth_verdict({1: 1.0, 10: 3.0, 64: 1.1}, margin=1.25) == f"{NOT_REPRODUCED}: grows only 1.10x"
    assert claims.growth_verdict({1: 2.0, 64: 1.5}) == f"{NOT_REPRODUCED}: the lead does not grow"


# ----------------------------------------------------------------------------- the section

SEED_FACTORS = (0.9, 0.95, 1.0, 1.05, 1.1)  # copy: each seed's loss, times the attention's
SEED_OFFSETS = (-0.02, -0.01, 0.0, 0.01, 0.02)  # MNIST: each seed's bits/dim, plus the attention's
COPY_EVALS = (500, 1000, 1500, 2000, 2500, 3000, 3500, 4000)


def _write(results, lsh_copy_loss=0.6, linear_copy_loss=0.002, linear_falling=0.0):
    """Runs as the tasks publish them: each seed's eval rows and final row (copy_rows.jsonl,
    image_rows.jsonl), five seeds a side. Copy: losses per attention, seeds spread by +-10 %;
    linear's curve falls by `linear_falling` per 1,000 steps to its final value. MNIST: bits/dim
    falls 0.1 per 100 steps from a per-attention start, seeds offset by -0.02 .. +0.02."""
    fig1 = results / "figure1-cpu"
    fig1.mkdir(parents=True)
    (fig1 / "summary.json").write_text(json.dumps({"attentions": {
        "linear": {"largest_n": 65536, "time_slope_all": 1.1},
        "softmax-math": {"largest_n": 2048, "time_slope_all": 1.9, "first_failure": "timeout at N=4096"}},
        "crossovers": {"linear vs softmax-math": {"linear_faster_from_n": 512}}}))
    copy = results / "copy/figure2_n128_cpu"
    copy.mkdir(parents=True)
    final = {"softmax": 0.0001, "linear": linear_copy_loss, "lsh-4": lsh_copy_loss}
    common = {"max_len": 128, "min_copy": 32, "max_copy": 62, "n_layers": 2, "d_model": 64, "n_heads": 4, "d_ff": 128,
              "max_steps": 4000}
    rows = []
    for a, v in final.items():
        for seed, f in enumerate(SEED_FACTORS):
            for step in COPY_EVALS:
                extra = linear_falling * (4000 - step) / 1000 if a == "linear" else 0.0
                rows.append({**common, "kind": "eval", "attention": a, "seed": seed, "step": step,
                             "loss": v * f + extra})
            rows.append({**common, "kind": "final", "attention": a, "seed": seed, "steps": 4000,
                         "eval_loss": v * f, "eval_accuracy": 0.99, "status": "ok"})
    (copy / "copy_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    img = results / "images/mnist_claims_seeds_cpu"
    img.mkdir(parents=True)
    start = {"softmax": 2.0, "linear": 2.1, "lsh-4": 2.2, "lsh-1": 2.3}
    ms = {"softmax": 100.0, "linear": 50.0, "lsh-4": 200.0, "lsh-1": 100.0}
    rows = [{"kind": "eval", "attention": a, "seed": seed, "step": s, "bits_per_dim": b - s / 1000 + d, "n_eval": 500}
            for a, b in start.items() for seed, d in enumerate(SEED_OFFSETS) for s in (100, 200, 300, 400)]
    rows += [{"kind": "final", "attention": a, "seed": seed, "cpu_time_per_step_ms": v, "steps": 400, "status": "ok"}
             for a, v in ms.items() for seed in range(len(SEED_OFFSETS))]
    (img / "image_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    asr = results / "asr/speed_800_cpu"
    asr.mkdir(parents=True)
    pd.DataFrame([{"model": m, "seeds": 5, "steps": 8.0, "epochs": 2.0, "s_per_epoch": s * 1.5, "cpu_s_per_epoch": s,
                   "ms_per_step": s * 375, "mean_frames": 801.0, "status": "ok"}
                  for m, s in [("softmax", 10.0), ("softmax-math", 12.0), ("linear", 4.0)]]
                 ).to_csv(asr / "asr_table.csv", index=False)
    (asr / "asr_rows.jsonl").write_text(json.dumps(
        {"kind": "train", "batch_size": 8, "model_n_layers": 9, "model_n_heads": 6, "model_d_model": 192}) + "\n")

    gen = results / "throughput/batch64_cpu"
    gen.mkdir(parents=True)
    secs = {("linear", 1): 4.0, ("stateful-softmax", 1): 5.0, ("linear", 64): 0.1, ("stateful-softmax", 64): 0.5}
    pd.DataFrame([{"method": m, "batch": b, "status": "ok", "seconds_per_image": v * 2, "cpu_seconds_per_image": v,
                   "extrapolated": b == 64} for (m, b), v in secs.items()]).to_csv(gen / "throughput.csv", index=False)
    write_manifest(results, claims=CLAIMS)


# the folders the manifest of _write's tree names for each claim
CLAIMS = {"figure1": "figure1-cpu", "copy": "copy/figure2_n128_cpu", "mnist": "images/mnist_claims_seeds_cpu",
          "asr": "asr/speed_800_cpu", "batch": "throughput/batch64_cpu"}
GEN, GPU_MNIST = "gpu/NVIDIA_H100_80GB_HBM3/generation", "gpu/NVIDIA_H100_80GB_HBM3/mnist"


def test_section_from_results(tmp_path):
    _write(tmp_path)
    rows = claims.claims(tmp_path)
    fig1, copy_linear, copy_lsh, sweep, mnist_steps, mnist_time, asr, gen, *untestable = rows
    assert sweep.verdict == f"{NOT_TESTABLE}: not run"  # no sweep folder named
    assert fig1.verdict.startswith(REPRODUCED) and "linear 1.10, softmax-math" in fig1.here
    assert "linear faster from N = 512 (softmax-math)" in fig1.here
    assert "softmax-math 2,048 (timeout at N=4096)" in fig1.here
    # linear 0.002 +- 10 % against softmax 0.0001: within the 0.01 tolerance
    assert copy_linear.verdict.startswith(REPRODUCED) and "N = 128, copies of 32-62 symbols" in copy_linear.here
    # sd of the factors 0.9 .. 1.1 in steps of 0.05: 0.0791, times 0.002
    assert "linear 0.0020 ± 0.00016 (5 seeds), 99.0 % of symbols right" in copy_linear.here
    assert "0 of 5 seeds still falling" in copy_linear.here and "below the tolerance 0.01" in copy_linear.verdict
    assert copy_lsh.verdict.startswith(REPRODUCED) and "lsh-4 0.60 ± 0.047 (5 seeds)" in copy_lsh.here
    assert "95 % CI [" in copy_lsh.verdict
    # equal steps: each seed's last evaluation (step 400), unsmoothed: start - 0.4 + d, so 1.6,
    # 1.7, 1.8, 1.9 +- 0.016: every neighbour gap 0.1, its interval well above 0
    assert mnist_steps.verdict.startswith(REPRODUCED), mnist_steps.verdict
    assert "last evaluation on 500 held-out digits" in mnist_steps.here
    assert "softmax 1.600 ± 0.016 (5 seeds), linear 1.700 ± 0.016 (5 seeds)" in mnist_steps.here
    # equal time: the budget is linear's 400 x 50 ms = 20 s; softmax does 200 steps in it, where
    # its curve is 2.0 - 0.2 = 1.8; linear at 400: 1.7. Linear below softmax by 0.1
    assert "20 s of CPU time" in mnist_time.here and mnist_time.verdict.startswith(REPRODUCED)
    assert "linear 1.700 ± 0.016 (5 seeds) (400 steps), softmax 1.800 ± 0.016 (5 seeds) (200 steps)" in mnist_time.here
    # speech: CPU time per epoch, against softmax-math (the paper's baseline): 12 / 4 = 3.0x >= 3.3 / 1.5
    assert asr.verdict.startswith(f"{REPRODUCED}: 3.00x against softmax-math (the paper's softmax")
    table = tmp_path / "asr/speed_800_cpu/asr_table.csv"  # two seeds: a measurement, its ratios still given
    pd.read_csv(table).assign(seeds=2).to_csv(table, index=False)
    two = claims.asr_claim(tmp_path, CLAIMS["asr"]).verdict
    assert two.startswith("measured, not judged (2 seed(s); judged from 5): 3.00x against softmax-math"), two
    assert "2.50x against softmax (SDPA softmax, what a user runs today)" in asr.verdict
    assert "2.50x faster than softmax " in asr.here
    assert "linear 3.00x faster than softmax-math" in asr.here and "9 layers x 6 heads x 32" in asr.here
    assert "CPU s/update: softmax 2.50, softmax-math 3.00, linear 1.00" in asr.here
    # generation: 5 / 4 = 1.25x at batch 1, 0.5 / 0.1 = 5x at batch 64 (extrapolated: starred)
    # an observation, shown in CPU and wall time, not judged
    assert gen.verdict == f"{MEASURED} (an observation of one run): {REPRODUCED} in CPU time; {REPRODUCED} in wall time"
    assert "1.25x" in gen.here and "0.1* / 0.5* = 5.00x" in gen.here
    assert "wall time: batch 1: 8 / 10 = 1.25x" in gen.here
    assert all(c.verdict.startswith(NOT_TESTABLE) for c in untestable)

    text = claims.section(tmp_path)
    lines = text.strip().splitlines()
    assert lines[0] == "| Claim | Paper | Here (CPU-sized runs; the GPU rows: one H100 run each) | Verdict |"
    assert len(lines) == 2 + len(rows) and all(line.count(" | ") == 3 for line in lines[2:])
    assert f"| **{REPRODUCED}: " in lines[2] and lines[2].startswith("| Figure 1:")


def test_section_verdicts_turn(tmp_path):
    """Linear far above softmax: undecided while its curve still falls, contradicted once flat;
    LSH-4 below linear: the claim that it ends above both is contradicted."""
    _write(tmp_path, lsh_copy_loss=0.005, linear_copy_loss=0.3, linear_falling=0.1)
    _, copy_linear, copy_lsh, *_ = claims.claims(tmp_path)
    assert copy_linear.verdict.startswith(f"{UNDECIDED}: ") and "5 of 5 seeds still falling" in copy_linear.verdict
    assert copy_lsh.verdict.startswith(CONTRADICTED)
    shutil.rmtree(tmp_path / "copy")
    _write(tmp_path / "flat", lsh_copy_loss=0.005, linear_copy_loss=0.3)
    assert claims.claims(tmp_path / "flat")[1].verdict.startswith(f"{CONTRADICTED}: ")


def test_section_without_runs(tmp_path):
    """A manifest that names no run: every claim says so; one that names a folder without the
    claim's file: that claim says which folder it looked in."""
    write_manifest(tmp_path)
    rows = claims.claims(tmp_path)
    assert [r.verdict for r in rows[:11]] == [f"{NOT_TESTABLE}: not run"] * 11
    assert "no run named for it in `results/claims.yaml`" in rows[1].here
    assert claims.section(tmp_path).count(NOT_TESTABLE) == len(rows)
    (tmp_path / "copy" / "empty").mkdir(parents=True)
    write_manifest(tmp_path, claims={"copy": "copy/empty"})
    assert "no run in `copy/empty`" in claims.claims(tmp_path)[1].here


def test_each_claim_is_judged_from_the_folder_the_manifest_names(tmp_path):
    """Two copy runs: the claim reads the one named (it used to read copy/figure2_n128_cpu whatever
    the manifest said), and says which."""
    _write(tmp_path)
    _write(tmp_path / "elsewhere", lsh_copy_loss=0.3)
    shutil.copytree(tmp_path / "elsewhere" / CLAIMS["copy"], tmp_path / "copy" / "other")
    assert "lsh-4 0.60 ±" in claims.claims(tmp_path)[2].here
    write_manifest(tmp_path, claims={**CLAIMS, "copy": "copy/other"})
    _, copy_linear, copy_lsh, *_ = claims.claims(tmp_path)
    assert "(`copy/other`)" in copy_linear.here and "lsh-4 0.30 ±" in copy_lsh.here
    assert "figure2_n128_cpu" not in claims.section(tmp_path)


def _cell(folder, losses, **setup):
    """A sweep cell's final rows: {attention: [loss per seed]} at these settings (task=copy's fields)."""
    base = {"kind": "final", "max_len": 128, "min_copy": 32, "max_copy": 62, "n_layers": 2, "d_model": 64,
            "n_heads": 4, "d_ff": 128, "max_steps": 4000, "steps": 4000, "eval_accuracy": 0.9, "status": "ok"}
    rows = [{**base, **setup, "attention": a, "seed": seed, "eval_loss": v}
            for a, values in losses.items() for seed, v in enumerate(values)]
    folder.mkdir(parents=True)
    (folder / "copy_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_sweep_row_says_which_change_brings_linear_to_softmax(tmp_path):
    """Cells that each change one thing of the judged run: per-head state, width, budget. Each is
    set beside softmax at its width (its own, else the judged run's), with Welch's interval; the
    verdict names the cells that reach softmax and what each change did to linear's loss."""
    _write(tmp_path, linear_copy_loss=0.3)
    sweep = tmp_path / "copy/sweep"
    _cell(sweep / "heads", {"linear": [0.5, 0.6, 0.55]}, n_heads=2)
    _cell(sweep / "wide", {"linear": [0.005, 0.006, 0.004], "softmax": [0.003, 0.004, 0.0035]}, d_model=256,
          n_heads=8, d_ff=1024)
    _cell(sweep / "long", {"linear": [0.06, 0.07, 0.05]}, max_steps=10000, steps=10000)
    _cell(sweep / "one", {"linear": [0.02, 0.03], "softmax": [0.003]}, d_model=128, d_ff=256)
    _cell(sweep / "failed", {"linear": [0.5]}, status="error: non-finite loss")  # shown as such, not a crash
    (sweep / "README.md").write_text("# cells\n\n    python run.py -m experiment=copy_claims_n128_cpu\n")
    write_manifest(tmp_path, claims={**CLAIMS, "copy_sweep": "copy/sweep"})
    row = claims.claims(tmp_path)[3]
    assert row.claim == claims.SWEEP_CLAIM
    assert "d_model 64, 2 x 32, 2 layers, 4,000 updates: linear 0.55 ± 0.050 (3 seeds)" in row.here
    g = verdicts.welch(Seeds((0.5, 0.6, 0.55)), Seeds(tuple(0.0001 * f for f in SEED_FACTORS)))
    assert f"0.55 above softmax's 0.00010 (95 % CI [{g.lo:#.2g}, {g.hi:#.2g}])" in row.here
    assert "d_model 256, 8 x 32" in row.here and "above softmax's 0.0035" in row.here  # its own softmax
    assert "linear 0.025 ± 0.0071 (2 seeds), softmax 0.0030 ± 0.0 (1 seeds) (`one`)" in row.here  # no interval
    assert "no finished run in `copy/sweep/failed`" in row.here
    assert row.verdict.startswith(f"{MEASURED}: linear reaches softmax's loss (within 0.01) at d_model 256, 8 x 32")
    assert "width: d_model 128 (4 x 32) 0.025, d_model 256 (8 x 32) 0.0050" in row.verdict
    assert "per-head state: 2 x 32 0.55" in row.verdict
    assert "budget: 10,000 updates 0.060" in row.verdict and "linear's loss from 0.30 at d_model 64" in row.verdict
    shutil.rmtree(sweep / "wide")
    assert claims.claims(tmp_path)[3].verdict.startswith(f"{MEASURED}: no cell brings linear to softmax's loss")


def _fidelity_rows(folder, runs, **setup):
    """fidelity_runs.csv of a copy comparison: {(side, variant, attention): [loss per run]}."""
    base = {"task": "copy", "metric_name": "held-out loss", "copy_n": 128, "n_layers": 2, "n_heads": 4,
            "d_query": 16, "steps": 4000, "status": "ok", "not_matched": "d_ff: theirs 256, ours 128"}
    rows = [{**base, **setup, "side": side, "variant": variant, "attention": a, "seed": seed, "metric": v}
            for (side, variant, a), values in runs.items() for seed, v in enumerate(values)]
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(folder / "fidelity_runs.csv", index=False)


def test_the_sweep_row_sets_the_authors_script_beside_ours(tmp_path):
    """The authors' copy script at the judged run's settings: their linear against their softmax
    with Welch's interval (scipy's), ours on their architecture beside it (the embedding-dropout-0
    variant only), the setting that differs named; the verdict says whether their script shows
    the same gap. A failed run is left out."""
    _write(tmp_path, linear_copy_loss=0.3)
    _cell(tmp_path / "copy/sweep/wide", {"linear": [0.02, 0.03, 0.025]}, d_model=256, n_heads=8, d_ff=1024)
    theirs_lin, theirs_soft = [0.30, 0.28, 0.33], [0.004, 0.005, 0.003]
    _fidelity_rows(tmp_path / "fidelity/copy_n128", {
        ("authors", "script", "linear"): theirs_lin, ("authors", "script", "softmax"): theirs_soft,
        ("ours", "embedding dropout 0", "linear"): [0.11, 0.2, 0.15],
        ("ours", "embedding dropout 0", "softmax"): [0.003, 0.002, 0.004],
        ("ours", "embedding dropout 0.1", "linear"): [0.9, 0.9, 0.9]})
    with open(tmp_path / "fidelity/copy_n128/fidelity_runs.csv", "a") as f:  # a failed run: not a result
        f.write("copy,held-out loss,128,2,4,16,4000,timeout,none,authors,script,linear,3,\n")
    (tmp_path / "fidelity/copy_n128/command.txt").write_text("python -m repro.reproduction.fidelity --task copy\n")
    write_manifest(tmp_path, claims={**CLAIMS, "copy_sweep": "copy/sweep", "copy_authors": "fidelity/copy_n128"})
    row = claims.claims(tmp_path)[3]
    ci = scipy_stats.ttest_ind(theirs_lin, theirs_soft, equal_var=False).confidence_interval(0.95)
    assert ("the authors' copy script beside ours at N = 128, 2 layers, 4 x 16, 4,000 updates: their script: "
            "linear 0.30 ± 0.025 (3 runs), softmax 0.0040 ± 0.0010 (3 runs), linear 0.30 above "
            f"(95 % CI [{ci.low:#.2g}, {ci.high:#.2g}])") in row.here
    assert "ours on their architecture (embedding dropout 0): linear 0.15 ± 0.045 (3 runs)" in row.here
    assert "not matched: d_ff: theirs 256, ours 128" in row.here and "(`fidelity/copy_n128`)" in row.here
    assert row.verdict.endswith("the authors' script shows the same gap: its linear stays above its softmax "
                                "beyond the tolerance at N = 128, 2 layers, 4 x 16, 4,000 updates")
    _fidelity_rows(tmp_path / "fidelity/copy_n128", {("authors", "script", "linear"): [0.004, 0.006, 0.005],
                                                     ("authors", "script", "softmax"): theirs_soft})
    assert "the authors' script brings linear to softmax's loss" in claims.claims(tmp_path)[3].verdict


def test_figure1_slopes_carry_the_fits_interval(tmp_path):
    """The Figure 1 row shows each slope with Student's 95 % interval of its log-log fit over the
    points measured (scipy's linregress), failed points left out."""
    _write(tmp_path)
    rng = np.random.default_rng(1)
    ns = [512, 1024, 2048, 4096, 8192]
    times = {"linear": [0.01 * n * rng.uniform(0.9, 1.1) for n in ns],
             "softmax-math": [1e-5 * n * n * rng.uniform(0.8, 1.2) for n in ns]}
    rows = [{"attention": a, "n": n, "time_per_sample_ms": v, "status": "ok"} for a, vs in times.items()
            for n, v in zip(ns, vs)] + [{"attention": "softmax-math", "n": 16384, "time_per_sample_ms": None,
                                         "status": "oom"}]
    pd.DataFrame(rows).to_csv(tmp_path / "figure1-cpu" / "benchmark.csv", index=False)
    here = claims.figure1_claim(tmp_path, "figure1-cpu").here
    for a, vs in times.items():
        fit = scipy_stats.linregress(np.log(ns), np.log(vs))
        half = scipy_stats.t.ppf(0.975, len(ns) - 2) * fit.stderr
        assert f" [{fit.slope - half:.2f}, {fit.slope + half:.2f}]" in here, (a, here)


@pytest.mark.parametrize("spread, expect", [(0.05, REPRODUCED), (0.6, UNDECIDED)])
def test_the_speech_speed_up_is_judged_from_the_seeds_interval(tmp_path, spread, expect):
    """Five seeds, each running softmax-math and linear in turn: the ratio of their CPU times per
    update, seed by seed, has Student's 95 % interval (scipy's); the speed-up is reproduced only
    when all of it clears the rule (the paper's 3.3x / 1.5), undecided when it straddles it."""
    _write(tmp_path)
    ratios = [3.0 + spread * d for d in (-2, -1, 0, 1, 2)]
    size = {"batch_size": 8, "model_n_layers": 9, "model_n_heads": 6, "model_d_model": 192}
    rows = [{"kind": "train", **size}]
    rows += [{"kind": "final", **size, "attention": a, "seed": s, "cpu_time_per_step_ms": v}
             for s, r in enumerate(ratios) for a, v in (("linear", 1000.0 + s), ("softmax-math", r * (1000.0 + s)))]
    (tmp_path / "asr/speed_800_cpu/asr_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    verdict = claims.asr_claim(tmp_path, CLAIMS["asr"]).verdict
    ci = scipy_stats.t.interval(0.95, 4, loc=np.mean(ratios), scale=scipy_stats.sem(ratios))
    assert verdict.startswith(f"{expect} (per-seed ratio, 95 % CI [{ci[0]:.2f}, {ci[1]:.2f}] over 5 seeds; "
                              "the rule: 2.19x)"), verdict
    assert (ci[0] >= 3.28 / 1.5) == (expect == REPRODUCED)


def test_mnist_ties_inside_the_seeds_spread_are_undecided(tmp_path):
    """Seeds 0.05 apart and levels 0.02 apart: every interval includes 0, so the order is
    undecided at this scale, with the smallest gap the runs could have detected."""
    _write(tmp_path)
    img = tmp_path / "images/mnist_claims_seeds_cpu"
    level = {"softmax": 1.6, "linear": 1.62, "lsh-4": 1.64, "lsh-1": 1.66}
    rows = [{"kind": "eval", "attention": a, "seed": seed, "step": s, "bits_per_dim": v + d - s * 1e-5 * i}
            for i, (a, v) in enumerate(level.items()) for seed, d in enumerate((-0.05, -0.025, 0.0, 0.025, 0.05))
            for s in (100, 200, 300, 400)]
    rows += [{"kind": "final", "attention": a, "seed": seed, "cpu_time_per_step_ms": 100.0, "steps": 400,
              "status": "ok"} for a in level for seed in range(5)]
    (img / "image_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mnist_steps = claims.claims(tmp_path)[4]
    assert mnist_steps.verdict.startswith(f"{UNDECIDED}: ") and "includes 0" in mnist_steps.verdict
    assert "these runs could detect a gap of" in mnist_steps.verdict


# ----------------------------------------------------------------------------- the presets

def test_claims_presets(compose_cfg):
    """The runs' presets build what their results READMEs say: the copy sweeps over exactly
    softmax, linear and LSH-4 (at N = 32 16 buckets and chunks of 8, x 3 seeds; at N = 128 the
    paper's 64 and 32, x 5 seeds), the paper's speech encoder at ~800 frames, and generation with
    the two recurrent methods only."""
    from hydra import compose, initialize_config_dir

    from repro.conf import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        sweep = compose(config_name="config", overrides=["experiment=copy_claims_cpu"], return_hydra_config=True)
        n128 = compose(config_name="config", overrides=["experiment=copy_claims_n128_cpu"], return_hydra_config=True)
    # its own sweep only (inheriting copy_figure2_cpu's `attention` sweep multiplied the jobs by 2)
    assert dict(sweep.hydra.sweeper.params) == {"copy_attention": "softmax,linear,lsh-4-n32", "seed": "0,1,2"}
    assert dict(n128.hydra.sweeper.params) == {"copy_attention": "softmax,linear,lsh-4", "seed": "0,1,2,3,4"}
    lsh = compose_cfg("experiment=copy_claims_cpu", "copy_attention=lsh-4-n32")
    assert (lsh.attention.n_hashes, lsh.attention.n_buckets, lsh.attention.chunk_size) == (4, 16, 8)
    assert (lsh.task.max_len, lsh.trainer.max_steps, list(lsh.trainer.scheduler.milestones)) == (32, 4000, [2800])
    lsh = compose_cfg("experiment=copy_claims_n128_cpu", "copy_attention=lsh-4")
    assert (lsh.attention.n_hashes, lsh.attention.n_buckets, lsh.attention.chunk_size) == (4, 64, 32)
    assert (lsh.task.max_len, lsh.trainer.max_steps, list(lsh.trainer.scheduler.milestones)) == (128, 4000, [2800])
    linear = compose_cfg("experiment=copy_claims_cpu", "copy_attention=linear")
    assert linear.attention._target_.endswith("LinearAttention")

    asr = compose_cfg("experiment=asr_speed_claims_cpu", "attention=softmax-math")
    enc = asr.model.transformer
    assert (asr.model.encoder, enc.n_layers, enc.n_heads, enc.d_model, enc.subsample) == ("transformer", 9, 6, 192, 1)
    assert asr.attention.sdpa_backend == "math"

    gen = compose_cfg("experiment=throughput_claims_cpu", "~task.methods", "+task.methods={linear: {attention: linear, "
                      "mode: recurrent}, stateful-softmax: {attention: softmax, mode: recurrent}}")
    assert set(gen.task.methods) == {"linear", "stateful-softmax"} and list(gen.task.batches) == [1, 10, 64]
    assert list(gen.task.sizes) == ["mnist"] and gen.task.threads == 1


def test_a_diverged_seed_is_never_judged(tmp_path):
    """A NaN final loss (a diverged seed): the copy claims say so instead of a verdict or a crash."""
    _write(tmp_path)
    path = tmp_path / "copy/figure2_n128_cpu/copy_rows.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    next(r for r in rows if r["kind"] == "final" and r["attention"] == "linear")["eval_loss"] = float("nan")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, copy_linear, copy_lsh, *_ = claims.claims(tmp_path)
    assert copy_linear.verdict.startswith(NOT_TESTABLE) and "non-finite" in copy_linear.verdict
    assert copy_lsh.verdict.startswith(NOT_TESTABLE)


# ----------------------------------------------------------------------------- damaged or failed runs

def _copy_rows(results):
    path = results / "copy/figure2_n128_cpu/copy_rows.jsonl"
    return path, [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("damage, expect", [
    ("torn", r"copy_rows\.jsonl, line 135: the last line is cut off"),
    ("empty", r"copy_rows\.jsonl: no rows \(an empty file"),
    ("no_eval_loss", r"copy_rows\.jsonl, line 9: no field 'eval_loss' \(a 'final' row"),
    ("text_loss", r"copy_rows\.jsonl, line 1: field 'loss' holds 'low', not a number"),
])
def test_a_damaged_rows_file_is_one_error_naming_the_file_and_the_line(tmp_path, damage, expect):
    """A torn last line used to be dropped (softmax down to 2 seeds: the verdict became "not
    judged"); an empty file gave an AttributeError, a final row without eval_loss a KeyError."""
    from repro.reproduction.report import SchemaError

    _write(tmp_path)
    path, rows = _copy_rows(tmp_path)
    if damage == "torn":
        path.write_text(path.read_text()[:-40])
    elif damage == "empty":
        path.write_text("")
    elif damage == "no_eval_loss":
        path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "eval_loss"}) + "\n" for r in rows))
    else:
        rows[0]["loss"] = "low"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SchemaError, match=expect):
        claims.claims(tmp_path)


def test_a_failed_run_is_never_judged(tmp_path):
    """A seed whose status is not ok (a diverged run, a timeout): the claims that read it say which
    run failed and why, and give no verdict, even where its numbers look finite."""
    _write(tmp_path)
    path, rows = _copy_rows(tmp_path)
    next(r for r in rows if r["kind"] == "final" and r["attention"] == "softmax")["status"] = "timeout"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    img = tmp_path / "images/mnist_claims_seeds_cpu/image_rows.jsonl"
    rows = [json.loads(line) for line in img.read_text().splitlines()]
    next(r for r in rows if r["kind"] == "final" and r["attention"] == "lsh-1")["status"] = "error: non-finite loss"
    img.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, copy_linear, copy_lsh, _, mnist_steps, mnist_time, *_ = claims.claims(tmp_path)
    for c in (copy_linear, copy_lsh):
        assert c.verdict == f"{NOT_TESTABLE}: a run failed (softmax seed 0 failed (timeout))", c.verdict
    for c in (mnist_steps, mnist_time):
        assert c.verdict == f"{NOT_TESTABLE}: a run failed (lsh-1 seed 0 failed (error: non-finite loss))"
    asr = tmp_path / "asr/speed_800_cpu/asr_table.csv"
    pd.read_csv(asr).assign(status=["ok", "ok", "error: non-finite loss"]).to_csv(asr, index=False)
    verdict = claims.asr_claim(tmp_path, CLAIMS["asr"]).verdict
    assert verdict == f"{NOT_TESTABLE}: a run failed (linear failed (error: non-finite loss))", verdict


def test_copy_rows_without_eval_rows_are_judged_from_the_final_rows(tmp_path):
    """A copy run that never evaluated mid-way (trainer.eval_every=0) has final rows only: the
    claims judge them and say there is no curve (it was a KeyError 'loss')."""
    _write(tmp_path)
    path, rows = _copy_rows(tmp_path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["kind"] != "eval"))
    _, copy_linear, copy_lsh, *_ = claims.claims(tmp_path)
    assert "no held-out curve" in copy_linear.here and copy_linear.verdict.startswith(MEASURED)
    assert not copy_linear.verdict.startswith(NOT_TESTABLE) and not copy_lsh.verdict.startswith(NOT_TESTABLE)


def test_gpu_rows_are_measurements_marked_where_extrapolated_and_set_beside_the_cpu(tmp_path):
    """The H100 rows: batch-1 seconds per image for linear, the cache and re-running the prefix, the
    large batch's images/s lead, and the MNIST step; an extrapolated value carries *, and a batch-1
    GPU result that disagrees with the CPU run's says so."""
    _write(tmp_path)  # the CPU run: linear 5 / 4 = 1.25x faster than the cache at batch 1
    gen = tmp_path / GEN
    gen.mkdir(parents=True)
    rows = [("mnist", "linear", 1, 3.0, False), ("mnist", "stateful-softmax", 1, 1.5, False),
            ("mnist", "softmax", 1, 2.0, False), ("mnist", "linear", 256, 0.01, False),
            ("mnist", "stateful-softmax", 256, 0.02, True), ("cifar", "linear", 1, 20.0, True),
            ("cifar", "stateful-softmax", 1, 10.0, False)]
    pd.DataFrame([{"size": s, "method": m, "batch": b, "seconds_per_image": v, "images_per_s": b / (b * v),
                   "extrapolated": x, "status": "ok"} for s, m, b, v, x in rows]).to_csv(gen / "throughput.csv",
                                                                                       index=False)
    mnist = tmp_path / GPU_MNIST
    mnist.mkdir(parents=True)
    pd.DataFrame([{"attention": "linear", "steps": 800, "time_per_step_ms": 72.0, "status": "stopped: time limit"},
                  {"attention": "softmax", "steps": 1800, "time_per_step_ms": 31.0, "status": "stopped: time limit"}]
                 ).to_csv(mnist / "bpd_final.csv", index=False)
    batch1, big, step = claims.gpu_claims(tmp_path, GEN, GPU_MNIST, CLAIMS["batch"])
    assert "mnist s/image: linear 3, the cache 1.5, re-running the prefix 2" in batch1.here
    assert "cifar s/image: linear 20*, the cache 10, re-running the prefix not run" in batch1.here
    assert batch1.verdict == (f"{MEASURED} (one run): linear slower than the cache on mnist, cifar; differs from "
                              "the CPU run, where linear is 1.25x faster at batch 1")
    assert "batch 256" in big.here and "linear 100, the cache 50*, 2.00x" in big.here
    assert big.verdict == f"{MEASURED} (one run)"
    assert "linear 72 ms per step, softmax 31 ms per step" in step.here and "2.32x" in step.verdict
    assert f"(`{GEN}`)" in batch1.here and f"(`{GPU_MNIST}`)" in step.here
    assert [c.verdict for c in claims.gpu_claims(tmp_path, None, None)] == [f"{NOT_TESTABLE}: not run"] * 3
