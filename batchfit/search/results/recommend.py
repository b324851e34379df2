"""What the study recommends, and the file that trains it again.

A study with several objectives has a front, not a winner; the user still asks "what should
I use?". The rule (`search.recommend`): among the completed trials whose `metric` is within
`tolerance` of its best value (relative: 0.01 is 1%), the one best in `prefer`. The default is
the fastest configuration within 1% of the best val accuracy.

Where the trials support a prediction of the time to a target (search/results/time_to_target.py),
the configuration predicted to reach it soonest is recommended instead; with an energy
metric to prefer (`prefer=energy/...`, e.g. energy/to_target_j or energy/joules_per_sample)
and energy measured, the one predicted to reach it with the fewest joules.

The answer is written as `best.yaml` (the trial's overrides, config search path included) to
the Hydra output directory and to the study's parent MLflow run, and

    python -m train +best=path/to/best.yaml

trains it again (train/__main__.py composes the file's overrides, then the command line's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from optuna.trial import FrozenTrial, TrialState

from batchfit.common.overrides import BEST_KEY, override_key
from batchfit.search.core.record import TrialRecord, figure_text
from batchfit.search.core.study_config import RecommendRule, Target
from batchfit.search.results import speed_check, time_to_target
from batchfit.search.sampling.space import override_value
from batchfit.tracking.metrics import ENERGY_PREFIX
from batchfit.train.launch.speed_probe import Speed


def metric_value(trial: FrozenTrial, name: str) -> float | None:
    """A completed trial's figure by metric name (search/core/record.py)."""
    return TrialRecord.of(trial).outcome.figure(name)


def within(rule: RecommendRule, value: float, best: float) -> bool:
    """Whether `value` of the rule's metric is within its tolerance of `best`."""
    slack = abs(best) * rule.tolerance
    if rule.known[rule.metric] == "maximize":
        return value >= best - slack
    return value <= best + slack


@dataclass(frozen=True)
class SpeedVerdict:
    """How the recommended geometry compares with the runner-up in the speed check."""

    chosen: str  # the recommended trial's geometry ('64x1 fp32')
    speed: Speed
    runner_up: str
    runner_up_speed: Speed
    unit: str  # samples or tokens
    faster: bool  # chosen for its speed: faster in every round than the most accurate's

    @property
    def ratio(self) -> float:
        return self.speed.median(self.unit) / self.runner_up_speed.median(self.unit)

    @property
    def beyond_noise(self) -> bool:
        return self.speed.beats(self.runner_up_speed, self.unit)

    def describe(self) -> str:
        """What the check measured, in the words of what it decided: the chosen is faster
        than the runner-up in every round, or the two are within the measured spread (the
        faster by the median named first, so that '0.67x' never reads as a verdict)."""
        unit, spread = self.unit, self.spread
        chosen = f"{self.chosen} {speed_check.describe(self.speed, unit)}"
        if self.beyond_noise:
            return (
                f"speed check: {chosen}, {self.ratio:.2f}x the runner-up {self.runner_up} "
                f"({self.runner_up_speed.median(unit):.0f} {unit}/s), faster in every "
                f"round: beyond the measured spread ({spread:.0%})"
            )
        if self.ratio < 1:  # the runner-up's median is higher, its rounds overlapping
            return (
                f"speed check: {self.runner_up}'s median, "
                f"{speed_check.describe(self.runner_up_speed, unit)}, is {1 / self.ratio:.2f}x "
                f"{self.chosen}'s, {speed_check.describe(self.speed, unit)}, but it was not "
                f"faster in every round: within the measured spread ({spread:.0%})"
            )
        return (
            f"speed check: {chosen}, {self.ratio:.2f}x the runner-up {self.runner_up} "
            f"({self.runner_up_speed.median(unit):.0f} {unit}/s), not in every round: within "
            f"the measured spread ({spread:.0%})"
        )

    @property
    def spread(self) -> float:
        return max(self.speed.spread(self.unit), self.runner_up_speed.spread(self.unit))


