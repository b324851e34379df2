"""Time to target, predicted per configuration: steps a batch size needs to reach a loss,
times the seconds a step of that geometry takes.

The steps come from McCandlish et al. 2018's model (search/results/critical_batch.py): S(B) =
S_min (1 + B_crit / B) for the global batch B. Its constants come from the study's trials:
- the target is search.target where it is set (any validation metric: val/acc>=0.9 is read
  from the trials' val/acc curves), else the loss every batch size reached (the highest of
  the batch sizes' best losses);
- each trial's steps to it are read from its validation curve (the `val_curve` it
  records: optimizer step and val/loss at each validation; `target_curve`, search.target's
  metric where it is another), interpolated linearly between
  the validations around the first crossing; at each batch size the fewest steps count
  (its best learning rate);
- with 3 or more batch sizes, S_min and B_crit are fitted, and trusted when the fit is
  within FIT_TOLERANCE of every point (with 4 or more, of every point but one outlier,
  said); with 2, the line through them is trusted when the
  trials' median gradient noise scale B_simple (train/measure/noise.py; the paper's estimate of
  B_crit) is within NOISE_SPREAD of its B_crit; with 1, B_crit is B_simple itself, trusted
  when the trials' estimates agree within NOISE_SPREAD, and S_min follows from the steps.
  Only trials that logged a B_simple count (its |G|² resolved above zero over enough
  steps); the summary says how many, over how many measured steps, and how many did not.
Where neither holds, `plan` raises Untrusted saying why, and the study recommends by its
other rule.

Seconds per step are the trials' own (time/step_ms) for the geometries they trained. The
fit report's other cells that fit (search/results/boundary.py's `fit_report`, kept in the study) are
predicted too: their steps from the same model, their seconds per step from the trials
of their family (the cells alike but for batch size and accumulation: one precision,
checkpointing, sequence length, data-parallel layout). A step of micro-batch m with
accumulation a takes a t(m): t is each measured micro-batch size's median seconds per micro-
step (step_ms / a), linear between two measured sizes ("interpolated"). A cell outside the
measured sizes is not predicted (a step's fixed cost, or a device filling up, bends the
line beyond them), nor is one some trial tried that did not complete (diverged, too slow,
out of memory on the device): the trials showed it does not finish.

Energy to target, where the hardware counts energy (train/measure/energy.py), is predicted
the same way: a configuration's predicted steps times the joules of one of its steps. A
geometry trials trained takes the median over them of each trial's mean watts
(energy/mean_watts) x its own seconds per step; a fit report cell no trial trained, its
family's joules per micro-step interpolated between the measured micro-batch sizes as the
seconds are, times its accumulation. A family without energy figures predicts none (not
zero). The fastest configuration is not always the most frugal (a larger batch takes more
samples to the target, a busier device more watts), so `Plan.least_energy` and
`energy_front` give the choice by energy too; Zeus (You et al., NSDI 2023) is the tool that
optimises this energy-to-accuracy trade-off online, by batch size and power limit.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from batchfit.search.core.record import TrialRecord
from batchfit.search.core.study_config import Target
from batchfit.search.results import speed_check
from batchfit.search.results.critical_batch import NoFit, StepsModel, fit_samples, fit_steps
from batchfit.tracking.metrics import GRAD_NOISE_SCALE, GRAD_NOISE_STEPS, MEAN_WATTS, VAL_LOSS
from batchfit.train.params import ACCUM_KEY, BATCH_KEY, CHECKPOINTING_KEY, GLOBAL_PARAM

FIT_TOLERANCE = 0.25  # the fit's worst relative error in steps over its points
NOISE_SPREAD = 3.0  # the largest / smallest trial noise scale, for B_simple to be trusted
MEASURED = "measured"  # a Predicted's seconds per step: the trials' own
CELL_COLUMNS = ("fits", "peak_bytes")  # a fit report cell's figures, not its coordinates


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
    trials: tuple[int, ...]  # the trials that trained this geometry; () for a fit report cell
    step_basis: str = MEASURED  # or 'interpolated (64, 128)', 'measured (64, other accumulation)'
    # A fit report cell no trial trained: the overrides that set it (key, value), in order.
    sets: tuple[tuple[str, Any], ...] = ()
    step_j: float | None = None  # joules per optimizer step; None: no energy measured

    @property
    def seconds(self) -> float:
        return self.steps * self.step_s

    @property
    def joules(self) -> float | None:
        """Joules to the target: its predicted steps x joules per step, where measured."""
        return None if self.step_j is None else self.steps * self.step_j

    @property
    def samples(self) -> float:
        return self.steps * self.batch


@dataclass(frozen=True)
class Plan:
    target: float  # the value of `metric` to reach
    target_source: str  # where it comes from, in words
    model: StepsModel
    source: str  # how B_crit was found, in words
    noise_scale: float | None  # the trials' median B_simple
    points: tuple[Point, ...]
    predicted: tuple[Predicted, ...]  # fastest first
    # What that median rests on: the trials with an estimate, their measured steps all
    # together, and the completed trials without one (too few steps, or |G|² not resolved
    # above zero: each one's batchfit.noise_scale tag says which)
    noise_trials: int = 0
    noise_steps: int = 0
    noise_without: int = 0
    metric: str = VAL_LOSS  # search.target's metric, or val/loss
    op: str = "<="  # reached at or below (a loss) or at or above (an accuracy)

    @property
    def best(self) -> Predicted:
        return self.predicted[0]

    @property
    def error(self) -> float:
        """The prediction's own error: its model's worst relative error in steps over the
        batch sizes it was fitted to (0 where it passes through them)."""
        worst = self.model.worst_error()
        return 0.0 if math.isnan(worst) else worst

    @property
    def soonest_trained(self) -> Predicted | None:
        """The soonest configuration that trials trained (not a fit report cell)."""
        return next((p for p in self.predicted if p.trials), None)

    @property
    def by_energy(self) -> tuple[Predicted, ...]:
        """The configurations with an energy to target, the fewest joules first (ties: the
        faster first)."""
        measured = (p for p in self.predicted if p.joules is not None)
        return tuple(sorted(measured, key=lambda p: (p.joules, p.seconds)))

    @property
    def least_energy(self) -> Predicted | None:
        """The configuration predicted to reach the target with the fewest joules; None
        where no configuration has energy figures."""
        return next(iter(self.by_energy), None)

    def describe(self) -> str:
        m = self.model
        noise = f", {self.noise_basis()}" if self.noise_scale is not None else ""
        if m.unbounded:
            constants = f"E_min {m.e_min:.4g} samples, B_crit unbounded"
        else:
            constants = f"S_min {m.s_min:.3g} steps, B_crit {m.b_crit:.3g} samples"
        target = f"{self.metric} {self.op} {self.target:.4g} ({self.target_source})"
        return f"{target}: {constants} ({self.source}{noise})"

    def noise_basis(self) -> str:
        """'B_simple 46.6, the median of 3 trials' estimates over 27 measured steps; 2
        completed trials without one': the figure and what it rests on."""
        k, n = self.noise_trials, self.noise_without
        trials = f"{k} trials' estimates" if k != 1 else "1 trial's estimate"
        steps = f" over {self.noise_steps} measured steps" if self.noise_steps else ""
        without = f"; {n} completed trial{'s' if n != 1 else ''} without one" if n else ""
        return f"B_simple {self.noise_scale:.3g}, the median of {trials}{steps}{without}"


