"""repro.reproduction.claims: the verdict rules, and the section rendered from results folders written here in
the formats the tasks publish (copy_final/copy_curves, bpd_curves + image_rows, asr_table +
asr_rows, throughput.csv), with the expected numbers worked out by hand."""
import json

import pandas as pd
import pytest

from repro.reproduction import claims
from repro.reproduction.claims import NOT_REPRODUCED, NOT_TESTABLE, REPRODUCED

# ----------------------------------------------------------------------------- the rules

def test_same_loss():
    assert claims.same_loss(0.005, 0.0001, tol=0.01)
    assert claims.same_loss(0.0001, 0.005, tol=0.01)  # better than the reference counts
    assert not claims.same_loss(0.05, 0.0001, tol=0.01)


@pytest.mark.parametrize("values, verdict, measured", [
    ({"a": 1.0, "b": 1.1, "c": 1.2}, REPRODUCED, "a < b < c"),
    ({"a": 1.0, "b": 1.2, "c": 1.1}, f"{NOT_REPRODUCED}: the order differs", "a < c < b"),
    ({"a": 1.0, "b": 1.005, "c": 1.2}, f"{NOT_REPRODUCED}: inconclusive, gaps within 0.01 bits/dim (ties)",
     "a ≈ b < c"),
    # an inversion within the tolerance is a tie, not a different order
    ({"a": 1.004, "b": 1.0, "c": 1.2}, f"{NOT_REPRODUCED}: inconclusive, gaps within 0.01 bits/dim (ties)",
     "b ≈ a < c"),
])
def test_ordering_verdict(values, verdict, measured):
    assert claims.ordering_verdict(values, ["a", "b", "c"], tol=0.01) == (verdict, measured)


def test_leader_verdict():
    assert claims.leader_verdict({"l": 1.0, "s": 1.05, "h": 1.2}, "l", tol=0.01) == REPRODUCED
    assert claims.leader_verdict({"l": 1.0, "s": 0.95, "h": 1.2}, "l", tol=0.01) == f"{NOT_REPRODUCED}: s ahead"
    assert claims.leader_verdict({"l": 1.0, "s": 1.005, "h": 0.995}, "l", tol=0.01) == \
        f"{NOT_REPRODUCED}: inconclusive, within 0.01 bits/dim of s, h"


def test_speedup_and_growth_verdicts():
    assert claims.speedup_verdict(3.3, 3.3) == REPRODUCED
    assert claims.speedup_verdict(2.3, 3.3, factor=1.5) == REPRODUCED  # 3.3 / 1.5 = 2.2
    assert claims.speedup_verdict(1.5, 3.3, factor=1.5).startswith(f"{NOT_REPRODUCED}: faster, but 1.50x")
    assert claims.speedup_verdict(0.9, 3.3) == f"{NOT_REPRODUCED}: not faster"
    assert claims.growth_verdict({1: 1.0, 64: 2.0}) == REPRODUCED
    assert claims.growth_verdict({1: 1.0, 10: 3.0, 64: 1.1}, margin=1.25) == f"{NOT_REPRODUCED}: grows only 1.10x"
    assert claims.growth_verdict({1: 2.0, 64: 1.5}) == f"{NOT_REPRODUCED}: the lead does not grow"


# ----------------------------------------------------------------------------- the section