@dataclass(frozen=True)
class Recommendation:
    trial: FrozenTrial
    rule: RecommendRule
    best_value: float  # the best `rule.metric` of the study
    num_candidates: int  # trials within the tolerance (with a `prefer` value)
    value: float  # the trial's `rule.metric`
    preferred: float | None  # the trial's `rule.prefer` (None: no trial within had one)
    verdict: SpeedVerdict | None = None  # chosen by the speed check, against the runner-up
    # Chosen by the predicted time to target (search/results/time_to_target.py), when the trials
    # support a prediction; else why they do not (`by_time_note`), and the rule decided.
    by_time: time_to_target.Plan | None = None
    by_time_note: str | None = None

    @property
    def by_energy(self) -> bool:
        """Chosen from the plan by its fewest joules to the target (an energy `prefer`)."""
        plan = self.by_time
        return plan is not None and prefers_energy(self.rule) and plan.least_energy is not None

    @property
    def planned(self) -> time_to_target.Predicted | None:
        """The configuration of the time-to-target plan recommended, when there is one."""
        return planned(self.by_time, self.rule) if self.by_time is not None else None

    @property
    def untrained(self) -> time_to_target.Predicted | None:
        """The fit report cell recommended, when no trial trained it: `trial` then gives
        the rest of its configuration (the learning rate at the reference batch)."""
        chosen = self.planned
        return chosen if chosen is not None and not chosen.trials else None

    def overrides(self, trial_overrides: Sequence[str]) -> list[str]:
        """What trains the recommended configuration: the trial's overrides, with the
        untrained cell's batch size, accumulation and the rest set over them."""
        cell = self.untrained
        if cell is None:
            return list(trial_overrides)
        sets = dict(cell.sets)
        kept = [o for o in trial_overrides if override_key(o) not in sets]
        return kept + [f"{k}={override_value(v)}" for k, v in sets.items()]

    def describe(self) -> str:
        rule, n = self.rule, self.trial.number
        cell = self.untrained
        if cell is not None:
            assert self.by_time is not None
            basis = f" ({cell.step_basis} from its precision's trials)"
            return (
                f"{cell.geometry}, the configuration predicted to reach the target "
                f"{self._how(cell, basis)} to {self.by_time.describe()}; no trial trained "
                f"it: the fit report predicts it fits, and its learning rate is trial {n}'s "
                "(the nearest batch that reached the target), scaled by the study's rule"
                + ("" if self.by_energy else _against_measured(self.by_time, cell))
            )
        chosen = self.planned
        if chosen is not None:
            assert self.by_time is not None
            return (
                f"trial {n}, the configuration predicted to reach the target "
                f"{self._how(chosen, name=f'{chosen.geometry}, ')} to {self.by_time.describe()}; "
                f"{'trials' if len(chosen.trials) > 1 else 'trial'} "
                f"{', '.join(map(str, chosen.trials))} trained it"
                + ("" if self.by_energy else _against_measured(self.by_time, chosen))
            )
        if rule.metric == rule.prefer or not rule.tolerance or self.preferred is None:
            return f"trial {n}, the best {rule.metric} ({figure_text(self.value)})"
        among = f"{self.num_candidates} trial" + ("s" if self.num_candidates > 1 else "")
        whose = (
            f"among the {among} whose {rule.metric} is within {rule.tolerance:.0%} of the best "
            f"({figure_text(self.best_value)}; this one {figure_text(self.value)})"
        )
        if self.verdict is None:
            best = "lowest" if prefers_energy(rule) else "best"
            return f"trial {n}, the {best} {rule.prefer} ({figure_text(self.preferred)}) {whose}"
        if self.verdict.faster:
            return f"trial {n}, the fastest configuration {whose}; {self.verdict.describe()}"
        if self.verdict.beyond_noise:  # the most accurate is the fastest too
            return (
                f"trial {n}, the most accurate {whose}, and the fastest of them in every round; "
                f"{self.verdict.describe()}"
            )
        return (
            f"trial {n}, the most accurate {whose}: no other configuration among them was "
            f"faster in every round; {self.verdict.describe()}"
        )

    def _how(self, p: time_to_target.Predicted, basis: str = "", name: str = "") -> str:
        """'soonest: 150 steps x 0.08 s = 12 s', or by energy 'with the fewest joules:
        200 steps x 9.8 J = 1.96 kJ (14 s; the fastest, ... )'; `basis`: where its seconds
        per step come from, `name`: its geometry, said before the figures."""
        steps = f"{p.steps:.0f} steps"
        if not self.by_energy:
            return f"soonest: {name}{steps} x {p.step_s:.3g} s{basis} = {p.seconds:.3g} s"
        assert self.by_time is not None and p.joules is not None and p.step_j is not None
        fastest = self.by_time.best
        than = ""
        if fastest != p:
            spent = (
                f", {time_to_target.format_joules(fastest.joules)}"
                if fastest.joules is not None
                else ", its energy not measured"
            )
            than = f"; the fastest, {fastest.geometry}, {fastest.seconds:.3g} s{spent}"
        return (
            f"with the fewest joules: {name}{steps} x {p.step_j:.3g} J{basis} = "
            f"{time_to_target.format_joules(p.joules)} ({p.seconds:.3g} s{than})"
        )


def prefers_energy(rule: RecommendRule) -> bool:
    """Whether the rule prefers an energy metric (energy/joules_per_sample, ...)."""
    return rule.prefer.startswith(ENERGY_PREFIX)


