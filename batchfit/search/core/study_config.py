"""Typed, validated settings of a study (the non-`_target_` part of `search`)."""

from __future__ import annotations

import contextlib
import math
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from omegaconf import DictConfig

from batchfit.common.checks import (
    ConfigError,
    choice_problems,
    flag_problems,
    integer_problems,
    number_problems,
)
from batchfit.common.redact import redact
from batchfit.tracking.metrics import (
    ACHIEVED_FLOPS,
    DATA_WAIT_SHARE,
    DEVICE_UTILIZATION,
    ENERGY_J,
    ENERGY_PER_SAMPLE,
    MEAN_WATTS,
    MFU,
    PEAK_BYTES,
    THROUGHPUT_SAMPLES,
    TO_TARGET_J,
    TO_TARGET_S,
    VAL_ACC,
    VAL_PREFIX,
    joules_per,
    throughput,
)
from batchfit.train.config import RunSpec
from batchfit.train.memory.predict import PredictionUnsupported
from batchfit.train.memory.preflight import UNMEASURED_MARGIN, Margin, margin_problems, step_margin
from batchfit.train.plan import USABLE, gpu_budget_problems
from batchfit.train.tasks import Classification, Task
from batchfit.train.workload import Workloads

# What every run measures, whatever its task, with the only direction that makes sense.
RUN_METRICS = {
    THROUGHPUT_SAMPLES: "maximize",
    PEAK_BYTES: "minimize",
    DATA_WAIT_SHARE: "minimize",
    MFU: "maximize",  # model FLOPs utilisation (train/measure/flops.py)
    ACHIEVED_FLOPS: "maximize",
    # measured where the hardware counts energy (train/measure/energy.py); absent elsewhere
    ENERGY_J: "minimize",
    ENERGY_PER_SAMPLE: "minimize",
    MEAN_WATTS: "minimize",
    DEVICE_UTILIZATION: "maximize",
}


def known_metrics(task: Task) -> dict[str, str]:
    """Metric name -> direction of everything a trial of `task` reports: its validation
    metrics (val/loss and the task's own), its throughput in its unit, and RUN_METRICS."""
    found = dict(task.directions())
    if task.unit != "samples":
        found[throughput(task.unit)] = "maximize"
        found[joules_per(task.unit)] = "minimize"
    return {**found, **RUN_METRICS}


TO_TARGET = TO_TARGET_S  # training seconds until validation first met search.target
# What a trial that met search.target also reports (search/trial/objective.py)
TARGET_METRICS = {TO_TARGET: "minimize", TO_TARGET_J: "minimize"}


@dataclass(frozen=True)
class Target:
    """search.target, e.g. `val/acc>=0.95` or `val/loss<=1.2`: the validation figure a run
    must reach. A trial stops training at the validation that first reaches it and reports
    time/to_target_s; one that ends its budget short of it is pruned (missed_target)."""

    metric: str
    op: str  # >= or <=
    value: float

    @classmethod
    def parse(
        cls,
        text: str,
        known: Mapping[str, str],
        ranges: Mapping[str, tuple[float | None, float | None]] | None = None,
    ) -> Target:
        """From `text`; `known`: metric -> direction; `ranges`: metric -> the (lowest,
        highest) values it can take (Task.ranges), beyond which a target is never met."""
        for op in (">=", "<="):
            if op in str(text):
                metric, _, value = str(text).partition(op)
                metric = metric.strip()
                break
        else:
            raise ConfigError(
                [
                    f"search.target={text!r} is not METRIC>=VALUE or METRIC<=VALUE; e.g. "
                    "search.target='val/acc>=0.95'"
                ]  # fmt: skip
            )
        problems = []
        if not metric.startswith(VAL_PREFIX) or metric not in known:
            vals = [m for m in known if m.startswith(VAL_PREFIX)]
            problems.append(
                f"search.target: {metric!r} is not a validation metric of this task; it "
                f"reports {', '.join(vals)}"
            )
        elif (op == ">=") != (known[metric] == "maximize"):
            better = ">=" if known[metric] == "maximize" else "<="
            problems.append(
                f"search.target={text!r}: {metric} is {known[metric]}d, so its target is "
                f"reached from the other side; write {metric}{better}{value.strip()}"
            )
        try:
            number = float(value)
        except ValueError:
            problems.append(f"search.target={text!r}: {value.strip()!r} is not a number")
            number = math.nan
        if not problems:
            problems += _beyond_range(text, metric, op, number, (ranges or {}).get(metric))
        if problems:
            raise ConfigError(problems)
        return cls(metric, op, number)

    def met(self, value: float | None) -> bool:
        if value is None or value != value:
            return False
        return value >= self.value if self.op == ">=" else value <= self.value

    def met_better(self, a: float, b: float) -> bool:
        """Whether `a` is nearer the target side than `b`."""
        return a > b if self.op == ">=" else a < b

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"


