"""Time to target (search/time_to_target.py) and the recommendation by it
(search/recommend.py), on trials recorded as search/outcome.py records them."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from search.config import RecommendRule
from search.recommend import recommend
from search.report import lr_plan
from search.time_to_target import Untrusted, plan, steps_to

ACC, SPEED = "val/acc", "throughput/samples_per_sec"
S_MIN, B_CRIT = 100.0, 64.0


def _curve(steps_to_target: float, target: float = 1.0, every: float = 10.0) -> list:
    """val/loss falling linearly through `target` at `steps_to_target`, validated every
    `every` steps: 2.0 at step 0, `target` at the crossing."""
    slope = (2.0 - target) / steps_to_target
    points, step = [], every
    while step <= steps_to_target * 1.5:
        points.append([step, round(2.0 - slope * step, 6)])
        step += every
    return points


def _trial(
    batch: int,
    steps: float,
    step_ms: float,
    noise: float | None = None,
    acc: float = 0.9,
    accum: int = 1,
) -> FrozenTrial:
    attrs = {
        "trainer.batch_size": batch // accum,
        "trainer.accum_steps": accum,
        "trainer.precision": "fp32",
        "effective_batch_size": batch,
        "global_batch_size": batch,
        "optimizer.lr": 0.01,
        "lr_scaled": 0.01 * batch / 32,
        "lr_rule": "linear",
        "lr_reference": 32,
        "step_ms": step_ms,
        "val_curve": _curve(steps, every=max(1.0, steps / 5)),
        "metrics": {ACC: acc, SPEED: batch / step_ms * 1000}
        | ({"stats/grad_noise_scale": noise} if noise else {}),
    }
    return create_trial(
        state=TrialState.COMPLETE,
        values=[acc, batch / step_ms * 1000],
        params={"trainer.batch_size": batch // accum},
        distributions={"trainer.batch_size": CategoricalDistribution([8, 16, 32, 64, 128, 256])},
        user_attrs=attrs,
    )


def _study(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    study = optuna.create_study(directions=["maximize", "maximize"])
    for t in trials:
        study.add_trial(t)
    return study.get_trials(deepcopy=False)


def _on_model(batch: int) -> float:
    return S_MIN * (1 + B_CRIT / batch)


def test_steps_to_interpolates_between_the_validations_around_the_crossing():
    assert steps_to([[10, 1.5], [20, 0.5]], 1.0) == pytest.approx(15.0)
    assert steps_to([[10, 1.5], [20, 1.2]], 1.0) is None  # never reached
    # reached by its first validation: when, the curve cannot say
    assert steps_to([[10, 0.9], [20, 0.5]], 1.0) is None


def test_the_model_is_fitted_and_the_fastest_geometry_is_recommended():
    """Steps on S_min (1 + B_crit/B) at four batch sizes; seconds per step growing less than
    the batch: 128 reaches the target soonest (150 x 0.08 s = 12 s) though 256 takes fewer
    steps, and it is recommended though 32 is the most accurate."""
    ms = {32: 80.0, 64: 70.0, 128: 80.0, 256: 200.0}
    trials = _study([_trial(b, _on_model(b), ms[b], acc=0.95 if b == 32 else 0.9) for b in ms])
    p = plan(trials, target=1.0)
    assert p.model.s_min == pytest.approx(S_MIN, rel=0.02)
    assert p.model.b_crit == pytest.approx(B_CRIT, rel=0.02)
    assert p.source == "fitted over 4 batch sizes"
    assert [x.batch for x in p.predicted] == [128, 64, 32, 256]
    assert p.best.seconds == pytest.approx(_on_model(128) * 0.08, rel=0.02)
    rec = recommend(trials, RecommendRule(ACC, 0.01, SPEED), loss_target=1.0)
    assert rec.by_time is not None and rec.trial.number == 2
    assert "predicted to reach the target soonest: 128x1 fp32, 150 steps" in rec.describe()
    # Without the prediction (one validation each: no crossing between two), the rule.
    flat = [_trial(b, _on_model(b), ms[b], acc=0.95 if b == 32 else 0.9) for b in ms]
    for t in flat:
        t.user_attrs["val_curve"] = [[400, 0.5]]
    by_rule = recommend(_study(flat), RecommendRule(ACC, 0.01, SPEED), loss_target=1.0)
    assert by_rule.by_time is None and by_rule.trial.number == 0
    assert "crossed val/loss 1 between two validations" in by_rule.by_time_note


def test_two_batch_sizes_are_trusted_when_the_noise_scale_confirms_their_line():
    trials = _study([_trial(32, _on_model(32), 40, noise=60), _trial(128, _on_model(128), 90, 70)])
    p = plan(trials, target=1.0)
    assert p.model.b_crit == pytest.approx(B_CRIT, rel=0.02)  # the line through both
    assert p.model.s_min == pytest.approx(S_MIN, rel=0.02)
    assert p.source == "fitted on 2 batch sizes, B_simple within 3x of it"
    far = [_trial(32, _on_model(32), 40, noise=10), _trial(128, _on_model(128), 90, 15)]
    with pytest.raises(Untrusted, match="noise scale 12.5 is not within 3x of it"):
        plan(_study(far), target=1.0)
    with pytest.raises(Untrusted, match="no noise scale measured to confirm"):
        plan(_study([_trial(32, _on_model(32), 40), _trial(128, _on_model(128), 90)]), 1.0)


def test_one_batch_size_takes_b_crit_from_a_stable_noise_scale():
    trials = _study([_trial(64, _on_model(64), 50, noise=60), _trial(64, 400.0, 50, noise=70)])
    p = plan(trials, target=1.0)
    assert p.model.b_crit == pytest.approx(65.0)  # the median of 60 and 70
    assert p.model.steps(64) == pytest.approx(_on_model(64), rel=0.02)  # its fewest steps
    unstable = [_trial(64, _on_model(64), 50, noise=10), _trial(64, 400.0, 50, noise=70)]
    with pytest.raises(Untrusted, match="noise scales differ 7.0x"):
        plan(_study(unstable), target=1.0)


def test_steps_that_do_not_fall_with_the_batch_are_no_fit():
    trials = _study([_trial(b, 100.0 + b, 50, noise=64) for b in (32, 64, 128)])
    with pytest.raises(Untrusted, match="no fit: steps to the target do not fall"):
        plan(trials, target=1.0)


def test_without_a_target_the_loss_every_batch_size_reached_is_one():
    trials = [_trial(b, _on_model(b), 50.0, noise=64) for b in (32, 64, 128)]
    trials.append(_trial(64, 2 * _on_model(64), 50.0, noise=64))  # slower: not the batch's best
    trials[1].user_attrs["val_curve"][-1][1] = 0.1  # 64's best trial reached 0.1
    p = plan(_study(trials))
    assert p.target_source == "the loss every batch size reached"
    bests = [min(v for _, v in t.user_attrs["val_curve"]) for t in trials[:3]]
    assert p.target == max(bests) and max(bests) > 0.1
    assert {x.batch for x in p.points} == {32, 64, 128}


def test_the_learning_rate_plan_scales_by_the_studys_rule():
    text = lr_plan(_trial(64, 100, 50))
    assert text.startswith(
        "Learning rate: 0.02 at this global batch of 64 (optimizer.lr=0.01 at 32"
    )
    assert "32 -> 0.01, 128 -> 0.04" in text
    sqrt = _trial(16, 100, 50)
    sqrt.user_attrs.update({"lr_rule": "sqrt", "lr_reference": 16, "optimizer.lr": 2e-5})
    sqrt.user_attrs["lr_scaled"] = 2e-5
    assert "8 -> 1.41e-05, 32 -> 2.83e-05" in lr_plan(sqrt)


def test_a_negative_noise_reading_is_left_out_of_the_median():
    """A reading whose variance estimate fell below zero says nothing of B_crit: without it
    the median is 65 and confirms the two batch sizes' line; with it, it would be 60."""
    trials = [_trial(32, _on_model(32), 40, noise=60), _trial(128, _on_model(128), 90, 70)]
    trials.append(_trial(32, 2 * _on_model(32), 40, noise=-500))
    p = plan(_study(trials), target=1.0)
    assert p.noise_scale == pytest.approx(65.0)
