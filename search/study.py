"""The Optuna study: creation or resumption, and how many trials remain.

A study is resumable: the same command finds it by name in the same storage and runs until
`search.n_trials` trials have finished, counted over all the workers that share it (the
storage and the heartbeats that re-run a dead worker's trial are in search/storage.py).
Proposals answered without training (predicted not to fit, or a configuration trained
before: `is_unbilled`) are trials in Optuna, so the sampler learns from them, but do not
count towards search.n_trials.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import optuna
from omegaconf import OmegaConf
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from search import record
from train.config import ConfigError

CONFIG_ATTR = "batchfit.config"  # the study's fixed config, to refuse a resume that changes it


def open_study(
    name: str,
    storage: BaseStorage,
    directions: list[str],
    sampler: optuna.samplers.BaseSampler,
    pruner: optuna.pruners.BasePruner,
    fixed_config: str,
) -> tuple[optuna.Study, bool]:
    """Create the study, or load it and check it was made for the same fixed config; and
    whether this process created it. A study without trials (its first run failed before
    trial 0) takes the config it is now run with."""
    try:
        study = optuna.create_study(
            study_name=name,
            storage=storage,
            directions=directions,
            sampler=sampler,
            pruner=pruner,
        )
    except optuna.exceptions.DuplicatedStudyError:  # resumed, or another worker made it
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
        if not study.get_trials(deepcopy=False):
            study = _renew_empty(study, storage, directions, sampler, pruner, fixed_config)
        _check_same_study(study, directions, fixed_config)
        return study, False
    study.set_user_attr(CONFIG_ATTR, fixed_config)
    return study, True


def _renew_empty(
    study: optuna.Study,
    storage: BaseStorage,
    directions: list[str],
    sampler: optuna.samplers.BaseSampler,
    pruner: optuna.pruners.BasePruner,
    fixed_config: str,
) -> optuna.Study:
    """An empty study is nobody's record yet: it takes the new config, and (directions being
    fixed in Optuna) is made again for other objectives."""
    stored = [d.name.lower() for d in study.directions]
    if stored != directions:
        with contextlib.suppress(KeyError):  # another worker renewed it first
            optuna.delete_study(study_name=study.study_name, storage=storage)
        study = optuna.create_study(
            study_name=study.study_name,
            storage=storage,
            directions=directions,
            sampler=sampler,
            pruner=pruner,
            load_if_exists=True,  # another worker may renew it too
        )
    if study.user_attrs.get(CONFIG_ATTR) != fixed_config:
        study.set_user_attr(CONFIG_ATTR, fixed_config)
    return study


def _check_same_study(study: optuna.Study, directions: list[str], fixed_config: str) -> None:
    problems = []
    stored = [d.name.lower() for d in study.directions]
    if stored != directions:
        problems.append(
            f"study {study.study_name!r} optimises {stored}, but search.objectives now asks for "
            f"{directions}"
        )
    previous = study.user_attrs.get(CONFIG_ATTR)
    if previous is not None and previous != fixed_config:
        changed = _changed_lines(previous, fixed_config)
        problems.append(
            f"study {study.study_name!r} was run with another config ({changed}); "
            "resuming would mix incomparable trials"
        )
    if problems:
        problems.append(
            f"to start a new study, override search.study_name={study.study_name}-2; to resume "
            "this one, run it with its original settings"
        )
        raise ConfigError(problems)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}"""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _changed_lines(before: str, after: str) -> str:
    old = flatten(OmegaConf.to_container(OmegaConf.create(before)))
    new = flatten(OmegaConf.to_container(OmegaConf.create(after)))
    changed = [k for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
    return "; ".join(f"{k} was {old.get(k)!r}, now {new.get(k)!r}" for k in changed[:5])


def counts_as_finished(trial: FrozenTrial) -> bool:
    """Complete, pruned, or failed with an error of its own; not a trial that was interrupted
    (Ctrl-C, or a worker that died), which is run again."""
    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return trial.state == TrialState.FAIL and "error" in trial.user_attrs


REPEAT_ATTR = "repeat_of"  # user attr: the number of the trial whose record answered this one


def is_repeat(trial: FrozenTrial) -> bool:
    return REPEAT_ATTR in trial.user_attrs


def is_unbilled(trial: FrozenTrial) -> bool:
    """A proposal answered without training: predicted not to fit (the fit report knew it),
    or a configuration already trained, answered from its record. Optuna has it, so the
    sampler learns from it; search.n_trials does not count it."""
    return is_repeat(trial) or trial.user_attrs.get(record.REASON) == record.PREDICTED_OOM


def counts_as_trained(trial: FrozenTrial) -> bool:
    """Finished, and not unbilled: one of the search.n_trials the user asked for."""
    return counts_as_finished(trial) and not is_unbilled(trial)


# Outcomes that training the same configuration again would repeat: training is seeded, and
# on CPU the memory check is exact. A prediction is made again (the margin may have changed
# on resume; it is cheap and takes no slot), and `slow` (timing noise), `pruner` (depends on
# the other trials), failures and a CUDA OOM (fragmentation, other processes) train again.
SETTLED_REASONS = ("diverged", record.MISSED_TARGET)


def is_settled(trial: FrozenTrial) -> bool:
    """A finished trial whose configuration, proposed again, is answered from its record."""
    if is_repeat(trial):
        return False
    if trial.state == TrialState.COMPLETE:
        return True
    reason = trial.user_attrs.get(record.REASON)
    if reason == "oom":
        return trial.user_attrs.get("device") == "cpu"
    return trial.state == TrialState.PRUNED and reason in SETTLED_REASONS


def known_configurations(
    study: optuna.Study, distributions: Mapping[str, BaseDistribution]
) -> set[tuple]:
    """The distinct configurations of the space (sampled values within `distributions`) that
    a new trial would not train: settled, or predicted not to fit."""
    known = set()
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if not (is_settled(t) or t.user_attrs.get(record.REASON) == record.PREDICTED_OOM):
            continue
        if set(t.params) != set(distributions) or not all(
            _within(distributions[k], v) for k, v in t.params.items()
        ):
            continue  # from an earlier space of a resumed study
        known.add(tuple(sorted(t.params.items())))
    return known


def _within(dist: BaseDistribution, value: Any) -> bool:
    try:
        return dist._contains(dist.to_internal_repr(value))
    except (ValueError, TypeError):
        return False


def num_finished(study: optuna.Study) -> int:
    """Trials that count towards search.n_trials."""
    return sum(counts_as_trained(t) for t in study.get_trials(deepcopy=False))


SURPLUS_ATTR = "surplus"  # user attr of a trial started past search.n_trials (see claims_slot)


def _holds_slot(trial: FrozenTrial) -> bool:
    """Finished with a result that counts, running, or queued: it takes one of the n_trials."""
    return counts_as_trained(trial) or trial.state in (TrialState.RUNNING, TrialState.WAITING)


def num_running(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def should_start_trial(study: optuna.Study, n_trials: int) -> bool | None:
    """True: start a trial (a queued one first). None: the trials running elsewhere complete
    the study, so wait (one of them may die and be queued again). False: the study is done."""
    trials = study.get_trials(deepcopy=False)
    finished = sum(counts_as_trained(t) for t in trials)
    if finished >= n_trials:
        return False
    if any(t.state == TrialState.WAITING for t in trials):
        return True  # a dead worker's trial, queued again: someone must run it
    return True if sum(_holds_slot(t) for t in trials) < n_trials else None


def claims_slot(study: optuna.Study, number: int, n_trials: int) -> bool:
    """Whether trial `number`, just started, is within search.n_trials. Workers that start
    at the same moment may both start the last trial; trial numbers are given out
    atomically, so the later one sees the earlier and steps back."""
    earlier = [t for t in study.get_trials(deepcopy=False) if t.number < number]
    return sum(_holds_slot(t) for t in earlier) < n_trials


def interrupted_numbers(study: optuna.Study) -> set[int]:
    """Trials that ended without a result of their own because their worker died (failed by
    a heartbeat check) or was interrupted."""
    return {
        t.number
        for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        if not counts_as_finished(t) and SURPLUS_ATTR not in t.user_attrs
    }
