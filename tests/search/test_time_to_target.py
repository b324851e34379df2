"""Time to target (search/results/time_to_target.py) and the recommendation by it
(search/results/recommend.py), on trials recorded as search/trial/ending.py records them."""

from __future__ import annotations

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from batchfit.search.core.record import Attr
from batchfit.search.core.study_config import TARGET_METRICS, RecommendRule, Target
from batchfit.search.results.plots import time_to_target_plot
from batchfit.search.results.recommend import best_document, recommend
from batchfit.search.results.summary import lr_plan
from batchfit.search.results.time_to_target import (
    Predicted,
    Untrusted,
    energy_front,
    format_joules,
    plan,
    steps_to,
    table,
)
from batchfit.tracking.metrics import (
    ENERGY_J,
    ENERGY_PER_SAMPLE,
    GRAD_NOISE_SCALE,
    MEAN_WATTS,
    STEP_MS,
    THROUGHPUT_SAMPLES,
    TO_TARGET_J,
    VAL_ACC,
)
from batchfit.train.params import LR_PARAM

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
    watts: float | None = None,
) -> FrozenTrial:
    """A completed trial whose val/loss crosses 1.0 at `steps`, timed at `step_ms` a step;
    with `watts`, its mean power over those steps (where the hardware counts energy)."""
    energy = {} if watts is None else {
        MEAN_WATTS: watts, ENERGY_PER_SAMPLE: watts * step_ms / 1000 / batch,
    }  # fmt: skip
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
        | ({GRAD_NOISE_SCALE: noise} if noise else {})
        | energy,
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
    rec = recommend(trials, RecommendRule(ACC, 0.01, SPEED), target=1.0)
    assert rec.by_time is not None and rec.trial.number == 2
    assert "predicted to reach the target soonest: 128x1 fp32, 150 steps" in rec.describe()
    # Without the prediction (one validation each: no crossing between two), the rule.
    flat = [_trial(b, _on_model(b), ms[b], acc=0.95 if b == 32 else 0.9) for b in ms]
    for t in flat:
        t.user_attrs[Attr.VAL_CURVE] = [[400, 0.5]]
    by_rule = recommend(_study(flat), RecommendRule(ACC, 0.01, SPEED), target=1.0)
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
    # The rate the run trains at, and that optimizer.lr stays as it is: "optimizer.lr scaled
    # linear from 128: 16 -> 0.00295" read as "set optimizer.lr=0.00295 at batch 16", which
    # then trained 8x too slowly (batchfit scaled it again).
    assert text.startswith(
        "Learning rate: the run trains at 0.02 at this global batch of 64: batchfit scales "
        "optimizer.lr=0.01, the rate at a global batch of 32 (trainer.lr_ref_batch_size), "
        "linear with the batch, so leave optimizer.lr as it is."
    )
    assert text.endswith("it trains at that batch's scaled rate: 32 -> 0.01, 128 -> 0.04.")
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
    """A fit report cell as the study keeps it (search/results/boundary.py fit_cells)."""
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

    rec = recommend(trials, RecommendRule(ACC, 0.01, SPEED), target=1.0, cells=cells)
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
        "Learning rate: the run trains at 0.04 at this global batch of 128: batchfit scales "
        "optimizer.lr=0.01, the rate at a global batch of 32"
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


# Energy to target: joules per step x predicted steps, where the hardware counts energy.
def _frugal_study() -> list[FrozenTrial]:
    """Four batch sizes on the model (S_min 100, B_crit 64), the 64s three times; with their
    mean watts, joules per step = watts x seconds per step:
      trial 0: 32,  80 ms, 100 W ->  8   J; 300 steps: 24 s, 2400 J
      trials 1-3: 64, 70 ms, 150 W, 130 W and none -> 10.5 and 9.1 J, median 9.8 J
                  (the one without energy counts for nothing); 200 steps: 14 s, 1960 J
      trial 4: 128, 80 ms, 250 W -> 20   J; 150 steps: 12 s, 3000 J (the fastest)
      trial 5: 256, 200 ms, 130 W -> 26  J; 125 steps: 25 s, 3250 J
    The fewest joules to the target are 64's, 2 s slower than 128's."""
    runs = [(32, 80.0, 100.0), (64, 70.0, 150.0), (64, 70.0, 130.0), (64, 70.0, None)]
    runs += [(128, 80.0, 250.0), (256, 200.0, 130.0)]
    return _study([_trial(b, _on_model(b), ms, watts=w) for b, ms, w in runs])