def steps_to(curve: Sequence[Sequence[float]], target: float, op: str = "<=") -> float | None:
    """Optimizer steps at which a validation curve [(step, value), ...] first reaches
    `target` (from above for `op` '<=', a loss; from below for '>=', an accuracy),
    interpolated between the validations around the crossing; None if never, or if its
    first validation already had (a run validated once, at its end, says nothing of when it
    got there)."""

    def reached(value: float) -> bool:
        return value <= target if op == "<=" else value >= target

    previous = None
    for step, loss in curve:
        if math.isfinite(loss) and reached(loss):
            if previous is None or reached(previous[1]):
                return None  # reached by its first validation: when, the curve cannot say
            (s0, l0) = previous
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        previous = (step, loss)
    return None


def format_joules(joules: float) -> str:
    """'850 J', '1.23 kJ', '4.5 MJ': three significant figures in the unit that keeps
    the number under 1000 (999.7 J is '1 kJ', not '1e+03 J')."""
    text, unit = f"{joules:.3g}", "J"
    for scale, bigger in ((1e3, "kJ"), (1e6, "MJ"), (1e9, "GJ")):
        if abs(float(text)) < 1000:
            break
        text, unit = f"{joules / scale:.3g}", bigger
    return f"{text} {unit}"


def energy_front(predicted: Sequence[Predicted]) -> list[Predicted]:
    """The configurations with an energy to target that no other beats on both counts
    (as fast or faster and as frugal or more, better in one): the Pareto front of time
    and energy to the target, fastest first."""
    measured = [p for p in predicted if p.joules is not None]

    def dominated(p: Predicted) -> bool:
        return any(
            q.seconds <= p.seconds
            and q.joules <= p.joules
            and (q.seconds, q.joules) != (p.seconds, p.joules)
            for q in measured
        )

    return sorted((p for p in measured if not dominated(p)), key=lambda p: p.seconds)


