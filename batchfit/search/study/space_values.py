"""The searched values checked against the config before trial 0: each value in the first
trial's config (the other searched keys at their first values, as a trial draws them
together), its problems said under `search.params.<key>`, and what every value or the config
itself causes said once, as the fixed keys' own. Part of search/study/validate.py's checks.
"""

from __future__ import annotations

import copy
import difflib
import functools
from collections.abc import Callable

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, InstantiationException
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import CategoricalDistribution

from batchfit.common.checks import ConfigError
from batchfit.common.overrides import override_key
from batchfit.search.sampling.space import SearchSpace
from batchfit.train.params import (
    ACCUM_KEY,
    BATCH_KEY,
    DEVICES_KEY,
    EFFECTIVE_KEY,
    STRATEGY_KEY,
)
from batchfit.train.plan import plan
from batchfit.train.run import check_model_builds
from batchfit.train.workload import Workloads

_MISSING = object()


def check_space(
    cfg: DictConfig,
    compose: Callable[[list[str]], DictConfig],
    space: SearchSpace,
    known: list[str],
    derived: bool,
    workloads: Workloads | None,
) -> tuple[list[str], list[str]]:
    """Problems with the searched values and the fixed ones, each under the key that causes
    it, and notes. Each value is checked in the first trial's config (every other searched
    key at its first value, as a trial draws them together), never against the command
    line's value of a searched key, which no trial uses. A value is blamed only for what
    the key's other values do not cause; a problem no searched value causes is the fixed
    keys' own, said once in their words."""
    first = {key: corner_values(dist)[0] for key, dist in space.distributions.items()}
    try:
        baseline = compose(space.overrides(first))
    except HydraException:  # a key the config lacks: said by _check_key, with a close one
        baseline = copy.deepcopy(cfg)
        for key, value in first.items():
            if OmegaConf.select(cfg, key, default=_MISSING) is not _MISSING:
                OmegaConf.update(baseline, key, value, merge=False)
    if derived and EFFECTIVE_KEY in first:  # a derived trial's first, consistent geometry
        OmegaConf.update(baseline, BATCH_KEY, first[EFFECTIVE_KEY], merge=False)
        OmegaConf.update(baseline, ACCUM_KEY, 1, merge=False)
    problems, explained = [], set(known)
    # What the config builds into whatever is searched (a malformed model.config): the
    # fixed keys' own, said once, never blamed on a searched value built with it.
    fixed_builds = functools.cache(lambda: _build_problems(cfg, workloads))
    for key in space.distributions:
        found, causes = _check_key(
            cfg, baseline, key, space, known, derived, workloads, fixed_builds
        )
        problems += found
        explained |= causes
    given_problems, notes = _given_values(cfg, compose, baseline, space)
    fixed = [p for p in _plan_problems(baseline) if p not in explained]
    if fixed_builds.cache_info().currsize:  # asked: some searched value failed to build
        fixed += [p for p in fixed_builds() if p not in fixed and p not in explained]
    return fixed + given_problems + problems, notes


def _plan_problems(trial_cfg: DictConfig) -> list[str]:
    try:
        plan(trial_cfg, trial_cfg.search.memory_budget)
    except ConfigError as error:
        return list(error.problems)
    return []


def _given_values(
    cfg: DictConfig,
    compose: Callable[[list[str]], DictConfig],
    baseline: DictConfig,
    space: SearchSpace,
) -> tuple[list[str], list[str]]:
    """A searched key the command line also sets (trainer.precision=bf16 while the space
    searches it): its trials take the searched values, so the given one is said to be
    unused, and refused where it is invalid itself (trainer.precision=fp8)."""
    plain = compose([])  # a study's trials start from it: the searched keys' given values dropped
    typed = _command_line_keys()
    problems, notes = [], []
    at_baseline = set(_plan_problems(baseline))
    for key, dist in space.distributions.items():
        given = OmegaConf.select(cfg, key, default=_MISSING)
        if given is _MISSING or isinstance(given, DictConfig):
            continue
        if key not in typed and given == OmegaConf.select(plain, key, default=_MISSING):
            continue  # not given, or given as the config has it: nothing to say
        written = space.overrides({key: given})[-1]
        searched = f"search.params.{key} searches it, {_describe(dist)}, and trials take those"
        trial_cfg = copy.deepcopy(baseline)
        OmegaConf.update(trial_cfg, key, given, merge=False)
        own = [p for p in _plan_problems(trial_cfg) if p not in at_baseline]
        if own:
            problems += [f"{p} ({searched})" for p in own]
        else:
            notes.append(
                f"{written} is not used: {searched}; to fix it for every trial: "
                f"'++search.params={{{key}:{written.split('=', 1)[1]}}}'"
            )
    return problems, notes


def _command_line_keys() -> set[str]:
    """The keys the command line sets, where Hydra's app runs (its overrides are known)."""
    if not HydraConfig.initialized():
        return set()
    return {override_key(o) for o in HydraConfig.get().overrides.task}


def _describe(dist) -> str:  # noqa: ANN001
    if isinstance(dist, CategoricalDistribution):
        return f"choice({', '.join(map(str, dist.choices))})"
    return f"{dist.low} to {dist.high}"


# Searched keys of the groups a model and its data are built from: each value is built
# once (on fake tensors) before any trial, so a value the model cannot take (a sequence
# longer than its positions) is refused with the model's own line.
BUILT_GROUPS = ("model", "data", "task")


