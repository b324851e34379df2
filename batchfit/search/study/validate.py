"""Check the whole composed config before the first trial, and report every problem at once.

The base run, the study settings, the search space and every value the space can produce
(each choice, each bound) are checked with the same code the trials use, so a trial cannot
meet a configuration error the check did not report.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import optuna
import torch
from hydra.errors import HydraException, InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import CategoricalDistribution
from optuna.pruners import BasePruner
from optuna.samplers import BaseSampler
from optuna.storages import BaseStorage

from batchfit.common.checks import ConfigError, unknown_keys
from batchfit.search.core.study_config import (
    OBJECTIVE_METRICS,
    TARGET_METRICS,
    RecommendRule,
    SearchConfig,
    Target,
    known_metrics,
    resolve_margin,
    search_keys,
)
from batchfit.search.sampling.sampler import build_sampler
from batchfit.search.sampling.space import SearchSpace, parse_space
from batchfit.search.storage.opening import open_storage
from batchfit.search.study.space_values import check_space, corner_values
from batchfit.search.study.within_data import keep_within_data
from batchfit.tracking.mlflow_config import MlflowConfig
from batchfit.train.build import build_task
from batchfit.train.config import RunSpec
from batchfit.train.measure.energy import needs_energy, why_unmeasured
from batchfit.train.params import (
    ACCUM_KEY,
    BATCH_KEY,
    DEVICES_KEY,
    EFFECTIVE_KEY,
    PRECISION_KEY,
    STRATEGY_KEY,
)
from batchfit.train.plan import plan, resolve_device
from batchfit.train.precision import unsupported_reason
from batchfit.train.run import OverBudget, check_builds
from batchfit.train.workload import Workloads


@dataclass
class Checked:
    settings: SearchConfig
    space: SearchSpace
    spec: RunSpec  # the base run (before sampling)
    storage: BaseStorage
    notes: list[str]
    sampler: BaseSampler | None = None  # search.sampler, built (a grid from the space)
    pruner: BasePruner | None = None  # search.pruner, built (None: Optuna's default)


def search_config(cfg: DictConfig, study_name: str) -> SearchConfig:
    search = cfg.search
    task = build_task(cfg)
    known = known_metrics(task)
    target, target_problems = None, []
    if search.get("target") is not None:
        try:
            target = Target.parse(search.target, known, task.ranges())
        except ConfigError as error:
            target_problems = error.problems
        known = {**known, **TARGET_METRICS}
    rule, rule_problems = recommend_rule(search.get("recommend"), known)
    rule_problems += target_problems + unknown_keys("search", search, search_keys())
    objectives = search.objectives
    if isinstance(objectives, str):
        objectives = [objectives]
    try:
        settings = SearchConfig(
            study_name=study_name,
            storage=search.storage,
            n_trials=search.n_trials,
            memory_budget=search.memory_budget,
            objectives=tuple(str(metric) for metric in objectives or ()),
            trial_time_budget_s=search.trial_time_budget_s,
            heartbeat_interval_s=search.heartbeat_interval_s,
            preflight=search.preflight,
            preflight_margin=search.preflight_margin,
            oom_constraint=search.oom_constraint,
            accumulation=search.accumulation,
            workers=search.workers,
            threads=search.threads,
            timeout_s=search.timeout_s,
            speed_check=search.speed_check,
            fit_report_first=search.fit_report_first,
            default_space=search.default_space,
            validations_per_epoch=search.get("validations_per_epoch"),
            outage_wait_s=cfg.mlflow.outage_wait_s,
            recommend=rule,
            known_metrics=known,
            target=target,
            gpu=search.gpu,
            gpu_budget=search.gpu_budget,
        )
    except ConfigError as error:  # (a target given but refused is not said to be missing)
        own = [p for p in error.problems if not (target_problems and "needs search.target" in p)]
        raise ConfigError(own + rule_problems) from None
    if rule_problems:
        raise ConfigError(rule_problems)
    return settings


def recommend_rule(
    node: DictConfig | None, known: Mapping[str, str] = OBJECTIVE_METRICS
) -> tuple[RecommendRule, list[str]]:
    """search.recommend as a rule, or the default rule and what is wrong with the node."""
    values = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    fields = set(RecommendRule.__dataclass_fields__) - {"known"}
    unknown = unknown_keys("search.recommend", values, fields)
    if unknown:
        return RecommendRule(), unknown
    try:
        return RecommendRule(**values, known=known), []
    except ConfigError as error:
        return RecommendRule(), error.problems


def _collect(problems: list[str], check: Callable[[], object]) -> object | None:
    try:
        return check()
    except ConfigError as error:
        problems.extend(p for p in error.problems if p not in problems)
        return None


def validate(
    cfg: DictConfig,
    study_name: str,
    compose: Callable[[list[str]], DictConfig],
    open_store: bool = True,
    multirun: bool | None = None,
    workloads: Workloads | None = None,
) -> Checked:
    """Every problem of the composed config, at once. `multirun`: whether this process is a
    job of a --multirun (None: not known, not checked). `workloads`: the study's, which keeps
    the data and predictor the checks build for the fit report and the trials."""
    problems: list[str] = []
    notes: list[str] = []
    settings = _collect(problems, lambda: search_config(cfg, study_name))
    _collect(problems, lambda: MlflowConfig.from_mapping(_container(cfg.get("mlflow"))))
    pruner = _collect(problems, lambda: build_pruner(cfg.search.get("pruner")))
    if settings is not None and settings.workers > 1 and multirun is False:
        problems.append(
            f"search.workers={settings.workers} starts that many worker processes only with "
            f"--multirun: python -m search --multirun search.workers={settings.workers} ...; "
            "for one process, leave search.workers out"
        )
    space = _collect(problems, lambda: parse_space(cfg.search.params or {}))
    spec = _collect(problems, lambda: _plan_with_space(cfg, compose, space))
    derived = settings is not None and settings.accumulation == "derived"
    if space is not None:
        device = spec.target if spec else resolve_device("auto")
        notes += _drop_unsupported_precisions(space, device, problems)
        problems += _check_accumulation(space, derived)
        found, given_notes = check_space(cfg, compose, space, problems, derived, workloads)
        problems += found
        notes += given_notes
    over_budget = None  # the budget cannot hold the state: said with what would fit
    if spec is not None and not problems:
        try:
            note = check_builds(cfg, spec, workloads)
        except OverBudget as error:
            note, over_budget = None, error
            problems += error.problems
        except ConfigError as error:
            note = None
            problems += [p for p in error.problems if p not in problems]
        if note and derived:
            problems.append(
                f"search.accumulation=derived chooses each micro-batch from the memory "
                f"prediction, but {note}; use search.accumulation=searched"
            )
        elif note:
            notes.append(note)
        if space is not None and not problems:
            workload = (workloads or Workloads()).of(cfg)
            fitted = keep_within_data(space, spec.trainer, workload.num_train, workload.data_named)
            notes += fitted[0]
            problems += fitted[1]
    if settings is not None and spec is not None and open_store:  # it trains here
        energy_problems, energy_note = _check_energy(settings, spec.device)
        problems += energy_problems
        notes += [energy_note] if energy_note else []
    if settings is not None and spec is not None and not problems:  # the margin's kind of step
        searched = space.distributions if space is not None else ()
        settings = resolve_margin(settings, cfg, spec, searched, workloads)
    sampler = None
    if space is not None:
        built = _collect(problems, lambda: build_sampler(cfg.search.sampler, space))
        if built is not None:
            sampler, sampler_notes = built
            notes += sampler_notes
    if space is not None and not problems:
        _collect(problems, lambda: _compose_trial(compose, space))
    storage = None
    if settings is not None and open_store:
        storage = _collect(
            problems, lambda: open_storage(settings.storage, settings.heartbeat_interval_s)
        )
    if over_budget is not None and problems == over_budget.problems:
        raise over_budget
    if problems:
        raise ConfigError(problems)
    return Checked(settings, space, spec, storage, notes, sampler, pruner)


def _check_energy(settings: SearchConfig, device: torch.device) -> tuple[list[str], str | None]:
    """Where no counter is readable (train/measure/energy.py): the note said once per study,
    and a problem for each energy figure the study was asked to optimise or prefer, which
    no trial would report."""
    why = why_unmeasured(device)
    if why is None:
        return [], None
    asked = [(f"search.objectives={m}", m) for m in settings.objectives if needs_energy(m)]
    prefer = settings.recommend.prefer
    if needs_energy(prefer):
        asked.append((f"search.recommend.prefer={prefer}", prefer))
    problems = [
        f"{key}: {why.removeprefix('energy: ')}, so no trial would report {metric}; choose "
        "another metric, or run where NVML (an NVIDIA GPU, the energy extra) or RAPL "
        "(/sys/class/powercap readable) counts energy"
        for key, metric in asked
    ]
    return problems, why


# Keys TrainerConfig checks together (trainer.devices needs a strategy; fsdp refuses fp16)
JOINT_KEYS = (STRATEGY_KEY, DEVICES_KEY, PRECISION_KEY)


def _plan_with_space(
    cfg: DictConfig, compose: Callable[[list[str]], DictConfig], space: SearchSpace | None
) -> RunSpec:
    """The run planned as the command line gives it; where that fails but the space
    searches a key checked together with a fixed one (trainer.devices=2 fixed,
    trainer.strategy searched), the run as each trial composes it: every combination of
    the searched values of JOINT_KEYS must plan, and the first trial's plan stands for the
    study's. A combination that cannot is named with its values."""
    try:
        return plan(cfg, cfg.search.memory_budget)
    except ConfigError as error:
        joint = [k for k in JOINT_KEYS if space is not None and k in space.distributions]
        if not joint:
            raise
        assert space is not None
        first = {key: corner_values(dist)[0] for key, dist in space.distributions.items()}
        combinations = itertools.product(*(corner_values(space.distributions[k]) for k in joint))
        planned, problems = None, []
        for values in combinations:
            chosen = dict(zip(joint, values, strict=True))
            try:
                trial = compose(space.overrides({**first, **chosen}))
                spec = plan(trial, trial.search.memory_budget)
            except ConfigError as failed:
                where = ", ".join(f"{k}={v}" for k, v in chosen.items())
                problems += [f"with {where} from search.params: {p}" for p in failed.problems]
            else:
                planned = planned or spec
        if planned is None:
            raise error from None  # no trial plans either: the command line's problem
        if problems and len(joint) > 1:  # one key's values: each is checked on its own below
            raise ConfigError(problems) from None
        return planned