def table(plan: Plan) -> tuple[list[str], list[list[str]]]:
    """The predicted geometries, fastest first, as rows; with their energy to target
    where some configuration has one."""
    energy = any(p.joules is not None for p in plan.predicted)
    header = [
        "configuration", "global batch", "steps", "s/step", "s/step from", "time",
        *(["energy"] if energy else []), "samples", "trained by",
    ]  # fmt: skip
    rows = [
        [
            p.geometry,
            str(p.batch),
            f"{p.steps:.0f}",
            f"{p.step_s:.3g}",
            p.step_basis,
            f"{p.seconds:.3g} s",
            *([format_joules(p.joules) if p.joules is not None else "-"] if energy else []),
            f"{p.samples:.0f}",
            ", ".join(f"#{n}" for n in p.trials) or "none: predicted",
        ]
        for p in plan.predicted
    ]
    return header, rows


def _batch(record: TrialRecord) -> int | None:
    """The global batch a trial trained with."""
    batch = record.run.get(GLOBAL_PARAM) or record.effective_batch_size
    return int(batch) if batch else None


def _target(records: Sequence[TrialRecord], target: float | None) -> tuple[float, str]:
    """search.target's value, or the loss every batch size reached: the highest of the
    batch sizes' best losses (each batch size's best trial then gives the model a point)."""
    if target is not None:
        return target, "search.target"
    bests: dict[int, float] = {}
    for record in records:
        batch = _batch(record)
        if batch:
            best = min(loss for _, loss in record.outcome.val_curve)
            bests[batch] = min(bests.get(batch, math.inf), best)
    if not bests:
        raise Untrusted("no trial recorded the batch size it trained with")
    return max(bests.values()), "the loss every batch size reached"


def plan(
    trials: Sequence[FrozenTrial],
    target: Target | float | None = None,
    cells: Sequence[Mapping[str, Any]] = (),
) -> Plan:
    """Predicted time to `target` (search.target: a val/loss as a number, or any validation
    metric's Target, read from the trials' curves of it; None: the loss every batch size
    reached) for each geometry the completed trials trained and each fit report cell that
    fits (`cells`, the study's `fit_report`); raises Untrusted when the trials do not
    support a prediction."""
    if isinstance(target, Target):
        metric, op, value = target.metric, target.op, target.value
    else:
        metric, op, value = VAL_LOSS, "<=", target

    def curve(record: TrialRecord) -> list | None:
        outcome = record.outcome
        return outcome.val_curve if metric == VAL_LOSS else outcome.target_curve

    done = [
        (t, record)
        for t in trials
        if t.state == TrialState.COMPLETE
        and not (record := TrialRecord.of(t)).is_repeat
        and curve(record)
    ]
    if len(done) < 2:
        raise Untrusted(f"{len(done)} completed trial(s) with a validation curve: 2 or more needed")
    loss, target_source = _target([record for _, record in done], value)
    points = []
    for t, record in done:
        steps = steps_to(curve(record), loss, op)
        batch = _batch(record)
        if steps is None or not batch or not record.outcome.step_ms:
            continue
        label = speed_check.label(speed_check.geometry(t))
        points.append(Point(t.number, label, batch, steps, record.outcome.step_ms / 1000))
    if len(points) < 2:
        raise Untrusted(
            f"{len(points)} trial(s) crossed {metric} {loss:.4g} between two validations: 2 or "
            "more needed (validate more often: trainer.val_every_steps, or search.target)"
        )
    best_steps: dict[int, float] = {}
    for p in points:
        best_steps[p.batch] = min(best_steps.get(p.batch, math.inf), p.steps)
    # (a negative reading, its variance estimate below zero, says nothing of B_crit)
    measured = [r.outcome for _, r in done if (r.outcome.figure(GRAD_NOISE_SCALE) or 0) > 0]
    noises = [o.figure(GRAD_NOISE_SCALE) for o in measured]
    noise = statistics.median(noises) if noises else None
    noise_steps = sum(int(o.figure(GRAD_NOISE_STEPS) or 0) for o in measured)
    model, source = _model(best_steps, noises, noise)
    keys = _family_keys(cells)
    trained = _trained(trials, keys)
    predicted = [
        Predicted(
            g.label,
            g.batch,
            model.steps(g.batch),
            statistics.median(g.step_s),
            tuple(g.trials),
            step_j=statistics.median(g.step_j) if g.step_j else None,
        )
        for g in trained.values()
        if g.complete
    ]
    predicted += _cells(model, cells, keys, trained)
    if model.unbounded:  # how far above the batches B_crit lies, they cannot say
        predicted = [p for p in predicted if p.batch <= max(best_steps)]
    predicted.sort(key=lambda p: p.seconds)
    return Plan(
        loss, target_source, model, source, noise, tuple(points), tuple(predicted),
        len(noises), noise_steps, len(done) - len(noises), metric, op,
    )  # fmt: skip


