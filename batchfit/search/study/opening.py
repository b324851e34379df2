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
from batchfit.common.redact import redact
from batchfit.search.core.study_config import SearchConfig
from batchfit.search.storage.journal import RECOVERED_SUFFIX, SafeJournalFileBackend
from batchfit.search.storage.opening import located
from batchfit.tracking.runs import Tracker

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


def refuse_a_second_study_of_the_name(
    name: str, storage: BaseStorage, settings: SearchConfig, tracker: Tracker
) -> None:
    """A study new to its storage whose name MLflow already holds (its journal deleted or
    replaced, or another search.storage) would nest its trials, numbered from 0 again, under
    the old one's parent run: refused, with the ways to resume the old one or start apart.
    MLflow is asked first: a worker creating the study makes it in the storage before its
    parent run, so a parent run seen here has its study in the storage already."""
    earlier = tracker.earlier_study(name)
    if earlier is None:
        return
    try:
        storage.get_study_id_from_name(name)
        return
    except KeyError:
        pass
    backend = getattr(storage, "_backend", None)
    recovered = sorted(
        backend.path.parent.glob(f"{backend.path.name}{RECOVERED_SUFFIX}*")
        if isinstance(backend, SafeJournalFileBackend)
        else []
    )
    resume = (
        f"put back the journal kept when it vanished (mv {recovered[-1]} {backend.path})"
        if recovered
        else "give the search.storage it was run with"
    )
    raise ConfigError(
        [
            f"search.study_name={name}: MLflow ({redact(located(tracker.tracking_uri))}) already "
            f"holds a study of this name ({earlier}), but search.storage="
            f"{redact(located(settings.storage))} has no study {name} (its journal or "
            "database was deleted or replaced, or it was run with another search.storage); a "
            "new study would mix its trials into the old one's runs",
            f"to resume the old study, {resume} and run the same command; to start a new study "
            f"beside it, override search.study_name={name}-2",
        ]
    )


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
