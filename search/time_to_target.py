"""Time to target, predicted per configuration: steps a batch size needs to reach a loss,
times the seconds a step of that geometry takes.

The steps come from McCandlish et al. 2018's model (search/critical_batch.py): S(B) =
S_min (1 + B_crit / B) for the global batch B. Its constants come from the study's trials:
- the target is search.target's val/loss where it has one, else the loss every batch
  size reached (the highest of the batch sizes' best losses);
- each trial's steps to it are read from its validation curve (the `val_curve` it
  records: optimizer step and val/loss at each validation), interpolated linearly between
  the validations around the first crossing; at each batch size the fewest steps count
  (its best learning rate);
- with 3 or more batch sizes, S_min and B_crit are fitted, and trusted when the fit is
  within FIT_TOLERANCE of every point; with 2, the line through them is trusted when the
  trials' median gradient noise scale B_simple (train/noise.py; the paper's estimate of
  B_crit) is within NOISE_SPREAD of its B_crit; with 1, B_crit is B_simple itself, trusted
  when the trials' estimates agree within NOISE_SPREAD, and S_min follows from the steps.
Where neither holds, `plan` raises Untrusted saying why, and the study recommends by its
other rule.

Seconds per step are the trials' own (time/step_ms) for the geometries they trained.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from optuna.trial import FrozenTrial, TrialState

from search import speed
from search.critical_batch import NoFit, StepsModel, fit_steps
from search.record import TrialRecord
from train.params import GLOBAL_PARAM

FIT_TOLERANCE = 0.25  # the fit's worst relative error in steps over its points
NOISE_SPREAD = 3.0  # the largest / smallest trial noise scale, for B_simple to be trusted
NOISE_METRIC = "stats/grad_noise_scale"
LOSS = "val/loss"


class Untrusted(ValueError):
    """The trials do not support a prediction; the message says why."""


@dataclass(frozen=True)
class Point:
    """One trial's measurement: its global batch, steps to the target, seconds per step."""

    trial: int
    geometry: str  # '64x1 fp32'
    batch: int
    steps: float
    step_s: float


@dataclass(frozen=True)
class Predicted:
    """A geometry's predicted steps and time to the target, and the trials behind it."""

    geometry: str
    batch: int
    steps: float
    step_s: float
    trials: tuple[int, ...]  # the trials that trained this geometry

    @property
    def seconds(self) -> float:
        return self.steps * self.step_s

    @property
    def samples(self) -> float:
        return self.steps * self.batch


@dataclass(frozen=True)
class Plan:
    target: float  # the val/loss to reach
    target_source: str  # where it comes from, in words
    model: StepsModel
    source: str  # how B_crit was found, in words
    noise_scale: float | None  # the trials' median B_simple
    points: tuple[Point, ...]
    predicted: tuple[Predicted, ...]  # fastest first

    @property
    def best(self) -> Predicted:
        return self.predicted[0]

    def describe(self) -> str:
        m = self.model
        noise = f", B_simple {self.noise_scale:.3g}" if self.noise_scale is not None else ""
        return (
            f"val/loss <= {self.target:.4g} ({self.target_source}): S_min {m.s_min:.3g} steps, "
            f"B_crit {m.b_crit:.3g} samples ({self.source}{noise})"
        )


