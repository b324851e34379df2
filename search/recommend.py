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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from optuna.trial import FrozenTrial, TrialState

from search.config import OBJECTIVE_METRICS, RecommendRule
from search.space import override_key
from train.config import ConfigError

METRICS_ATTR = "metrics"  # a completed trial's figures by metric name (search/objective.py)
BEST_FILE = "best.yaml"
BEST_KEY = "best"  # python -m train +best=PATH


def metric_value(trial: FrozenTrial, name: str, objectives: Sequence[str] = ()) -> float | None:
    """A completed trial's figure by metric name (from its objective values for trials
    recorded before the figures were kept by name)."""
    value = trial.user_attrs.get(METRICS_ATTR, {}).get(name)
    if value is None and name in objectives and trial.values:
        value = trial.values[list(objectives).index(name)]
    return None if value is None or value != value else float(value)


def _better(name: str, a: float, b: float) -> bool:
    return a > b if OBJECTIVE_METRICS[name] == "maximize" else a < b


def within(name: str, value: float, best: float, tolerance: float) -> bool:
    slack = abs(best) * tolerance
    if OBJECTIVE_METRICS[name] == "maximize":
        return value >= best - slack
    return value <= best + slack


@dataclass(frozen=True)
class Recommendation:
    trial: FrozenTrial
    rule: RecommendRule
    best_value: float  # the best `rule.metric` of the study
    num_candidates: int  # trials within the tolerance

    def describe(self) -> str:
        rule, t = self.rule, self.trial
        value = metric_value(t, rule.metric)
        if rule.metric == rule.prefer or not rule.tolerance:
            return f"trial {t.number}, the best {rule.metric} ({value:.4g})"
        among = f"{self.num_candidates} trial" + ("s" if self.num_candidates > 1 else "")
        return (
            f"trial {t.number}, the best {rule.prefer} ({metric_value(t, rule.prefer):.4g}) "
            f"among the {among} whose {rule.metric} is within {rule.tolerance:.0%} of the best "
            f"({self.best_value:.4g}; this one {value:.4g})"
        )


def recommend(
    trials: Sequence[FrozenTrial], rule: RecommendRule, objectives: Sequence[str] = ()
) -> Recommendation | None:
    """The trial the rule picks among the completed ones; None before any completed."""
    scored = [
        (t, metric_value(t, rule.metric, objectives), metric_value(t, rule.prefer, objectives))
        for t in trials
        if t.state == TrialState.COMPLETE
    ]
    scored = [(t, m, p) for t, m, p in scored if m is not None and p is not None]
    if not scored:
        return None
    best = scored[0][1]
    for _, m, _ in scored:
        if _better(rule.metric, m, best):
            best = m
    candidates = [s for s in scored if within(rule.metric, s[1], best, rule.tolerance)]
    chosen = candidates[0]
    for candidate in candidates[1:]:
        t, m, p = candidate
        if _better(rule.prefer, p, chosen[2]) or (
            p == chosen[2] and _better(rule.metric, m, chosen[1])
        ):
            chosen = candidate
    return Recommendation(chosen[0], rule, best, len(candidates))


def best_document(
    rec: Recommendation, study_name: str, overrides: Sequence[str], objectives: Sequence[str]
) -> str:
    """best.yaml: which trial, why, its figures, and the overrides that train it."""
    figures = {
        name: metric_value(rec.trial, name, objectives)
        for name in OBJECTIVE_METRICS
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


def load_overrides(path: str | Path) -> list[str]:
    """The overrides of a best.yaml, for `python -m train +best=PATH`."""
    file = Path(path).expanduser()
    fix = f"give the path of a {BEST_FILE} a study wrote, e.g. +{BEST_KEY}=mlruns/.../{BEST_FILE}"
    if not file.is_file():
        raise ConfigError([f"{BEST_KEY}={str(path)!r}: no such file; {fix}"])
    loaded = yaml.safe_load(file.read_text())  # as written: ${...} stays an interpolation
    overrides = loaded.get("overrides") if isinstance(loaded, Mapping) else None
    if (
        not isinstance(overrides, list)
        or not overrides
        or not all(isinstance(o, str) for o in overrides)
    ):
        raise ConfigError([f"{BEST_KEY}={str(path)!r} has no list of overrides; {fix}"])
    return list(overrides)


def merge_overrides(first: Sequence[str], then: Sequence[str]) -> list[str]:
    """`first`, less the keys `then` sets, followed by `then`: the later one wins."""
    later = {override_key(o) for o in then}
    return [o for o in first if override_key(o) not in later] + list(then)
