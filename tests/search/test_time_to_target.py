"""Time to target (search/time_to_target.py) and the recommendation by it
(search/recommend.py), on trials recorded as search/outcome.py records them."""

from __future__ import annotations

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from search.config import RecommendRule
from search.plots import time_to_target_plot
from search.recommend import best_document, recommend
from search.record import Attr
from search.report import lr_plan
from search.time_to_target import Untrusted, plan, steps_to
from tracking.metrics import GRAD_NOISE_SCALE, STEP_MS, THROUGHPUT_SAMPLES, VAL_ACC
from train.params import LR_PARAM

ACC, SPEED = VAL_ACC, THROUGHPUT_SAMPLES
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
        "metrics": {ACC: acc, SPEED: batch / step_ms * 1000, STEP_MS: step_ms}
        | ({GRAD_NOISE_SCALE: noise} if noise else {}),
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
        t.user_attrs[Attr.VAL_CURVE] = [[400, 0.5]]
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
    trials[1].user_attrs[Attr.VAL_CURVE][-1][1] = 0.1  # 64's best trial reached 0.1
    p = plan(_study(trials))
    assert p.target_source == "the loss every batch size reached"
    bests = [min(v for _, v in t.user_attrs[Attr.VAL_CURVE]) for t in trials[:3]]
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
    sqrt.user_attrs[LR_PARAM] = 2e-5
    assert "8 -> 1.41e-05, 32 -> 2.83e-05" in lr_plan(sqrt)


def test_a_negative_noise_reading_is_left_out_of_the_median():
    """A reading whose variance estimate fell below zero says nothing of B_crit: without it
    the median is 65 and confirms the two batch sizes' line; with it, it would be 60."""
    trials = [_trial(32, _on_model(32), 40, noise=60), _trial(128, _on_model(128), 90, 70)]
    trials.append(_trial(32, 2 * _on_model(32), 40, noise=-500))
    p = plan(_study(trials), target=1.0)
    assert p.noise_scale == pytest.approx(65.0)


def _cell(batch: int, accum: int = 1, precision: str = "fp32", fits: bool = True) -> dict:
    """A fit report cell as the study keeps it (search/boundary.py fit_cells)."""
    return {
        "trainer.precision": precision, "trainer.accum_steps": accum,
        "trainer.activation_checkpointing": "none", "trainer.batch_size": batch,
        "fits": fits, "peak_bytes": 1000 * batch,
    }  # fmt: skip


def test_fit_report_cells_no_trial_trained_are_predicted_and_recommended():
    """Trials at 32, 64 and 256 (on the model) timed at 50, 70 and 120 ms a step; the fit
    report's 128x1 fp32, which no trial trained, takes 70 + (120 - 70)(128 - 64)/(256 - 64)
    = 86.7 ms a step, interpolated: 150 steps x 86.7 ms = 13.0 s beats 64's 14 s, 32's
    15 s and 256's 15 s. The cells that do not fit, have no trial of their precision, or
    that a trial tried and diverged are not predicted; 64x2 is 2 micro-steps of 64."""
    ms = {32: 50.0, 64: 70.0, 256: 120.0}
    trials = [_trial(b, _on_model(b), ms[b]) for b in ms]
    diverged = _trial(16, _on_model(16), 30)
    diverged = create_trial(
        state=TrialState.PRUNED, params=diverged.params, distributions=diverged.distributions,
        user_attrs={**diverged.user_attrs, "reason": "diverged", "state": "PRUNED"},
    )  # fmt: skip
    trials = _study([*trials, diverged])
    cells = [
        _cell(16), _cell(32), _cell(64), _cell(128), _cell(256), _cell(512, fits=False),
        _cell(64, accum=2), _cell(128, precision="bf16"), _cell(1024),
    ]  # fmt: skip
    p = plan(trials, target=1.0, cells=cells)
    by = {x.geometry: x for x in p.predicted}
    # (1024: beyond the timed sizes, how a step's time grows the trials do not say)
    assert set(by) == {"32x1 fp32", "64x1 fp32", "256x1 fp32", "128x1 fp32", "64x2 fp32"}
    cell = by["128x1 fp32"]
    assert cell.trials == () and cell.step_basis == "interpolated (64, 256)"
    assert cell.step_s == pytest.approx(0.070 + 0.050 * 64 / 192)
    assert cell.steps == pytest.approx(_on_model(128), rel=0.02)
    assert p.best is cell
    assert by["64x2 fp32"].step_s == pytest.approx(0.140)
    assert by["64x2 fp32"].step_basis == "measured (64, other accumulation)"
    assert dict(cell.sets) == {
        "trainer.precision": "fp32", "trainer.accum_steps": 1,
        "trainer.activation_checkpointing": "none", "trainer.batch_size": 128,
    }  # fmt: skip

    rec = recommend(trials, RecommendRule(ACC, 0.01, SPEED), loss_target=1.0, cells=cells)
    assert rec.untrained is cell or rec.untrained == cell
    # its learning rate from the trial that reached the target at the nearest batch (64 and
    # 256 are as near: 256, in fewer steps)
    assert rec.trial.number == 2
    assert rec.describe().startswith("128x1 fp32, the configuration predicted to reach")
    assert "no trial trained it" in rec.describe()
    base = ["trainer.batch_size=256", "optimizer.lr=0.01", "trainer.lr_ref_batch_size=32"]
    assert rec.overrides(base) == [
        "optimizer.lr=0.01", "trainer.lr_ref_batch_size=32", "trainer.precision=fp32",
        "trainer.accum_steps=1", "trainer.activation_checkpointing=none",
        "trainer.batch_size=128",
    ]  # fmt: skip
    # at 128, optimizer.lr=0.01 at 32 scaled linearly: 0.04
    assert lr_plan(rec.trial, rec.untrained.batch).startswith(
        "Learning rate: 0.04 at this global batch of 128 (optimizer.lr=0.01 at 32"
    )
    document = best_document(rec, "s", rec.overrides(base))
    body = yaml.safe_load(document)
    assert body["configuration"] == "128x1 fp32" and body["trained_by_a_trial"] is False
    assert body["predicted"]["seconds_to_target"] == pytest.approx(cell.seconds, rel=1e-3)
    assert "values" not in body  # trial 2's figures are not this configuration's