def _write(results, lsh_copy_loss=0.6, linear_copy_loss=0.002):
    copy = results / "copy/figure2_long_cpu"
    copy.mkdir(parents=True)
    final = {"softmax": 0.0001, "linear": linear_copy_loss, "lsh-4": lsh_copy_loss}
    pd.DataFrame([{"max_len": 32, "attention": a, "n_seeds": 3, "steps": 4000.0, "eval_loss": v,
                   "eval_loss_std": v / 10, "eval_accuracy": 0.99} for a, v in final.items()]
                 ).to_csv(copy / "copy_final.csv", index=False)
    pd.DataFrame([{"max_len": 32, "attention": "softmax", "kind": "eval", "metric": "loss", "step": s, "mean": v}
                  for s, v in [(1000, 0.01), (2000, 0.001), (4000, 0.0001)]]).to_csv(
        copy / "copy_curves.csv", index=False)

    img = results / "images/mnist_claims_cpu"
    img.mkdir(parents=True)
    # bits/dim falls by 0.1 per 100 steps from a per-attention start; ms/step per attention
    start = {"softmax": 2.0, "linear": 2.02, "lsh-4": 2.05, "lsh-1": 2.1}
    ms = {"softmax": 100.0, "linear": 50.0, "lsh-4": 200.0, "lsh-1": 100.0}
    pd.DataFrame([{"dataset": "mnist", "attention": a, "kind": "eval", "step": s, "mean": b - s / 1000,
                   "min": 0, "max": 0, "n_seeds": 1} for a, b in start.items() for s in (100, 200, 300, 400)]
                 ).to_csv(img / "bpd_curves.csv", index=False)
    (img / "image_rows.jsonl").write_text("".join(
        json.dumps({"kind": "final", "attention": a, "cpu_time_per_step_ms": v, "steps": 400}) + "\n"
        for a, v in ms.items()))

    asr = results / "asr/speed_800_cpu"
    asr.mkdir(parents=True)
    pd.DataFrame([{"model": m, "steps": 8.0, "epochs": 2.0, "s_per_epoch": s * 1.5, "cpu_s_per_epoch": s,
                   "ms_per_step": s * 375, "mean_frames": 801.0}
                  for m, s in [("softmax", 10.0), ("softmax-math", 12.0), ("linear", 4.0)]]
                 ).to_csv(asr / "asr_table.csv", index=False)
    (asr / "asr_rows.jsonl").write_text(json.dumps(
        {"kind": "train", "batch_size": 8, "model_n_layers": 9, "model_n_heads": 6, "model_d_model": 192}) + "\n")

    gen = results / "throughput/batch64_cpu"
    gen.mkdir(parents=True)
    secs = {("linear", 1): 4.0, ("stateful-softmax", 1): 5.0, ("linear", 64): 0.1, ("stateful-softmax", 64): 0.5}
    pd.DataFrame([{"method": m, "batch": b, "status": "ok", "seconds_per_image": v * 2, "cpu_seconds_per_image": v,
                   "extrapolated": b == 64} for (m, b), v in secs.items()]).to_csv(gen / "throughput.csv", index=False)


def test_section_from_results(tmp_path):
    _write(tmp_path)
    rows = claims.claims(tmp_path)
    copy_linear, copy_lsh, mnist_steps, mnist_time, asr, gen, *untestable = rows
    assert copy_linear.verdict == REPRODUCED and "linear 0.0020 ± 0.00020 (99.00 % right)" in copy_linear.here
    assert "softmax had 0.001 at update 2000" in copy_linear.here  # the last eval at or before 3/4 of 4000
    assert copy_lsh.verdict == REPRODUCED and "lsh-4 0.60 ± 0.060" in copy_lsh.here
    # straight curves: no wobble, so gaps above 0.01 count. Equal steps: the mean of the last 3
    # evaluations (steps 200..400: start - 0.3) = 1.7, 1.72, 1.75, 1.8 -> the paper's order
    assert (mnist_steps.verdict == REPRODUCED
            and "softmax 1.700, linear 1.720, lsh-4 1.750, lsh-1 1.800" in mnist_steps.here)
    assert "gaps below 0.010" in mnist_steps.here
    # equal time: the fastest run (linear, 400 x 50 ms = 20 s) is the budget; in it softmax and
    # lsh-1 take 200 steps, lsh-4 100, linear 400; the smoothed curve there (mean of the evals up
    # to it, at most 3): start - 0.15, - 0.1, - 0.3 -> 1.85, 1.95, 1.72, 1.95: linear first
    assert "20 s of CPU time" in mnist_time.here
    assert "softmax 1.850 (200 steps), linear 1.720 (400 steps), lsh-4 1.950 (100 steps), lsh-1 1.950 (200 steps)" \
        in mnist_time.here
    assert mnist_time.verdict == REPRODUCED and "linear < softmax < lsh-4 ≈ lsh-1" in mnist_time.here
    # speech: CPU time per epoch, against softmax-math (the paper's baseline): 12 / 4 = 3.0x >= 3.3 / 1.5
    assert asr.verdict == REPRODUCED and "2.50x faster than softmax " in asr.here
    assert "linear 3.00x faster than softmax-math" in asr.here and "9 layers x 6 heads x 32" in asr.here
    # CPU s per update: s per epoch x 2 epochs / 8 updates
    assert "CPU s/update: softmax 2.50, softmax-math 3.00, linear 1.00" in asr.here
    # generation: 5 / 4 = 1.25x at batch 1, 0.5 / 0.1 = 5x at batch 64 (extrapolated: starred)
    assert gen.verdict == REPRODUCED and "1.25x" in gen.here and "0.1* / 0.5* = 5.00x" in gen.here
    assert all(c.verdict.startswith(NOT_TESTABLE) for c in untestable)

    text = claims.section(tmp_path)
    lines = text.strip().splitlines()
    assert lines[0] == "| Claim | Paper | Here (CPU-sized runs) | Verdict |"
    assert len(lines) == 2 + len(rows) and all(line.count(" | ") == 3 for line in lines[2:])
    assert f"| **{REPRODUCED}** |" in lines[2]