def steps_to(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """Optimizer steps at which a validation curve [(step, val/loss), ...] first reaches
    `target`, interpolated between the validations around the crossing; None if never, or
    if its first validation already had (a run validated once, at its end, says nothing of
    when it got there)."""
    previous = None
    for step, loss in curve:
        if math.isfinite(loss) and loss <= target:
            if previous is None or not previous[1] > target:
                return None  # reached by its first validation: when, the curve cannot say
            (s0, l0) = previous
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        previous = (step, loss)
    return None


def table(plan: Plan) -> tuple[list[str], list[list[str]]]:
    """The predicted geometries, fastest first, as rows."""
    header = ["configuration", "global batch", "steps", "s/step", "time", "samples", "trials"]
    rows = [
        [
            p.geometry,
            str(p.batch),
            f"{p.steps:.0f}",
            f"{p.step_s:.3g}",
            f"{p.seconds:.3g} s",
            f"{p.samples:.0f}",
            ", ".join(map(str, p.trials)),
        ]
        for p in plan.predicted
    ]
    return header, rows


def _batch(record: TrialRecord) -> int | None:
    """The global batch a trial trained with."""
    batch = record.run.get(GLOBAL_PARAM) or record.effective_batch_size
    return int(batch) if batch else None


def _target(records: Sequence[TrialRecord], target: float | None) -> tuple[float, str]:
    """search.target's val/loss, or the loss every batch size reached: the highest of the
    batch sizes' best losses (each batch size's best trial then gives the model a point)."""
    if target is not None:
        return target, "search.target"
    bests: dict[int, float] = {}
    for record in records:
        batch = _batch(record)
        if batch:
            best = min(loss for _, loss in record.val_curve)
            bests[batch] = min(bests.get(batch, math.inf), best)
    if not bests:
        raise Untrusted("no trial recorded the batch size it trained with")
    return max(bests.values()), "the loss every batch size reached"


def plan(trials: Sequence[FrozenTrial], target: float | None = None) -> Plan:
    """Predicted time to `target` (search.target's val/loss, or None) for each geometry
    the completed trials trained; raises Untrusted when they do not support one."""
    done = [
        (t, record)
        for t in trials
        if t.state == TrialState.COMPLETE
        and not (record := TrialRecord.of(t)).is_repeat
        and record.val_curve
    ]
    if len(done) < 2:
        raise Untrusted(f"{len(done)} completed trial(s) with a validation curve: 2 or more needed")
    loss, target_source = _target([record for _, record in done], target)
    points = []
    for t, record in done:
        steps = steps_to(record.val_curve, loss)
        batch = _batch(record)
        if steps is None or not batch or not record.step_ms:
            continue
        label = speed.label(speed.geometry(t))
        points.append(Point(t.number, label, batch, steps, record.step_ms / 1000))
    if len(points) < 2:
        raise Untrusted(
            f"{len(points)} trial(s) crossed val/loss {loss:.4g} between two validations: 2 or "
            "more needed (validate more often: trainer.val_every_steps, or search.target)"
        )
    best_steps: dict[int, float] = {}
    for p in points:
        best_steps[p.batch] = min(best_steps.get(p.batch, math.inf), p.steps)
    # (a negative reading, its variance estimate below zero, says nothing of B_crit)
    noises = [v for _, r in done if (v := r.figure(NOISE_METRIC)) is not None and v > 0]
    noise = statistics.median(noises) if noises else None
    model, source = _model(best_steps, noises, noise)
    by_geometry: dict[str, list[Point]] = {}
    for p in points:
        by_geometry.setdefault(p.geometry, []).append(p)
    predicted = [
        Predicted(
            geometry,
            group[0].batch,
            model.steps(group[0].batch),
            statistics.median(p.step_s for p in group),
            tuple(sorted(p.trial for p in group)),
        )
        for geometry, group in by_geometry.items()
    ]
    predicted.sort(key=lambda p: p.seconds)
    return Plan(loss, target_source, model, source, noise, tuple(points), tuple(predicted))


def _model(
    best_steps: dict[int, float], noises: list[float], noise: float | None
) -> tuple[StepsModel, str]:
    """S_min and B_crit: fitted over 3+ batch sizes when the fit holds; over 2 when the
    noise scale confirms it; from one batch size and a stable noise scale."""
    batches = sorted(best_steps)
    if len(batches) >= 2:
        try:
            fitted = fit_steps(batches, [best_steps[b] for b in batches])
        except NoFit as error:
            raise Untrusted(f"no fit: {error}") from None
        if len(batches) >= 3:
            if fitted.worst_error() <= FIT_TOLERANCE:
                return fitted, f"fitted over {len(batches)} batch sizes"
            raise Untrusted(
                f"the fit over {len(batches)} batch sizes misses one by "
                f"{fitted.worst_error():.0%} (more than {FIT_TOLERANCE:.0%})"
            )
        # Two batch sizes determine the line exactly: trusted when the trials' noise scale,
        # an independent estimate of B_crit, agrees with it (bench/noise_scale.py's 3x).
        if noise is None:
            raise Untrusted("2 batch sizes, and no noise scale measured to confirm their fit")
        ratio = noise / fitted.b_crit
        if not 1 / NOISE_SPREAD <= ratio <= NOISE_SPREAD:
            raise Untrusted(
                f"2 batch sizes give B_crit {fitted.b_crit:.3g}, and the trials' noise scale "
                f"{noise:.3g} is not within {NOISE_SPREAD:g}x of it"
            )
        return fitted, f"fitted on 2 batch sizes, B_simple within {NOISE_SPREAD:g}x of it"
    if noise is None:
        raise Untrusted("1 batch size reached it, and no trial measured its noise scale")
    spread = max(noises) / min(noises) if min(noises) > 0 else math.inf
    if spread > NOISE_SPREAD:
        raise Untrusted(
            f"1 batch size reached it, and the trials' noise scales differ {spread:.1f}x "
            f"(more than {NOISE_SPREAD:g}x): too unstable to stand for B_crit"
        )
    s_min = statistics.median(s / (1 + noise / b) for b, s in best_steps.items())
    model = StepsModel(s_min, noise, tuple((float(b), s) for b, s in best_steps.items()))
    return model, "B_crit taken as the trials' median noise scale (1 batch size reached it)"