def _beyond_range(
    text: str, metric: str, op: str, number: float, bounds: tuple[float | None, float | None] | None
) -> list[str]:
    """A target the metric can never reach: above its highest value (>=), below its lowest
    (<=)."""
    low, high = bounds or (None, None)
    if op == ">=" and high is not None and number > high:
        edge = f"at most {high:g}"
    elif op == "<=" and low is not None and number < low:
        edge = f"at least {low:g}"
    else:
        return []
    if low is not None and high is not None:
        within = f"between {low:g} and {high:g}"
    else:
        within = f"of {low:g} or more" if low is not None else f"of {high:g} or less"
    return [
        f"search.target={text!r}: {metric} is {edge}, so no trial can reach {number:g}; give "
        f"a value {within}"
    ]


# The metrics of the default task (classification).
OBJECTIVE_METRICS = known_metrics(Classification())

# searched: batch size and accumulation are searched as given. derived: the effective batch is
# searched and each trial uses the largest micro-batch that is predicted to fit the budget.
ACCUMULATION_MODES = ("searched", "derived")


@dataclass(frozen=True)
class RecommendRule:
    """search.recommend: among the completed trials whose `metric` is within `tolerance`
    (relative) of its best, the one best in `prefer`. `known`: metric name -> direction of
    what the study's trials report (known_metrics of its task)."""

    metric: str = VAL_ACC
    tolerance: float = 0.01
    prefer: str = THROUGHPUT_SAMPLES
    known: Mapping[str, str] = field(
        default_factory=lambda: dict(OBJECTIVE_METRICS), compare=False, repr=False
    )

    def __post_init__(self) -> None:
        problems = []
        for key in ("metric", "prefer"):
            name = getattr(self, key)
            if name not in self.known:
                default = RecommendRule.__dataclass_fields__[key].default
                example = default if default in self.known else next(iter(self.known))
                problems.append(
                    f"search.recommend.{key}: unknown metric {name!r}; this task reports "
                    f"{', '.join(self.known)}; e.g. search.recommend.{key}={example}"
                )
        problems += number_problems(
            "search.recommend.tolerance", self.tolerance,
            "a number >= 0 (relative: 0.01 is 1%)", at_least=0, fix=0.01,
        )  # fmt: skip
        if problems:
            raise ConfigError(problems)

    def better(self, name: str, a: float, b: float) -> bool:
        """Whether `a` is a better value of metric `name` than `b`."""
        return a > b if self.known[name] == "maximize" else a < b

    def describe(self) -> str:
        if self.metric == self.prefer or not self.tolerance:
            return f"the best {self.metric}"
        return f"the best {self.prefer} within {self.tolerance:.0%} of the best {self.metric}"


# The study's name is also a directory (its MLflow experiment's artifacts, under
# mlflow.artifact_root): a plain name, never a path.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NAME_CHARACTERS = "ASCII letters, digits, '.', '_' and '-' (first a letter or digit, 128 at most)"


def name_problems(name: object) -> list[str]:
    if isinstance(name, str) and _PLAIN_NAME.fullmatch(name):
        return []
    # é -> e (NFKD splits off the accent), then anything else outside the set -> "-"
    ascii_name = unicodedata.normalize("NFKD", str(name)).encode("ascii", "ignore").decode()
    plain = re.sub(r"[^A-Za-z0-9._-]+", "-", ascii_name).strip("._-")[:128] or "study"
    return [
        f"search.study_name={name!r} is not a plain name: it names the study's MLflow "
        f"artifact directory, so it may hold only {NAME_CHARACTERS}; e.g. "
        f"search.study_name={plain}"
    ]