def planned(plan: time_to_target.Plan, rule: RecommendRule) -> time_to_target.Predicted:
    """The plan's configuration the rule recommends: the one predicted to reach the target
    with the fewest joules when the rule prefers energy and some configuration has its
    energy measured, else the one predicted to reach it soonest, unless no trial trained
    that one and a configuration trials trained is predicted within the prediction's own
    error of it (`measured_instead`): what was measured, then."""
    least = plan.least_energy if prefers_energy(rule) else None
    if least is not None:
        return least
    return measured_instead(plan) or plan.best


def measured_instead(plan: time_to_target.Plan) -> time_to_target.Predicted | None:
    """The soonest configuration trials trained, where the soonest predicted is a fit
    report cell no trial trained and the trained one is within the prediction's error of
    it: the two cannot be told apart, and one of them was measured."""
    best, trained = plan.best, plan.soonest_trained
    if best.trials or trained is None:
        return None
    return trained if trained.seconds <= best.seconds * (1 + plan.error) else None


def _against_measured(plan: time_to_target.Plan, chosen: time_to_target.Predicted) -> str:
    """Why the soonest predicted configuration was or was not recommended over what trials
    measured, where one is a fit report cell and the other was trained; '' otherwise."""
    best, trained, error = plan.best, plan.soonest_trained, f"{plan.error:.0%}"
    if trained is None or best.trials:
        return ""
    sooner = 1 - best.seconds / trained.seconds
    if chosen is trained:
        return (
            f"; {best.geometry}, which no trial trained, is predicted at {best.seconds:.3g} s, "
            f"{sooner:.0%} sooner: within the prediction's own error ({error}), so the "
            "configuration trials measured is preferred"
        )
    return (
        f"; {best.seconds:.3g} s is {sooner:.0%} sooner than {trained.geometry} "
        f"({trained.seconds:.3g} s), the soonest configuration trials trained: beyond the "
        f"prediction's own error ({error})"
    )


Scored = tuple[FrozenTrial, float, float | None]  # a trial, its `metric`, its `prefer`


def candidates(
    trials: Sequence[FrozenTrial], rule: RecommendRule
) -> tuple[Scored | None, list[Scored]]:
    """The completed trial best in `metric`, and the completed trials within the tolerance
    of it that have a `prefer` value."""
    scored = [
        (t, metric_value(t, rule.metric), metric_value(t, rule.prefer))
        for t in trials
        if t.state == TrialState.COMPLETE and not TrialRecord.of(t).is_repeat
    ]
    scored = [(t, m, p) for t, m, p in scored if m is not None]
    if not scored:
        return None, []
    top = scored[0]
    for candidate in scored[1:]:
        if rule.better(rule.metric, candidate[1], top[1]):
            top = candidate
    return top, [s for s in scored if s[2] is not None and within(rule, s[1], top[1])]


def _best_of(rule: RecommendRule, scored: Sequence[Scored], by: str) -> Scored:
    """The best of `scored` by `by` (metric or prefer), ties going to the better other one."""
    first, second = (1, 2) if by == "metric" else (2, 1)
    names = {1: rule.metric, 2: rule.prefer}
    chosen = scored[0]
    for candidate in scored[1:]:
        if rule.better(names[first], candidate[first], chosen[first]) or (
            candidate[first] == chosen[first]
            and rule.better(names[second], candidate[second], chosen[second])
        ):
            chosen = candidate
    return chosen


def _by_speed_check(
    rule: RecommendRule, within_tolerance: list[Scored], speeds: Mapping[str, Speed]
) -> tuple[Scored, SpeedVerdict] | None:
    """The most accurate candidate, unless a geometry the speed check timed is faster than
    its geometry in every round: then the most accurate trial of the fastest such one."""
    unit = speed_check.unit_of(rule.prefer)
    if unit is None:  # not a throughput (energy/*, memory/*): nothing the check timed
        return None
    groups: dict[str, list[Scored]] = {}
    for s in within_tolerance:
        groups.setdefault(speed_check.label(speed_check.geometry(s[0])), []).append(s)
    timed = {name: speeds[name] for name in groups if name in speeds}
    anchor = speed_check.label(speed_check.geometry(_best_of(rule, within_tolerance, "metric")[0]))
    if len(timed) < 2 or anchor not in timed:
        return None
    faster = [name for name in timed if timed[name].beats(timed[anchor], unit)]
    chosen = max(faster, key=lambda name: timed[name].median(unit)) if faster else anchor
    runner_up = max((n for n in timed if n != chosen), key=lambda n: timed[n].median(unit))
    verdict = SpeedVerdict(
        chosen, timed[chosen], runner_up, timed[runner_up], unit, faster=chosen != anchor
    )
    return _best_of(rule, groups[chosen], "metric"), verdict