def _container(node: DictConfig | None) -> dict:
    return OmegaConf.to_container(node, resolve=True) if node is not None else {}


def build_pruner(node: DictConfig | None) -> BasePruner | None:
    """search.pruner, built; what is wrong with it (its _target_, its settings) as a
    ConfigError naming the key. None: no pruner set (Optuna's default)."""
    values = _container(node)
    if not values:
        return None
    target_path = str(values.pop("_target_", None))
    example = "search.pruner._target_=optuna.pruners.MedianPruner"
    module, _, name = target_path.rpartition(".")
    try:
        target = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        ours = [f"optuna.pruners.{p}" for p in dir(optuna.pruners) if p.endswith("Pruner")]
        close = difflib.get_close_matches(target_path, ours, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(
            [
                f"search.pruner._target_={target_path!r} cannot be imported ({error}); {hint}"
                f"Optuna's pruners: {', '.join(p for p in ours if not p.endswith('BasePruner'))}"
                " (optuna.pruners.NopPruner prunes nothing)"
            ]
        ) from None
    if not (isinstance(target, type) and issubclass(target, BasePruner)):
        raise ConfigError(
            [f"search.pruner._target_={target_path!r} is not an Optuna pruner; e.g. {example}"]
        )
    params = inspect.signature(target).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        problems = unknown_keys("search.pruner", values, params)
        if problems:
            raise ConfigError(problems)
    try:
        return instantiate(node)  # nested _target_s too (a PatientPruner's wrapped_pruner)
    except InstantiationException as error:
        cause = error.__cause__ or error
        reason = f"{type(cause).__name__}: {str(cause).splitlines()[0]}"
        problem = f"search.pruner ({target.__name__}) cannot be built: {reason}"
        raise ConfigError([problem]) from None


def _compose_trial(compose: Callable[[list[str]], DictConfig], space: SearchSpace) -> None:
    """A trial's overrides compose (fixed values included), with the first value of each key."""
    first = {key: corner_values(dist)[0] for key, dist in space.distributions.items()}
    overrides = space.overrides(first)
    try:
        compose(overrides)
    except HydraException as error:
        raise ConfigError([f"search.params: {overrides} do not compose: {error}"]) from None


def _drop_unsupported_precisions(space: SearchSpace, device, problems: list[str]) -> list[str]:  # noqa: ANN001
    key = PRECISION_KEY
    dist = space.distributions.get(key)
    if not isinstance(dist, CategoricalDistribution):
        return []
    reasons = {c: unsupported_reason(str(c), device) for c in dist.choices}
    if all(reasons.values()):
        problems.append(
            f"search.params.{key}: no choice can run on {getattr(device, 'name', device.type)} "
            f"({'; '.join(map(str, reasons.values()))}); add fp32, e.g. choice(fp32, bf16)"
        )
        return []
    dropped = space.restrict_choices(key, lambda c: not reasons[c])
    return [f"{key}: dropped {c} ({reasons[c]})" for c in dropped]


def _check_accumulation(space: SearchSpace, derived: bool) -> list[str]:
    keys = set(space.distributions) | set(space.fixed)
    if derived:
        problems = [
            f"search.params.{key}: search.accumulation=derived sets {key} itself from the "
            f"budget; remove it from search.params and search {EFFECTIVE_KEY} instead"
            for key in (BATCH_KEY, ACCUM_KEY)
            if key in keys
        ]
        if EFFECTIVE_KEY not in keys:
            problems.append(
                f"search.accumulation=derived searches the effective batch size: add "
                f"search.params.{EFFECTIVE_KEY}, e.g. choice(64, 128, 256, 512)"
            )
        return problems
    if EFFECTIVE_KEY in keys:
        return [
            f"search.params.{EFFECTIVE_KEY} is searched only with search.accumulation=derived; "
            "set it, or search trainer.batch_size and trainer.accum_steps instead"
        ]
    return []