@dataclass
class _Trained:
    """A geometry trials trained: its label, global batch, their seconds per step."""

    label: str
    family: tuple[str, ...]  # the fit report cell's coordinates but batch size and accumulation
    micro: int
    accum: int
    batch: int
    geometry: speed_check.Geometry
    step_s: list[float]
    trials: list[int]  # its complete trials
    complete: bool = False  # one of them has its seconds per step
    step_j: list[float] = field(default_factory=list)  # their joules per step, where measured


def _family_keys(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """The cells' coordinates but batch size and accumulation: what a family shares."""
    keys = {k for cell in cells for k in cell} - {BATCH_KEY, ACCUM_KEY, *CELL_COLUMNS}
    return sorted(keys)


def _trained(trials: Sequence[FrozenTrial], keys: Sequence[str]) -> dict[str, _Trained]:
    """The geometries the finished trials tried, by label: their measured seconds per step
    and whether one completed (one that did not: diverged, too slow, out of memory)."""
    found: dict[str, _Trained] = {}
    for t in trials:
        record = TrialRecord.of(t)
        values = {**record.params, **record.run}
        values.setdefault(CHECKPOINTING_KEY, "none")
        batch = _batch(record)
        if not record.is_finished or record.is_repeat or not batch or BATCH_KEY not in values:
            continue
        micro, accum = int(values[BATCH_KEY]), int(values.get(ACCUM_KEY) or 1)
        family = tuple(str(values.get(k)) for k in keys)
        geometry = speed_check.geometry(t)
        label = speed_check.label(geometry)
        g = found.setdefault(label, _Trained(label, family, micro, accum, batch, geometry, [], []))
        if t.state == TrialState.COMPLETE:
            g.trials.append(t.number)  # those that support it: complete
        step_ms = record.outcome.step_ms
        if step_ms:
            g.step_s.append(step_ms / 1000)
            watts = record.outcome.figure(MEAN_WATTS)
            if watts is not None:  # the same timed steps: watts x seconds a step
                g.step_j.append(watts * step_ms / 1000)
        g.complete |= t.state == TrialState.COMPLETE and bool(step_ms)
    return found


def _cells(
    model: StepsModel,
    cells: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    trained: Mapping[str, _Trained],
) -> list[Predicted]:
    """The fitting cells no trial trained, with their seconds (and joules, where measured)
    per step from their family's trials (`t`, the module's docstring); a family no trial
    timed is left out. `keys`: a family's coordinates (`_family_keys`)."""
    timed = [g for g in trained.values() if g.step_s]
    tried = {(g.family, g.micro, g.accum) for g in trained.values()}
    out = []
    for cell in cells:
        micro, accum = int(cell[BATCH_KEY]), int(cell[ACCUM_KEY])
        family = tuple(str(cell.get(k)) for k in keys)
        kin = [g for g in timed if g.family == family]
        if not cell["fits"] or (family, micro, accum) in tried or not kin:
            continue
        step = _per_micro_step(kin, micro, lambda g: g.step_s)
        if step is None:
            continue
        micro_s, basis = step
        energy = _per_micro_step(kin, micro, lambda g: g.step_j)
        step_j = accum * energy[0] if energy is not None else None
        ranks = round(statistics.median(g.batch / (g.micro * g.accum) for g in kin))
        like = kin[0].geometry
        swapped = {BATCH_KEY: micro, ACCUM_KEY: accum}
        label = speed_check.label(tuple((k, swapped.get(k, v)) for k, v in like))
        batch = micro * accum * ranks
        sets = tuple((k, cell[k]) for k in cell if k not in CELL_COLUMNS)
        out.append(
            Predicted(label, batch, model.steps(batch), accum * micro_s, (), basis, sets, step_j)
        )
    return out


def _per_micro_step(
    kin: Sequence[_Trained], micro: int, per_step: Callable[[_Trained], Sequence[float]]
) -> tuple[float, str] | None:
    """A figure per micro-step of `micro` samples (`per_step`: a geometry's measured figures
    per optimizer step, its seconds or its joules), from the geometries of its family, and
    what it rests on ('interpolated (32, 64)': the measured sizes around it); None outside
    the measured sizes: how a step's cost grows beyond them (a fixed cost a step dominating
    small batches, the device filling up for large ones) the trials do not say."""
    per_size: dict[int, list[float]] = {}
    for g in kin:
        if per_step(g):
            per_size.setdefault(g.micro, []).extend(s / g.accum for s in per_step(g))
    t = {m: statistics.median(times) for m, times in per_size.items()}
    if micro in t:
        return t[micro], f"{MEASURED} ({micro}, other accumulation)"
    below = [m for m in t if m < micro]
    above = [m for m in t if m > micro]
    if not below or not above:
        return None
    lo, hi = max(below), min(above)
    return t[lo] + (t[hi] - t[lo]) * (micro - lo) / (hi - lo), f"interpolated ({lo}, {hi})"


def _below_critical(
    best_steps: dict[int, float], noise: float | None, why: NoFit
) -> tuple[StepsModel, str]:
    """Steps fell as 1/B or faster: every batch size below B_crit, the model's limit
    S = E_min / B (search/results/critical_batch.py fit_samples), trusted when the batch sizes'
    samples to the target agree within FIT_TOLERANCE and the trials' noise scale, where
    measured, does not put B_crit below them (B_simple at least the largest batch over
    NOISE_SPREAD); with 2 batch sizes, only with that noise scale."""
    batches = sorted(best_steps)
    limit = fit_samples(batches, [best_steps[b] for b in batches])
    if limit.worst_error() > FIT_TOLERANCE:
        raise Untrusted(
            f"no fit: {why}; and the samples to it differ by up to {limit.worst_error():.0%} "
            f"across the batch sizes (more than {FIT_TOLERANCE:.0%})"
        )
    if noise is None and len(batches) < 3:
        raise Untrusted(
            "2 batch sizes took the same samples to it (steps fell as 1/B), and no noise "
            "scale measured to confirm that both are below B_crit"
        )
    if noise is not None and noise < batches[-1] / NOISE_SPREAD:
        raise Untrusted(
            f"steps fell as 1/B up to a batch of {batches[-1]}, yet the trials' noise scale "
            f"{noise:.3g} puts B_crit below it: the trials disagree"
        )
    return limit, (
        f"steps fell as 1/B over {len(batches)} batch sizes, the same samples to it within "
        f"{limit.worst_error():.0%}: every one below B_crit, which is above {batches[-1]}, "
        "by how much they cannot say"
    )


def _without_one(best_steps: dict[int, float]) -> tuple[StepsModel, str] | None:
    """With 4 or more batch sizes, one may be an outlier (its only trial's learning rate
    far from its best, a loss spike): the fit over the others, trusted when it holds
    within FIT_TOLERANCE at each of them, the best such; the one left out is said with how
    far it is from the fit. None where no one batch size explains the miss."""
    found = []
    for out in best_steps:
        rest = {b: s for b, s in best_steps.items() if b != out}
        try:
            fitted = fit_steps(sorted(rest), [rest[b] for b in sorted(rest)])
        except NoFit:
            continue
        if fitted.worst_error() <= FIT_TOLERANCE:
            found.append((fitted.worst_error(), out, fitted))
    if not found:
        return None
    _, out, fitted = min(found)
    off = best_steps[out] / fitted.steps(out)
    return fitted, (
        f"fitted over {len(best_steps) - 1} of {len(best_steps)} batch sizes, within "
        f"{fitted.worst_error():.0%}; {out} left out as an outlier (its fewest steps "
        f"{off:.2g}x the fit's)"
    )


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
            if not error.below_critical:
                raise Untrusted(f"no fit: {error}") from None
            return _below_critical(best_steps, noise, error)
        if len(batches) >= 3:
            if fitted.worst_error() <= FIT_TOLERANCE:
                return fitted, f"fitted over {len(batches)} batch sizes"
            robust = _without_one(best_steps) if len(batches) >= 4 else None
            if robust is not None:
                return robust
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