def recommend(
    trials: Sequence[FrozenTrial],
    rule: RecommendRule,
    speeds: Mapping[str, Speed] | None = None,
    target: Target | float | None = None,
    cells: Sequence[Mapping[str, Any]] = (),
) -> Recommendation | None:
    """By the predicted time to target (`by_time`) where the trials support a prediction
    (to search.target, `target`: a Target or a val/loss; or the loss every batch size reached),
    over the trained geometries and the fit report's fitting `cells`: the soonest, or with
    an energy `prefer` the fewest joules (`planned`); else by the rule (`by_rule`), saying
    why not. A cell no trial trained takes the rest of its configuration from the trial
    that reached the target at the batch nearest its own."""
    rec = by_rule(trials, rule, speeds)
    if rec is None:
        return None
    try:
        plan = time_to_target.plan(trials, target, cells)
    except time_to_target.Untrusted as why:
        return replace(rec, by_time_note=f"time to target not predicted: {why}")
    best = planned(plan, rule)
    if not best.trials:  # a cell: the crossing trial of the nearest batch, fewest steps first
        nearest = min(plan.points, key=lambda p: (abs(math.log(p.batch / best.batch)), p.steps))
        template = next(t for t in trials if t.number == nearest.trial)
        value = metric_value(template, rule.metric)
        return Recommendation(
            template, rule, rec.best_value, 1, value if value is not None else math.nan,
            None, by_time=plan,
        )  # fmt: skip
    group = [t for t in trials if t.number in best.trials]
    top, _ = candidates(group, rule)
    if top is None:
        chosen = "most frugal" if prefers_energy(rule) and plan.least_energy else "fastest"
        return replace(rec, by_time_note=f"time to target: its {chosen} trials have no metric")
    preferred = metric_value(top[0], rule.prefer)
    return replace(rec, trial=top[0], value=top[1], preferred=preferred, verdict=None, by_time=plan)


def by_rule(
    trials: Sequence[FrozenTrial],
    rule: RecommendRule,
    speeds: Mapping[str, Speed] | None = None,
) -> Recommendation | None:
    """The trial the rule picks among the completed ones; None before any has `metric`.
    The best `metric` is taken over every completed trial; among those within the
    tolerance, trials without a `prefer` value (NaN) cannot be preferred, and if none has
    one, the best `metric` is the answer. With a speed check (`speeds`, geometry label ->
    Speed) and a throughput to prefer, a faster geometry is preferred only when it is
    faster beyond the noise (`_by_speed_check`)."""
    top, within_tolerance = candidates(trials, rule)
    if top is None:
        return None
    if not within_tolerance:
        return Recommendation(top[0], rule, top[1], 0, top[1], None)
    n = len(within_tolerance)
    checked = _by_speed_check(rule, within_tolerance, speeds) if speeds else None
    if checked is not None:
        (trial, value, _), verdict = checked
        preferred = verdict.speed.median(verdict.unit)
        return Recommendation(trial, rule, top[1], n, value, preferred, verdict)
    trial, value, preferred = _best_of(rule, within_tolerance, "prefer")
    return Recommendation(trial, rule, top[1], n, value, preferred)


def best_document(rec: Recommendation, study_name: str, overrides: Sequence[str]) -> str:
    """best.yaml: which trial, why, its figures, and the overrides that train it."""
    figures = {
        name: metric_value(rec.trial, name)
        for name in rec.rule.known
        if metric_value(rec.trial, name) is not None
    }
    body: dict[str, Any] = {
        "study": study_name,
        "trial": rec.trial.number,
        "rule": rec.rule.describe(),
        "values": figures,
        "overrides": list(overrides),
        # where the study ran: a project's own _target_ modules are importable from there
        "working_dir": str(Path.cwd()),
    }
    cell = rec.untrained
    if cell is not None:  # trial's figures are not this configuration's: its prediction is
        del body["values"]
        body["configuration"] = cell.geometry
        body["trained_by_a_trial"] = False
        body["predicted"] = _prediction(cell)
    elif rec.by_energy and rec.planned is not None:  # chosen by it: the prediction beside
        body["predicted"] = _prediction(rec.planned)
    header = (
        f"# The configuration study {study_name} recommends: {rec.describe()}.\n"
        f"# Train it again: python -m train +{BEST_KEY}=<this file> [more overrides]\n"
    )
    return header + OmegaConf.to_yaml(OmegaConf.create(body), sort_keys=False)


def _prediction(p: time_to_target.Predicted) -> dict[str, Any]:
    """best.yaml's `predicted`: a configuration's steps, seconds and (where measured)
    joules to the target."""
    found: dict[str, Any] = {
        "global_batch": p.batch,
        "steps_to_target": round(p.steps, 1),
        "seconds_per_step": p.step_s,
        "seconds_to_target": round(p.seconds, 3),
        "seconds_per_step_from": p.step_basis,
    }
    if p.joules is not None:
        found["joules_per_step"] = p.step_j
        found["joules_to_target"] = round(p.joules, 1)
    return found