def test_joules_to_target_are_the_median_joules_per_step_times_the_steps():
    p = plan(_frugal_study(), target=1.0)
    by = {x.geometry: x for x in p.predicted}
    assert by["64x1 fp32"].step_j == pytest.approx(9.8)
    assert {g: x.joules for g, x in by.items()} == {
        "32x1 fp32": pytest.approx(2400, rel=0.02), "64x1 fp32": pytest.approx(1960, rel=0.02),
        "128x1 fp32": pytest.approx(3000, rel=0.02), "256x1 fp32": pytest.approx(3250, rel=0.02),
    }  # fmt: skip
    assert p.best.geometry == "128x1 fp32"  # the soonest
    assert p.least_energy.geometry == "64x1 fp32"
    assert [x.geometry for x in p.by_energy] == ["64x1 fp32", "32x1 fp32", "128x1 fp32",
                                                 "256x1 fp32"]  # fmt: skip
    header, rows = table(p)
    assert header[5:9] == ["time", "energy", "samples", "trained by"]
    # trial numbers, not counts: '#0, #4', or a cell no trial trained
    assert [row[-1] for row in rows] == ["#4", "#1, #2, #3", "#0", "#5"]
    assert [(r[0], r[6]) for r in rows] == [
        ("128x1 fp32", "3 kJ"), ("64x1 fp32", "1.96 kJ"), ("32x1 fp32", "2.4 kJ"),
        ("256x1 fp32", "3.25 kJ"),
    ]  # fmt: skip


def test_without_energy_figures_no_joules_and_no_energy_column():
    """Hardware without an energy counter: no energy/* figures, so no joules (never 0)."""
    trials = _study([_trial(b, _on_model(b), 80.0) for b in (32, 64, 128, 256)])
    p = plan(trials, target=1.0)
    assert all(x.joules is None and x.step_j is None for x in p.predicted)
    assert p.least_energy is None and p.by_energy == ()
    header, rows = table(p)
    assert "energy" not in header and all(len(r) == len(header) for r in rows)
    # preferring energy then has nothing to go by: the soonest, said as such
    rec = recommend(trials, RecommendRule(ACC, 0.01, ENERGY_J), target=1.0)
    assert rec.planned == p.best
    assert not rec.by_energy and "reach the target soonest" in rec.describe()


def test_format_joules_keeps_three_figures_under_a_thousand():
    assert [format_joules(j) for j in (0.52, 850, 999.7, 1234, 1960, 4.5e6)] == [
        "0.52 J", "850 J", "1 kJ", "1.23 kJ", "1.96 kJ", "4.5 MJ",
    ]  # fmt: skip


def _predicted(geometry: str, seconds: float, joules: float | None) -> Predicted:
    """100 steps of seconds / 100 and joules / 100 each."""
    step_j = None if joules is None else joules / 100
    return Predicted(geometry, 64, 100.0, seconds / 100, (1,), step_j=step_j)


def test_the_energy_front_is_what_no_other_beats_in_both_time_and_energy():
    """(seconds, joules): A (10, 3000), B (12, 2000), C (15, 2500): B is faster and lower;
    G (12, 2200): as fast as B and higher; D (20, 1500); E unmeasured. The front, fastest
    first: A, B, D."""
    a, b, c = _predicted("A", 10, 3000), _predicted("B", 12, 2000), _predicted("C", 15, 2500)
    g, d, e = _predicted("G", 12, 2200), _predicted("D", 20, 1500), _predicted("E", 5, None)
    assert energy_front([c, e, d, g, b, a]) == [a, b, d]
    assert energy_front([e]) == []
    twin = _predicted("B2", 12, 2000)  # equal to B on both counts: neither beats the other
    assert [p.geometry for p in energy_front([b, twin, c])] == ["B", "B2"]


@pytest.mark.parametrize("prefer", [ENERGY_PER_SAMPLE, ENERGY_J, TO_TARGET_J])
def test_preferring_energy_recommends_the_fewest_joules_to_the_target(prefer: str):
    """The same trials: by throughput (the default) 128x1, 12 s and 3000 J; by any energy
    metric 64x1, 2 s slower but 1960 J: its first trial (1), all as accurate."""
    trials = _frugal_study()
    known = {**RecommendRule().known, **TARGET_METRICS}
    fastest = recommend(trials, RecommendRule(ACC, 0.01, SPEED, known), target=1.0)
    assert fastest.trial.number == 4 and not fastest.by_energy
    assert "predicted to reach the target soonest: 128x1 fp32, 150 steps" in fastest.describe()
    assert "predicted" not in yaml.safe_load(best_document(fastest, "s", []))
    rec = recommend(trials, RecommendRule(ACC, 0.01, prefer, known), target=1.0)
    assert rec.by_energy and rec.trial.number == 1
    assert rec.planned.geometry == "64x1 fp32"
    assert rec.describe().startswith(
        "trial 1, the configuration predicted to reach the target with the fewest joules: "
        "64x1 fp32, 200 steps x 9.8 J = 1.96 kJ (14 s; the fastest, 128x1 fp32, 12 s, 3 kJ) "
        "to val/loss <= 1 (search.target)"
    )
    assert rec.describe().endswith("trials 1, 2, 3 trained it")
    body = yaml.safe_load(best_document(rec, "s", []))
    assert body["trial"] == 1 and "values" in body  # trained: its own figures stay
    assert body["predicted"]["joules_to_target"] == pytest.approx(1960, rel=0.02)
    assert body["predicted"]["seconds_to_target"] == pytest.approx(14, rel=0.02)