@dataclass(frozen=True)
class SearchConfig:
    study_name: str
    storage: str
    n_trials: int
    memory_budget: Any
    objectives: tuple[str, ...]  # metric names, in order
    trial_time_budget_s: float | None
    heartbeat_interval_s: int | None
    preflight: bool = True  # predict each trial's peak memory; prune it if over the budget
    # prune when predicted x (1 + this) exceeds the budget; None: from the prediction's
    # measured error for the step's kind (train/memory/preflight.py step_margin), which
    # search/study/validate.py resolves with the study's predictor (`with_margin`)
    preflight_margin: float | None = None
    oom_constraint: bool = True  # tell the sampler OOM trials are infeasible
    accumulation: str = "searched"  # or "derived": see conf/search/default.yaml
    workers: int = 1  # worker processes sharing the study (a --multirun over them)
    # torch intra-op threads per worker (None: automatic), applied by the entry point first,
    # before this config is built (train/parallel/threads.py)
    threads: int | None = None
    # Seconds after which a worker starts no new trial, once one has completed (None: no
    # limit): the study then recommends from what it trained, and the same command resumes.
    timeout_s: float | None = None
    speed_check: bool = True  # time the recommendation's candidates side by side at the end
    # The first trials train, per precision, the largest batch the fit report says fits at the
    # smallest accumulation: the fastest geometries are tried whatever the sampler draws.
    fit_report_first: bool = True
    default_space: bool = True  # an empty search.params searches the four levers (levers.py)
    # How often a trial validates where trainer.val_every_steps is null: None, once an epoch
    # (4 times with search.target); the time to target reads each trial's crossing between two.
    validations_per_epoch: int | None = None
    outage_wait_s: float = 600.0  # mlflow.outage_wait_s: wait for an unreachable MLflow at the end
    recommend: RecommendRule = field(
        default_factory=lambda: RecommendRule()
    )  # which trial the study recommends
    # Metric name -> direction of what the trials report (known_metrics of the task).
    known_metrics: Mapping[str, str] = field(default_factory=lambda: dict(OBJECTIVE_METRICS))
    target: Target | None = None  # search.target
    # A GPU to plan for by name (train/device/gpus.py), e.g. A100-40GB; None: the device trained on
    gpu: str | None = None
    # The budget of the card when search.gpu is given on the command line without
    # search.memory_budget (train/run.py with_gpu_budget): usable (the card less its CUDA
    # context, train/device/gpus.py) or a share of it
    gpu_budget: Any = USABLE
    # Why the margin is what it is, for the fit report's title (Margin.why): set with it
    margin_why: str = ""

    def with_margin(self, margin: Margin) -> SearchConfig:
        """These settings with the margin resolved (train/memory/preflight.py step_margin)."""
        return replace(self, preflight_margin=margin.value, margin_why=margin.why)

    @property
    def margin(self) -> Margin:
        """The margin and why (unresolved: the unmeasured default)."""
        if self.preflight_margin is None:
            return Margin(UNMEASURED_MARGIN)
        return Margin(self.preflight_margin, self.margin_why)

    @property
    def metrics(self) -> list[str]:
        return list(self.objectives)

    @property
    def directions(self) -> list[str]:
        return [self.known_metrics[metric] for metric in self.objectives]

    def __post_init__(self) -> None:
        problems = name_problems(self.study_name)
        problems += integer_problems("search.n_trials", self.n_trials, 1, fix=20)
        if not self.storage:
            problems.append(
                "search.storage is empty; give an Optuna storage URL, e.g. "
                "search.storage=sqlite:///mlruns/optuna.db"
            )
        if not self.objectives:
            problems.append("search.objectives is empty; e.g. search.objectives=[val/acc]")
        twice = sorted({m for m in self.objectives if self.objectives.count(m) > 1})
        if twice:  # two identical Pareto columns, and a study name taken by a mistake
            unique = ",".join(dict.fromkeys(self.objectives))
            problems.append(
                f"search.objectives lists {', '.join(twice)} more than once; each objective is "
                f"one column of the Pareto front: search.objectives=[{unique}]"
            )
        for metric in self.objectives:
            if metric == TO_TARGET and self.target is None:
                problems.append(
                    f"search.objectives: {TO_TARGET} needs search.target, the figure to reach; "
                    "e.g. search.target='val/acc>=0.95'"
                )
            elif metric not in self.known_metrics:
                problems.append(
                    f"search.objectives: unknown metric {metric!r}; this task reports "
                    f"{', '.join(self.known_metrics)}, e.g. "
                    f"search.objectives=[{next(iter(self.known_metrics))}]"
                )

        problems += number_problems(
            "search.trial_time_budget_s", self.trial_time_budget_s, "> 0", above=0,
            or_null=True, hint="e.g. search.trial_time_budget_s=120",
        )  # fmt: skip
        problems += integer_problems(
            "search.heartbeat_interval_s", self.heartbeat_interval_s, 1, or_null=True, fix=60
        )
        problems += number_problems(
            "search.timeout_s", self.timeout_s, "> 0", above=0, or_null=True,
            hint="e.g. search.timeout_s=600 (or null: until search.n_trials)",
        )  # fmt: skip
        for key in (
            "preflight",
            "oom_constraint",
            "speed_check",
            "fit_report_first",
            "default_space",
        ):
            problems += flag_problems(f"search.{key}", getattr(self, key))
        problems += integer_problems(
            "search.validations_per_epoch", self.validations_per_epoch, 1, or_null=True,
            hint="e.g. search.validations_per_epoch=4",
        )  # fmt: skip
        problems += margin_problems(self.preflight_margin)
        problems += choice_problems(
            "search.accumulation", self.accumulation, ACCUMULATION_MODES, "searched"
        )
        problems += number_problems(
            "mlflow.outage_wait_s", self.outage_wait_s, "a number of seconds >= 0",
            at_least=0, fix=600,
        )  # fmt: skip
        problems += gpu_budget_problems(self.gpu_budget)
        problems += self._workers_problems()
        if problems:
            raise ConfigError(problems)

    def _workers_problems(self) -> list[str]:
        workers = self.workers
        if bad := integer_problems(
            "search.workers", workers, 1, hint="e.g. python -m search --multirun search.workers=4"
        ):
            return bad
        if workers > 1 and isinstance(self.storage, str) and self.storage.startswith("sqlite:"):
            return [
                f"search.storage={redact(self.storage)!r} cannot be shared by "
                f"search.workers={workers} processes: SQLite locks the whole database on every "
                "write. Use a journal file on a filesystem all workers see, e.g. "
                "search.storage=journal:mlruns/optuna.journal, or PostgreSQL, e.g. "
                "search.storage=postgresql://user@host:5432/batchfit"
            ]
        return []


