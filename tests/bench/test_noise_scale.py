"""bench/noise_scale.py's core on a tiny digits run (2 batch sizes, one rate, an easy target),
its table, and its verdict on constructed numbers: it passes and fails where it should; and
bench/noise_stability.py's readings and verdict."""

from __future__ import annotations

import dataclasses
import math

import pytest

from batchfit.search.results.critical_batch import StepsModel
from bench import noise_scale as bench
from bench import noise_stability as stability

TINY = dataclasses.replace(
    bench.DIGITS, batches=(16, 64), lr_factors=(1.0,), target_loss=1.0, max_steps=60
)


def test_a_tiny_digits_run_measures_steps_and_noise_and_tabulates_them(hydra_conf) -> None:
    lines: list[str] = []
    outcome = bench.measure(hydra_conf, TINY, seeds=1, log=lines.append)
    assert [p.batch for p in outcome.points] == [16, 64] and not outcome.missing
    for point in outcome.points:
        (only,) = point.runs
        assert point.lr == TINY.lrs(point.batch)[0]  # the rule's centre: 0.04 x B / 16
        assert only.how == "target" and 0 < only.steps <= TINY.max_steps
        # the accumulated step's estimator read the noise scale on every step
        assert only.estimator.startswith("accumulation")
        assert math.isfinite(only.grad_sq_norm) and math.isfinite(only.grad_variance)
    assert len(lines) == 2 and lines[0].startswith("  digits B=16: 0.04: ")
    # Two batches determine the model exactly: predicted = measured at both.
    assert outcome.model is not None and outcome.model.worst_error() < 1e-9
    rows = bench.table(outcome)
    assert rows[0].startswith("digits: MLP") and "target val/loss 1" in rows[0]
    assert rows[1].split("|")[1:-1] == [
        " batch ",
        " best lr ",
        " measured steps ",
        " predicted steps ",
        " error ",
        " B_simple measured ",
    ]
    body = [r.split("|")[1:-1] for r in rows[3:5]]
    assert [cells[0].strip() for cells in body] == ["16", "64"]
    assert all(cells[4].strip() in ("+0.0%", "-0.0%") for cells in body)
    assert rows[5].startswith("S_min ") and "B_simple / B_crit" in rows[5]
    assert rows[6].startswith("noise scale estimator: accumulation")
    assert rows[7].startswith("wall time ")


def test_a_run_that_cannot_beat_the_best_stops_there(hydra_conf) -> None:
    from batchfit.train.workload import Workloads

    lr = TINY.lrs(16)[0]
    stopped = bench.train_to_target(hydra_conf, Workloads(), TINY, 16, lr, 0, cap=3)
    assert stopped.how == "stopped" and stopped.steps == math.inf


def test_steps_to_target_interpolates_between_validations() -> None:
    assert bench.steps_to_target([(10, 2.0), (20, 1.0)], 1.5) == 15.0
    assert bench.steps_to_target([(10, 2.0), (20, 1.4)], 1.5) == pytest.approx(10 + 10 * 5 / 6)
    assert bench.steps_to_target([(5, 0.9)], 1.0) == 5.0  # at the first validation
    assert bench.steps_to_target([(10, 2.0), (20, 1.6)], 1.5) == math.inf


TRUTH = StepsModel(20.0, 50.0)


def _model(errors: list[float]) -> StepsModel:
    """The true model, with measured steps off its prediction by `errors` (relative)."""
    batches = bench.DIGITS.batches
    pairs = zip(batches, errors, strict=True)
    points = tuple((float(b), TRUTH.steps(b) / (1 + e)) for b, e in pairs)
    return StepsModel(TRUTH.s_min, TRUTH.b_crit, points)


def test_the_verdict_passes_within_25_percent_and_a_factor_of_3() -> None:
    assert bench.verdict(_model([0, 0.24, -0.24, 0, 0]), noise_scale=50.0) == []
    assert bench.verdict(_model([0] * 5), noise_scale=50.0 * 2.9) == []
    assert bench.verdict(_model([0] * 5), noise_scale=50.0 / 2.9) == []