def _energy_cells_study(watts_256: float | None) -> list[FrozenTrial]:
    """Trials at 32, 64 and 256 (on the model) at 50, 70 and 120 ms a step and 200, 200 W
    and `watts_256`: 10, 14 and (200 W) 24 J a step."""
    runs = [(32, 50.0, 200.0), (64, 70.0, 200.0), (256, 120.0, watts_256)]
    return _study([_trial(b, _on_model(b), ms, watts=w) for b, ms, w in runs])


def test_a_cell_no_trial_trained_takes_its_familys_interpolated_joules():
    """128x1 fp32: 14 + (24 - 14)(128 - 64)/(256 - 64) = 17.33 J a step (as its seconds:
    86.7 ms), 150 steps: 2600 J, fewer than 64's 200 x 14 = 2800, 256's 125 x 24 = 3000 and
    32's 300 x 10 = 3000; 64x2 fp32 is 2 micro-steps of 64: 28 J, 150 steps, 4200 J. With
    256's energy unmeasured, 128 lies beyond the sizes with energy: its seconds are
    predicted, its joules are not."""
    cells = [_cell(32), _cell(64), _cell(128), _cell(256), _cell(64, accum=2)]
    trials = _energy_cells_study(200.0)
    p = plan(trials, target=1.0, cells=cells)
    by = {x.geometry: x for x in p.predicted}
    cell = by["128x1 fp32"]
    assert cell.trials == () and cell.step_j == pytest.approx(14 + 10 * 64 / 192)
    assert cell.joules == pytest.approx(2600, rel=0.02)
    assert by["64x2 fp32"].step_j == pytest.approx(28.0)
    assert p.least_energy is cell
    rule = RecommendRule(ACC, 0.01, ENERGY_PER_SAMPLE)
    rec = recommend(trials, rule, target=1.0, cells=cells)
    assert rec.untrained == cell and rec.by_energy
    assert rec.describe().startswith(
        "128x1 fp32, the configuration predicted to reach the target with the fewest "
        "joules: 150 steps x 17.3 J (interpolated (64, 256) from its precision's trials) = "
        "2.6 kJ (13 s) to"
    )
    predicted = yaml.safe_load(best_document(rec, "s", rec.overrides([])))["predicted"]
    assert predicted["joules_to_target"] == pytest.approx(2600, rel=0.02)
    assert predicted["joules_per_step"] == pytest.approx(17.33, rel=1e-3)

    unmeasured = plan(_energy_cells_study(None), target=1.0, cells=cells)
    by = {x.geometry: x for x in unmeasured.predicted}
    assert by["128x1 fp32"].step_s == pytest.approx(0.070 + 0.050 * 64 / 192)
    assert by["128x1 fp32"].joules is None and by["256x1 fp32"].joules is None
    assert by["64x2 fp32"].step_j == pytest.approx(28.0)
    header, rows = table(unmeasured)
    assert {r[0]: r[header.index("energy")] for r in rows}["128x1 fp32"] == "-"


def _acc_curve(steps_to_target: float, every: float) -> list:
    """val/acc rising linearly through 0.9 at `steps_to_target` (0.5 at step 0)."""
    slope = 0.4 / steps_to_target
    return [
        [s, round(0.5 + slope * s, 6)]
        for s in range(int(every), int(steps_to_target * 1.5), int(every))
    ]


def test_a_target_on_accuracy_is_read_from_the_trials_accuracy_curves():
    """search.target='val/acc>=0.9': the steps to it come from each trial's val/acc curve
    (`target_curve`), not from val/loss's, and the plan says the user's target. The loss
    curves here cross 1.0 at other steps (on the model's double), which must not be read."""
    ms = {32: 80.0, 64: 70.0, 128: 80.0, 256: 200.0}
    trials = []
    for b in ms:
        t = _trial(b, 2 * _on_model(b), ms[b])
        t.user_attrs["target_curve"] = _acc_curve(_on_model(b), every=10)
        trials.append(t)
    p = plan(_study(trials), Target(VAL_ACC, ">=", 0.9))
    assert (p.metric, p.op, p.target, p.target_source) == (VAL_ACC, ">=", 0.9, "search.target")
    assert p.model.b_crit == pytest.approx(B_CRIT, rel=0.02)
    assert p.model.s_min == pytest.approx(S_MIN, rel=0.02)
    assert p.describe().startswith("val/acc >= 0.9 (search.target): S_min")
    # Trials recorded before the accuracy curve (or of another target) cannot say.
    with pytest.raises(Untrusted, match="0 completed trial"):
        plan(_study([_trial(b, _on_model(b), ms[b]) for b in ms]), Target(VAL_ACC, ">=", 0.9))