# Keys of the `search` section that are not SearchConfig settings: the space and the
# components built from `_target_`; and the fields that do not come from `search`.
SEARCH_COMPONENT_KEYS = ("params", "sampler", "pruner")
_NOT_FROM_SEARCH = ("known_metrics", "outage_wait_s", "margin_why")


def search_keys() -> set[str]:
    """Every key the `search` section may have."""
    settings = {f.name for f in fields(SearchConfig)} - set(_NOT_FROM_SEARCH)
    return settings | set(SEARCH_COMPONENT_KEYS)


def resolve_margin(
    settings: SearchConfig,
    cfg: DictConfig,
    spec: RunSpec,
    searched: Iterable[str] = (),
    workloads: Workloads | None = None,
) -> SearchConfig:
    """`settings` with search.preflight_margin resolved for the study: as given, or (null)
    from the measured error of its kind of step (train/memory/preflight.py step_margin), by
    the base run's predictor, which stays in `workloads` for the fit report and the trials.
    `searched`: the space's keys (one that changes the kind of step keeps the unmeasured
    margin). Only a CUDA target needs the predictor."""
    if settings.preflight_margin is not None:
        return settings.with_margin(step_margin(settings.preflight_margin, None))
    predictor = None
    if spec.target.type == "cuda":
        with contextlib.suppress(PredictionUnsupported):  # measured, at the default margin
            predictor = (workloads or Workloads()).of(cfg).predictor(spec, cfg.optimizer)
    return settings.with_margin(step_margin(None, predictor, searched))