def _check_key(
    cfg: DictConfig,
    baseline: DictConfig,
    key: str,
    space: SearchSpace,
    known: list[str],
    derived: bool,
    workloads: Workloads | None,
    fixed_builds: Callable[[], list[str]],
) -> tuple[list[str], set[str]]:
    """Problems with searching `key` (unknown key, a value the run would reject), and the
    problems its values cause (which the fixed keys are then not blamed for); a value's
    build problem that the config has without it (`fixed_builds`) is not the value's."""
    where = f"search.params.{key}"
    loader = (
        GlobalHydra.instance().config_loader() if GlobalHydra.instance().is_initialized() else None
    )
    groups = loader.get_group_options(key) if loader and "." not in key else []
    if not groups and OmegaConf.select(cfg, key, default=_MISSING) is _MISSING:
        close = difflib.get_close_matches(key, _all_keys(cfg), n=1)
        hint = f"; did you mean {close[0]}?" if close else "; search keys must exist in the config"
        return [f"{where}: {key!r} is not a key of the composed config{hint}"], set()
    if groups:
        return [
            f"{where}: {value!r} is not an option of the {key} group; options: {', '.join(groups)}"
            for value in corner_values(space.distributions[key])
            if str(value) not in groups
        ], set()
    values = corner_values(space.distributions[key])
    found: dict[object, list[str]] = {}
    for value in values:
        trial_cfg = copy.deepcopy(baseline)
        try:
            OmegaConf.update(trial_cfg, key, value, merge=False)
            if derived and key == EFFECTIVE_KEY:  # a trial's first, consistent geometry
                OmegaConf.update(trial_cfg, BATCH_KEY, value, merge=False)
                OmegaConf.update(trial_cfg, ACCUM_KEY, 1, merge=False)
            _with_layout(trial_cfg, key, value, space)
        except HydraException as error:
            found[value] = [f"{where}: value {value!r} is invalid: {error}"]
            continue
        found[value] = _plan_problems(trial_cfg)
        if not found[value] and value in _built_values(key, values):
            built = _build_problems(trial_cfg, workloads)
            found[value] = [p for p in built if p not in fixed_builds()] if built else []
    # What every value causes is not the value's doing: the fixed keys' (said once), or,
    # for a key of one value, what its config value causes too.
    common = set.intersection(*(set(v) for v in found.values()))
    if len(values) == 1:
        own = copy.deepcopy(baseline)
        OmegaConf.update(own, key, OmegaConf.select(cfg, key), merge=False)
        common &= set(_plan_problems(own))
    problems, causes = [], set()
    for value, value_problems in found.items():
        override = space.overrides({key: value})[-1].split("=", 1)[1]
        for problem in value_problems:
            if problem in common or problem in known:
                continue
            causes.add(problem)
            if problem.startswith(f"{where}:"):
                problems.append(problem)
            else:
                problems.append(f"{where}: value {override} is invalid: {problem}")
    return problems, causes


def _built_values(key: str, values: list[object]) -> list[object]:
    """The values of `key` built before any trial: of a model or data key, the largest of
    numbers (what a model limits is bounded above: positions, a rank within a width; a
    number too small is the config check's), every other value; none of the other keys
    (a build of an 8B model on fake tensors takes seconds)."""
    if key.split(".")[0] not in BUILT_GROUPS:
        return []
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return [max(values)]
    return values


def _build_problems(trial_cfg: DictConfig, workloads: Workloads | None) -> list[str]:
    """The model and data of a trial with this value, built on fake tensors (no weights)."""
    try:
        check_model_builds(trial_cfg, plan(trial_cfg, trial_cfg.search.memory_budget), workloads)
    except ConfigError as error:
        return list(error.problems)
    except (ValueError, TypeError, FileNotFoundError, InstantiationException) as error:
        cause = error.__cause__ if isinstance(error, InstantiationException) else error
        cause = cause or error
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        return [f"{type(cause).__name__}: {first}"]
    return []


def _with_layout(trial_cfg: DictConfig, key: str, value: object, space: SearchSpace) -> None:
    """A searched number of devices is checked with a searched data-parallel strategy, and
    a searched strategy with the searched devices: a trial draws them together. A
    combination no trial can train (`none` on several devices) is then the problem."""
    other = {STRATEGY_KEY: DEVICES_KEY, DEVICES_KEY: STRATEGY_KEY}.get(key)
    dist = space.distributions.get(other) if other else None
    if not isinstance(dist, CategoricalDistribution):
        return
    choices = list(dist.choices)
    if key == DEVICES_KEY and isinstance(value, int) and value > 1:
        # the strategy a trial on these devices may draw: `none` when it is a choice
        pick = "none" if "none" in choices else choices[0]
    elif key == STRATEGY_KEY and value == "none":
        pick = max(choices, key=lambda c: c if isinstance(c, int) else 1)
    else:
        return
    OmegaConf.update(trial_cfg, other, pick, merge=False)


def corner_values(dist) -> list[object]:  # noqa: ANN001
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    return [dist.low, dist.high]


def _all_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for k, v in cfg.items():
        path = f"{prefix}{k}"
        keys.append(path)
        if isinstance(v, DictConfig):
            keys += _all_keys(v, f"{path}.")
    return keys