def test_one_measured_micro_batch_predicts_only_its_other_accumulations():
    """With one micro-batch size timed, its cells at other accumulations are predicted
    (2 micro-steps of its time); a size no trial timed around is not."""
    trials = _study([_trial(64, _on_model(64), 64.0, noise=60), _trial(64, 400.0, 64.0, noise=70)])
    p = plan(trials, target=1.0, cells=[_cell(64), _cell(128), _cell(16), _cell(64, accum=2)])
    (cell,) = [x for x in p.predicted if not x.trials]
    assert cell.geometry == "64x2 fp32" and cell.step_s == pytest.approx(0.128)


def test_steps_falling_as_one_over_b_is_every_batch_below_b_crit():
    """The same samples to the target at 16, 64 and 128 (within 5%): the fit's intercept
    S_min falls below zero, and the model's limit S = E_min / B takes over; B_crit lies above
    128 by an amount the trials cannot say, so nothing above it is predicted. A noise scale
    that puts B_crit below the batches contradicts them."""
    samples = {16: 1400.0, 64: 1472.0, 128: 1370.0}
    ms = {16: 40.0, 64: 150.0, 128: 190.0}
    trials = _study([_trial(b, samples[b] / b, ms[b], noise=400) for b in samples])
    cells = [_cell(16), _cell(64), _cell(128), _cell(256)]
    p = plan(trials, target=1.0, cells=cells)
    assert p.model.unbounded and p.model.s_min == 0
    assert p.model.e_min == pytest.approx(1410, rel=0.03)
    assert "E_min 14" in p.describe() and "B_crit unbounded" in p.describe()
    assert "steps fell as 1/B over 3 batch sizes" in p.source
    assert max(x.batch for x in p.predicted) == 128  # 256: beyond what the trials say
    assert p.best.geometry == "128x1 fp32"  # the fewest seconds per sample
    figure = time_to_target_plot(p)
    assert not any(line.get_label() == "B_crit" for line in figure.axes[0].lines)
    low = _study([_trial(b, samples[b] / b, ms[b], noise=20) for b in samples])
    with pytest.raises(Untrusted, match="noise scale 20 puts B_crit below it"):
        plan(low, target=1.0)
    scattered = _study([_trial(b, s, 50.0, noise=400) for b, s in ((16, 40), (64, 20), (128, 3))])
    with pytest.raises(Untrusted, match="samples to it differ by up to"):
        plan(scattered, target=1.0)


def test_the_plot_shows_the_model_the_trials_and_the_cells():
    ms = {32: 50.0, 64: 70.0, 256: 120.0}
    trials = _study([_trial(b, _on_model(b), ms[b]) for b in ms])
    p = plan(trials, target=1.0, cells=[_cell(32), _cell(64), _cell(128), _cell(256)])
    figure = time_to_target_plot(p)
    samples, seconds = figure.axes
    assert [line.get_label() for line in samples.lines] == ["predicted", "B_crit"]
    assert samples.lines[1].get_xdata()[0] == pytest.approx(p.model.b_crit)
    labels = [c.get_label() for c in seconds.collections]
    assert labels == [
        "predicted: steps x the geometry's measured s/step",
        "fit report cells no trial trained (s/step interpolated)",
        "trials, measured", "recommended",
    ]  # fmt: skip
    cell_xy = seconds.collections[1].get_offsets()
    assert [tuple(xy) for xy in cell_xy] == [(128, pytest.approx(p.best.seconds))]
    assert {t.get_text() for t in seconds.texts} == {"32x1 fp32", "64x1 fp32", "256x1 fp32",
                                                     "128x1 fp32"}  # fmt: skip


def test_with_four_batch_sizes_one_outlier_is_left_out_and_said():
    """A batch size whose only trial took twice the model's steps (its learning rate far
    from its best) is left out of a fit over 4, which the other 3 then hold; two such
    batch sizes are no fit."""
    steps = {b: _on_model(b) for b in (16, 32, 64, 128)}
    steps[16] *= 2
    trials = _study([_trial(b, s, 50.0) for b, s in steps.items()])
    p = plan(trials, target=1.0)
    assert p.model.b_crit == pytest.approx(B_CRIT, rel=0.02)
    assert "fitted over 3 of 4 batch sizes" in p.source
    assert "16 left out as an outlier (its fewest steps 2x the fit's)" in p.source
    steps[128] *= 0.5
    with pytest.raises(Untrusted, match="misses one by|no fit"):
        plan(_study([_trial(b, s, 50.0) for b, s in steps.items()]), target=1.0)
    assert "3 of 3" not in plan(_study([_trial(b, _on_model(b), 50.0) for b in steps])).source