def test_section_verdicts_turn(tmp_path):
    _write(tmp_path, lsh_copy_loss=0.005, linear_copy_loss=0.3)
    copy_linear, copy_lsh, *_ = claims.claims(tmp_path)
    assert copy_linear.verdict.startswith(f"{NOT_REPRODUCED}: 0.3 nats above softmax")
    assert copy_lsh.verdict == NOT_REPRODUCED  # 0.005 is not above linear's 0.3


def test_section_without_runs(tmp_path):
    rows = claims.claims(tmp_path)
    assert [r.verdict for r in rows[:6]] == [f"{NOT_TESTABLE}: not run"] * 6
    assert "no run in `copy/figure2_long_cpu`" in rows[0].here
    assert claims.section(tmp_path).count(NOT_TESTABLE) == len(rows)


def test_mnist_wobble_makes_ties(tmp_path):
    """One seed's held-out curve wobbles between evaluations; gaps smaller than that wobble are
    ties. Here flat curves alternate +-0.03 around levels 0.02 apart."""
    _write(tmp_path)
    img = tmp_path / "images/mnist_claims_cpu"
    level = {"softmax": 1.6, "linear": 1.62, "lsh-4": 1.64, "lsh-1": 1.66}
    steps = range(50, 450, 50)  # 8 evaluations: the last half is 4
    pd.DataFrame([{"dataset": "mnist", "attention": a, "kind": "eval", "step": s, "mean": v + 0.03 * (-1) ** (s // 50),
                   "n_seeds": 1} for a, v in level.items() for s in steps]).to_csv(img / "bpd_curves.csv", index=False)
    # by hand: the last 4 values are 0.03 x (-1, 1, -1, 1) at x = 0..3; the fitted line is
    # 0.03 x 0.4 (x - 1.5), the residuals 0.03 x (-0.4, 1.2, -1.2, 0.4): sqrt(3.2 / (4 - 2)) x 0.03
    expected = 0.03 * 1.6 ** 0.5  # 0.0379
    curve = pd.DataFrame({"step": [250, 300, 350, 400], "mean": [1.57, 1.63, 1.57, 1.63]})
    assert claims.wobble(curve) == pytest.approx(expected)
    assert claims.wobble(curve.iloc[:3]) == 0.0  # too few evaluations to tell noise from trend
    mnist_steps = claims.claims(tmp_path)[2]
    assert mnist_steps.verdict == f"{NOT_REPRODUCED}: inconclusive, gaps within 0.038 bits/dim (ties)"


# ----------------------------------------------------------------------------- the presets

def test_claims_presets(compose_cfg):
    """The runs' presets build what their results READMEs say: the copy sweep over exactly
    softmax, linear and LSH-4 (at N = 32's buckets and chunks) x 3 seeds, the paper's speech
    encoder at ~800 frames, and generation with the two recurrent methods only."""
    from hydra import compose, initialize_config_dir

    from repro.cli.config import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        sweep = compose(config_name="config", overrides=["experiment=copy_claims_cpu"], return_hydra_config=True)
    # its own sweep only (inheriting copy_figure2_cpu's `attention` sweep multiplied the jobs by 2)
    assert dict(sweep.hydra.sweeper.params) == {"copy_attention": "softmax,linear,lsh-4", "seed": "0,1,2"}
    lsh = compose_cfg("experiment=copy_claims_cpu", "copy_attention=lsh-4")
    assert (lsh.attention.n_hashes, lsh.attention.n_buckets, lsh.attention.chunk_size) == (4, 16, 8)
    assert (lsh.task.max_len, lsh.trainer.max_steps, list(lsh.trainer.scheduler.milestones)) == (32, 4000, [2800])
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
