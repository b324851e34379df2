"""The Optuna study: creation or resumption, refused when the config changed.

A study is resumable: the same command finds it by name in the same storage and runs until
`search.n_trials` trials have trained, counted over all the workers that share it
(search/core/trial_count.py; the storage and the heartbeats that re-run a dead worker's trial are in
search/storage/).
"""

from __future__ import annotations

import contextlib
from typing import Any

import optuna
from omegaconf import OmegaConf
from optuna.storages import BaseStorage

from batchfit.common.checks import ConfigError

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
