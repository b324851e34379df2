"""search/results/critical_batch.py: McCandlish et al.'s S = S_min (1 + B_crit / B), fitted to steps
measured at several batch sizes, and NoFit where the measurements do not determine it."""

from __future__ import annotations

import math

import pytest

from batchfit.search.results.critical_batch import NoFit, StepsModel, fit_samples, fit_steps

BATCHES = [8, 16, 32, 64, 128]


@pytest.mark.parametrize(("s_min", "b_crit"), [(20.0, 50.0), (1000.0, 3.0), (7.5, 4096.0)])
def test_points_on_the_model_give_back_its_constants(s_min: float, b_crit: float) -> None:
    truth = StepsModel(s_min, b_crit)
    model = fit_steps(BATCHES, [truth.steps(b) for b in BATCHES])
    assert model.s_min == pytest.approx(s_min, rel=1e-9)
    assert model.b_crit == pytest.approx(b_crit, rel=1e-9)
    assert model.worst_error() == pytest.approx(0.0, abs=1e-9)
    assert model.points == tuple((float(b), truth.steps(b)) for b in BATCHES)


def test_two_batch_sizes_determine_the_model_exactly() -> None:
    # 100 = S_min (1 + B/10) and 60 = S_min (1 + B/30), by hand: S_min 40, B_crit 15.
    model = fit_steps([10, 30], [100, 60])
    assert (model.s_min, model.b_crit) == (pytest.approx(40.0), pytest.approx(15.0))
    assert model.e_min == pytest.approx(600.0)
    assert model.samples(10) == pytest.approx(1000.0)  # E_min (1 + 10/15)


def test_the_model_follows_mccandlish() -> None:
    model = StepsModel(s_min=10.0, b_crit=100.0)
    assert model.steps(100) == 20.0  # twice S_min at B = B_crit
    assert model.samples(100) == 2 * model.e_min  # and twice E_min
    assert model.steps(1e12) == pytest.approx(10.0)  # S_min: a batch far above B_crit


def test_worst_error_is_the_largest_relative_miss_over_the_points() -> None:
    # S(B) = 10 (1 + 10/B): 20 at B = 10, 15 at B = 20; measured 25 and 12.
    model = StepsModel(10.0, 10.0, points=((10.0, 25.0), (20.0, 12.0)))
    assert model.worst_error() == pytest.approx(0.25)  # |15 - 12| / 12, above |20 - 25| / 25
    assert math.isnan(StepsModel(10.0, 10.0).worst_error())  # no points


def test_a_noisy_fit_weighs_relative_errors() -> None:
    """Weighted by 1/S², a point 10% off at a large step count moves the fit no more than
    one 10% off at a small one: the worst relative error stays near 10%, not dominated by
    the largest counts."""
    truth = StepsModel(20.0, 50.0)
    steps = [truth.steps(b) * f for b, f in zip(BATCHES, [1.1, 0.9, 1.1, 0.9, 1.1], strict=True)]
    model = fit_steps(BATCHES, steps)
    assert model.worst_error() < 0.15
    assert 30 < model.b_crit < 80


def test_one_batch_size_does_not_determine_it() -> None:
    with pytest.raises(NoFit, match=r"steps at 1 batch size\(s\): 2 or more needed"):
        fit_steps([32, 32, 32], [100, 110, 90])


def test_points_not_reached_are_left_out_before_counting() -> None:
    with pytest.raises(NoFit, match="steps at 1 batch size"):
        fit_steps([16, 32, 64], [math.inf, 50, math.nan])


@pytest.mark.parametrize(
    "steps",
    [[50, 60, 70, 80, 90], [40, 40, 40, 40, 40]],
    ids=["steps rising with the batch", "steps flat"],
)
def test_steps_that_do_not_fall_as_the_batch_grows_have_no_critical_batch(
    steps: list[float],
) -> None:
    with pytest.raises(NoFit, match="do not fall as the batch grows"):
        fit_steps(BATCHES, steps)


def test_steps_falling_faster_than_one_over_b_have_no_positive_s_min() -> None:
    # S = 1000/B - 5: falls faster than the model allows, the line's intercept is negative.
    with pytest.raises(NoFit, match="fitted S_min -5"):
        fit_steps(BATCHES, [1000 / b - 5 for b in BATCHES])


def test_steps_falling_faster_than_the_model_are_below_critical_and_fit_the_limit():
    """S_min below zero with steps still falling: NoFit says below_critical, and
    fit_samples finds the samples every batch took (S = E_min / B) and how far each is."""
    steps = [1000 / b - 5 for b in BATCHES]
    with pytest.raises(NoFit) as error:
        fit_steps(BATCHES, steps)
    assert error.value.below_critical
    with pytest.raises(NoFit) as rising:
        fit_steps(BATCHES, [100 + b for b in BATCHES])
    assert not rising.value.below_critical
    limit = fit_samples([16, 64], [100, 25])
    assert limit.unbounded and limit.s_min == 0
    assert limit.e_min == pytest.approx(1600) and limit.steps(32) == pytest.approx(50)
    assert limit.samples(128) == pytest.approx(1600) and limit.worst_error() == 0
    off = fit_samples([16, 64], [100, 50])  # 1600 and 3200 samples: E between, both missed
    assert 1600 < off.e_min < 3200 and off.worst_error() > 0.25
