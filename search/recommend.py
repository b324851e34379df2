"""What the study recommends, and the file that trains it again.

A study with several objectives has a front, not a winner; the user still asks "what should
I use?". The rule (`search.recommend`): among the completed trials whose `metric` is within
`tolerance` of its best value (relative: 0.01 is 1%), the one best in `prefer`. The default is
the fastest configuration within 1% of the best val accuracy.

The answer is written as `best.yaml` (the trial's overrides, config search path included) to
the Hydra output directory and to the study's parent MLflow run, and

    python -m train +best=path/to/best.yaml

trains it again (train/__main__.py composes the file's overrides, then the command line's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf
from optuna.trial import FrozenTrial, TrialState

from search import record
from search.config import RecommendRule
from search.study import is_repeat
from train.overrides import BEST_KEY


def metric_value(trial: FrozenTrial, name: str, objectives: Sequence[str] = ()) -> float | None:
    """A completed trial's figure by metric name (from its objective values for trials
    recorded before the figures were kept by name)."""
    value = trial.user_attrs.get(record.METRICS, {}).get(name)
    if value is None and name in objectives and trial.values:
        value = trial.values[list(objectives).index(name)]
    return None if value is None or value != value else float(value)


def within(rule: RecommendRule, value: float, best: float) -> bool:
    """Whether `value` of the rule's metric is within its tolerance of `best`."""
    slack = abs(best) * rule.tolerance
    if rule.known[rule.metric] == "maximize":
        return value >= best - slack
    return value <= best + slack


@dataclass(frozen=True)
class Recommendation:
    trial: FrozenTrial
    rule: RecommendRule
    best_value: float  # the best `rule.metric` of the study
    num_candidates: int  # trials within the tolerance (with a `prefer` value)
    value: float  # the trial's `rule.metric`
    preferred: float | None  # the trial's `rule.prefer` (None: no trial within had one)

    def describe(self) -> str:
        rule, n = self.rule, self.trial.number
        if rule.metric == rule.prefer or not rule.tolerance or self.preferred is None:
            return f"trial {n}, the best {rule.metric} ({self.value:.4g})"
        among = f"{self.num_candidates} trial" + ("s" if self.num_candidates > 1 else "")
        return (
            f"trial {n}, the best {rule.prefer} ({self.preferred:.4g}) among the {among} whose "
            f"{rule.metric} is within {rule.tolerance:.0%} of the best ({self.best_value:.4g}; "
            f"this one {self.value:.4g})"
        )


def recommend(
    trials: Sequence[FrozenTrial], rule: RecommendRule, objectives: Sequence[str] = ()
) -> Recommendation | None:
    """The trial the rule picks among the completed ones; None before any has `metric`.
    The best `metric` is taken over every completed trial; among those within the
    tolerance, trials without a `prefer` value (NaN) cannot be preferred, and if none has
    one, the best `metric` is the answer."""
    scored = [
        (t, metric_value(t, rule.metric, objectives), metric_value(t, rule.prefer, objectives))
        for t in trials
        if t.state == TrialState.COMPLETE and not is_repeat(t)
    ]
    scored = [(t, m, p) for t, m, p in scored if m is not None]
    if not scored:
        return None
    top = scored[0]
    for candidate in scored[1:]:
        if rule.better(rule.metric, candidate[1], top[1]):
            top = candidate
    best = top[1]
    candidates = [s for s in scored if s[2] is not None and within(rule, s[1], best)]
    if not candidates:
        return Recommendation(top[0], rule, best, 0, top[1], None)
    chosen = candidates[0]
    for candidate in candidates[1:]:
        t, m, p = candidate
        if rule.better(rule.prefer, p, chosen[2]) or (
            p == chosen[2] and rule.better(rule.metric, m, chosen[1])
        ):
            chosen = candidate
    return Recommendation(chosen[0], rule, best, len(candidates), chosen[1], chosen[2])


def best_document(
    rec: Recommendation, study_name: str, overrides: Sequence[str], objectives: Sequence[str]
) -> str:
    """best.yaml: which trial, why, its figures, and the overrides that train it."""
    figures = {
        name: metric_value(rec.trial, name, objectives)
        for name in rec.rule.known
        if metric_value(rec.trial, name, objectives) is not None
    }
    body: dict[str, Any] = {
        "study": study_name,
        "trial": rec.trial.number,
        "rule": rec.rule.describe(),
        "values": figures,
        "overrides": list(overrides),
    }
    header = (
        f"# The configuration study {study_name} recommends: {rec.describe()}.\n"
        f"# Train it again: python -m train +{BEST_KEY}=<this file> [more overrides]\n"
    )
    return header + OmegaConf.to_yaml(OmegaConf.create(body), sort_keys=False)