def test_the_verdict_fails_on_each_figure_and_says_which() -> None:
    (reason,) = bench.verdict(_model([0, 0, 0.3, 0, 0]), noise_scale=50.0)
    assert reason.startswith("batch 32: predicted") and "+30%, over 25%" in reason
    (reason,) = bench.verdict(_model([0, 0, -0.26, 0, 0]), noise_scale=50.0)
    assert "-26%" in reason
    (reason,) = bench.verdict(_model([0] * 5), noise_scale=50.0 * 3.1)
    assert "3.10x B_crit" in reason and "outside 1/3..3x" in reason
    (reason,) = bench.verdict(_model([0] * 5), noise_scale=50.0 / 3.1)
    assert "0.32x B_crit" in reason
    for unmeasured in (math.nan, -4.0):
        (reason,) = bench.verdict(_model([0] * 5), noise_scale=unmeasured)
        assert "no noise scale to compare" in reason
    reasons = bench.verdict(None, 50.0, missing=[8], no_fit="steps at 1 batch size(s)")
    assert reasons == [
        "batch 8 reached the target at no learning rate",
        "no fit: steps at 1 batch size(s)",
    ]


def test_quick_keeps_the_ends_and_the_middle() -> None:
    quick = bench.quick(bench.DIGITS)
    assert quick.batches == (8, 32, 128)
    assert quick.lr_factors == (1.0, 2.0)
    assert bench.quick(bench.GPT).lr_factors == (0.5, 1.0)
    # the centre first, then outwards; linear in B, around 0.04 at 16
    assert bench.DIGITS.lrs(8) == [0.02, 0.04, 0.01, 0.08]
    assert bench.GPT.lrs(64) == [0.004, 0.008, 0.002]  # the square root: 2e-3 x 2 at 64


def _readings(*values: float) -> list[stability.Reading]:
    return [
        stability.Reading(seed, v, v / 2, v * 2, 9, "accumulation: ...")
        for seed, v in enumerate(values)
    ]


def test_the_stability_verdict_passes_within_2x_across_seeds_and_fails_beyond() -> None:
    """Broken on purpose (max/min replaced by max/median), the 2.1x case passes: it fails."""
    spread, reasons = stability.stability_verdict(_readings(40.0, 60.0, 80.0))
    assert spread == pytest.approx(2.0) and reasons == []
    spread, reasons = stability.stability_verdict(_readings(40.0, 60.0, 84.0))
    assert spread == pytest.approx(2.1)
    assert reasons == ["max/min 2.10 across seeds, over 2"]
    _, reasons = stability.stability_verdict(_readings(40.0, math.nan, 50.0))
    assert reasons == ["seed(s) [1] logged no B_simple"]
    missing = stability.Reading(1, math.nan, math.nan, math.nan, 3, "x")
    assert "seed 1: no B_simple" in missing.line()
    assert _readings(46.6)[0].line() == "    seed 0: B_simple 46.6 [23.3, 93.2] over 9 steps"


def test_stability_reads_the_figures_a_trial_logs(hydra_conf) -> None:
    """A tiny run (the MLP on digits, 2 epochs of 16x4: 44 measured steps) per seed: its
    B_simple, interval and steps as RunResult.metrics() gives them."""
    overrides = ("model=mlp", "trainer.batch_size=16", "trainer.accum_steps=4")
    compose = lambda extra: hydra_conf([*extra, "trainer.max_epochs=2"])  # noqa: E731
    (reading,) = stability.stability(compose, overrides, seeds=1)
    assert reading.steps > 30 and reading.note.startswith("accumulation: ")
    assert reading.note.endswith(f"over {reading.steps} steps")
    assert 0 < reading.low < reading.noise_scale < reading.high
