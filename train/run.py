"""One training run from a composed config: plan (validate and derive), then build and fit.

`python -m train` and every search trial go through `plan` and `run`, so a trial and its
rerun execute the same code.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from train import checkpointing
from train.batches import Pipeline
from train.config import ConfigError, LoaderConfig, TrainerConfig, unknown_keys
from train.data import Datasets, Splits
from train.loop import Hooks, RunResult, fit, steps_plan
from train.lr import scaled_lr
from train.memory import (
    MAX_BUDGET_BYTES,
    MemoryMeter,
    device_total_bytes,
    format_bytes,
    parse_budget,
)
from train.models import materialize, param_bytes
from train.precision import unsupported_reason
from train.predict import MemoryPredictor, Prediction, PredictionUnsupported
from train.tasks import Classification, Task

# The config keys of a run's batch geometry and precision, and the names of what follows
# from them, as RunSpec.params gives them (a trial's user attrs and MLflow params).
BATCH_KEY = "trainer.batch_size"
ACCUM_KEY = "trainer.accum_steps"
PRECISION_KEY = "trainer.precision"
CHECKPOINTING_KEY = "trainer.activation_checkpointing"
EFFECTIVE_KEY = "trainer.effective_batch_size"  # set with search.accumulation=derived
EFFECTIVE_PARAM = "effective_batch_size"
LR_PARAM = "lr_scaled"


@dataclass(frozen=True)
class RunSpec:
    """What a run will do, derived from the config before anything is built."""

    trainer: TrainerConfig
    device: torch.device
    budget_bytes: int | None
    base_lr: float
    lr: float  # base_lr scaled to the effective batch size by trainer.lr_scaling

    def params(self) -> dict[str, Any]:
        """What the run trains with, searched or not, and what follows from it."""
        return {
            BATCH_KEY: self.trainer.batch_size,
            ACCUM_KEY: self.trainer.accum_steps,
            PRECISION_KEY: self.trainer.precision,
            CHECKPOINTING_KEY: self.trainer.activation_checkpointing,
            "optimizer.lr": self.base_lr,
            EFFECTIVE_PARAM: self.trainer.effective_batch_size,
            LR_PARAM: self.lr,
            "device": str(self.device),
        }

    @property
    def limit_bytes(self) -> int:
        """The memory the run may use: its budget, or the whole device without one."""
        return self.budget_bytes or device_total_bytes(self.device)


def resolve_device(name: str) -> torch.device:
    """The device for `trainer.device`; CUDA devices carry their index (the memory-fraction
    and statistics APIs need one)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def plan(cfg: DictConfig, budget: Any) -> RunSpec:
    """Validate the run's settings and derive its numbers; every problem in one ConfigError."""
    problems: list[str] = []
    trainer = None
    try:
        trainer = TrainerConfig.from_mapping(OmegaConf.to_container(cfg.trainer, resolve=True))
    except ConfigError as error:
        problems += error.problems
    device = resolve_device(trainer.device if trainer else "auto")
    if device.type == "cuda" and not torch.cuda.is_available():
        problems.append(
            "trainer.device=cuda but no CUDA device is visible; use trainer.device=auto"
        )
    elif trainer is not None:
        reason = unsupported_reason(trainer.precision, device)
        if reason:
            problems.append(
                f"trainer.precision={trainer.precision} cannot run here: {reason}; "
                "use trainer.precision=fp32 or bf16"
            )
    budget_bytes = None
    try:
        budget_bytes = parse_budget(budget, device_total_bytes(device))
    except ValueError as error:
        problems.append(f"search.memory_budget: {error}")
    problems += _budget_problems(budget, budget_bytes, device)
    base_lr = cfg.optimizer.get("lr")
    if not isinstance(base_lr, int | float) or base_lr <= 0:
        problems.append(
            f"optimizer.lr must be a number > 0, got {base_lr!r}; e.g. optimizer.lr=0.05"
        )
    if problems:
        raise ConfigError(problems)
    lr = scaled_lr(
        float(base_lr), trainer.effective_batch_size, trainer.lr_scaling, trainer.lr_ref_batch_size
    )
    return RunSpec(trainer, device, budget_bytes, float(base_lr), lr)


def _budget_problems(budget: Any, budget_bytes: int | None, device: torch.device) -> list[str]:
    """A budget more than the device has: a GPU's is enforced by its allocator, which cannot
    hand out more than the card holds; the CPU's is accounted against the host's memory,
    which a training step really allocates. 1e30 is a typo, not a plan."""
    total = device_total_bytes(device)
    if 0 < total < MAX_BUDGET_BYTES:
        limit, what = total, f"the {format_bytes(total)} that {device.type} has"
    else:  # not known: only the absurd is refused
        limit, what = MAX_BUDGET_BYTES, "1 PiB"
    if budget_bytes is None or budget_bytes <= limit:
        return []
    return [
        f"search.memory_budget={budget!r} ({format_bytes(budget_bytes)}) is more than {what}; "
        "give at most the device's memory, e.g. search.memory_budget=90% (of the device) or "
        "search.memory_budget=8GiB, or null for the whole device"
    ]


@functools.lru_cache(maxsize=2)
def _data(data_yaml: str) -> Splits | Datasets:
    # Trials of one study share their dataset: building CIFAR-10 takes seconds.
    return instantiate(OmegaConf.create(data_yaml))


def build_data(cfg: DictConfig) -> Splits | Datasets:
    missing = sorted(f"data.{key}" for key in _missing_keys(cfg.data))
    if missing:
        raise ConfigError(
            [
                f"{key} is not set (???); set it on the command line, e.g. {key}=/path/to/it"
                for key in missing
            ]
        )
    try:
        data = _data(OmegaConf.to_yaml(cfg.data, resolve=True))
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, FileNotFoundError):  # data absent: the user's to fix
            raise ConfigError([str(cause)]) from None
        if isinstance(cause, TypeError | ValueError):  # bad builder arguments
            raise ConfigError(
                [f"data ({cfg.data.get('_target_')}) cannot be built: {cause}"]
            ) from None
        raise
    if not isinstance(data, Splits | Datasets):
        raise ConfigError(
            [
                f"data ({cfg.data.get('_target_')}) built a {type(data).__name__}; a data config "
                "builds train.data.Datasets (two torch Datasets: _target_: train.data.Datasets "
                "with train: and val:) or train.data.Splits (in-memory tensors)"
            ]
        )
    return data


def _missing_keys(node: Any, prefix: str = "") -> list[str]:
    """Keys of a config node that are still mandatory (???), dotted, nested ones included."""
    found = []
    items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else []
    for key, _ in items:
        path = f"{prefix}{key}"
        if OmegaConf.is_missing(node, key):
            found.append(path)
        elif isinstance(node.get(key), DictConfig):
            found += _missing_keys(node.get(key), f"{path}.")
    return found


def build_loader(cfg: DictConfig) -> LoaderConfig:
    """loader.* as a LoaderConfig, its collate function instantiated."""
    values = OmegaConf.to_container(cfg.get("loader") or {}, resolve=True)
    collate = values.get("collate_fn")
    if isinstance(collate, dict):
        try:
            values["collate_fn"] = instantiate(cfg.loader.collate_fn)
        except Exception as error:  # noqa: BLE001 - any import or argument error of the user's
            raise ConfigError(
                [f"loader.collate_fn ({collate.get('_target_')}) cannot be built: {error}"]
            ) from None
    elif isinstance(collate, str):
        values["collate_fn"] = _resolve(collate, "loader.collate_fn")
    return LoaderConfig.from_mapping(values)


def _resolve(path: str, key: str) -> Any:
    try:
        return get_object(path)
    except Exception as error:  # noqa: BLE001
        raise ConfigError([f"{key}={path!r} cannot be imported: {error}"]) from None


def build_task(cfg: DictConfig) -> Task:
    """The task of `cfg.task` (classification when the config has none)."""
    node = cfg.get("task")
    if node is None:
        return Classification()
    problems = unknown_settings("task", node)
    if problems:
        raise ConfigError(problems)
    try:
        task = instantiate(node)
    except InstantiationException as error:
        raise ConfigError(
            [f"task ({node.get('_target_')}) cannot be built: {error.__cause__ or error}"]
        ) from None
    if not isinstance(task, Task):
        raise ConfigError(
            [
                f"task ({node.get('_target_')}) built a {type(task).__name__}; a task is a "
                "train.tasks.Task (subclass it and override loss, units or metrics)"
            ]
        )
    return task


def data_params(cfg: DictConfig) -> dict[str, Any]:
    """What the data says of itself (`info`: num_classes, vocab_size, corpus_sha256, ...) as
    run params, `data_info.<name>`: which data a run saw, beside the config that built it."""
    return {f"data_info.{key}": value for key, value in build_data(cfg).info.items()}


def build_pipeline(cfg: DictConfig, device: torch.device) -> Pipeline:
    return Pipeline(build_data(cfg), build_loader(cfg), device)


def _builder_kwargs(node: DictConfig, info: dict[str, Any]) -> dict[str, Any]:
    """What of the data's `info` the model builder takes by name and the config does not set
    (a builder with **kwargs takes all of it)."""
    target = node.get("_target_")
    if not target:
        return {}
    try:
        params = inspect.signature(get_object(target)).parameters
    except (ValueError, TypeError, ImportError, AttributeError):
        return {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in info.items() if (takes_all or k in params) and k not in node}


def build_model(cfg: DictConfig, pipeline: Pipeline, task: Task) -> torch.nn.Module:
    model = instantiate(cfg.model, **_builder_kwargs(cfg.model, pipeline.data.info))
    materialize(model, task, pipeline.example(2))
    try:
        checkpointing.apply(model, cfg.trainer.get(CHECKPOINTING_KEY.split(".")[1], "none"))
    except ValueError as error:
        raise ConfigError([str(error)]) from None
    return model


# One predictor per (model, optimizer, data, device): a study builds it once. A model that
# cannot run on fake tensors is remembered as such.
_PREDICTORS: dict[str, MemoryPredictor | PredictionUnsupported] = {}


def memory_predictor(cfg: DictConfig, spec: RunSpec) -> MemoryPredictor:
    """The memory predictor for this run's model, optimizer, data, loader and task on its
    device; raises PredictionUnsupported when the model cannot run on fake tensors."""
    optimizer = OmegaConf.to_container(cfg.optimizer, resolve=True)
    optimizer.pop("lr", None)  # the rate does not change the memory
    parts = {
        name: OmegaConf.to_container(cfg[name], resolve=True)
        for name in ("model", "data", "task", "loader")
        if cfg.get(name) is not None
    }
    parts.update(
        optimizer=optimizer,
        device=str(spec.device),
        activation_checkpointing=spec.trainer.activation_checkpointing,
    )
    key = OmegaConf.to_yaml(OmegaConf.create(parts))
    if key not in _PREDICTORS:
        if len(_PREDICTORS) >= 4:
            _PREDICTORS.clear()
        pipeline = build_pipeline(cfg, spec.device)
        task = build_task(cfg)
        torch.manual_seed(spec.trainer.seed)
        model = build_model(cfg, pipeline, task)
        try:
            _PREDICTORS[key] = MemoryPredictor(
                model,
                lambda params: instantiate(cfg.optimizer, lr=spec.lr)(params),
                pipeline.shape_example(),
                spec.device,
                task,
            )
        except PredictionUnsupported as error:
            _PREDICTORS[key] = error
    predictor = _PREDICTORS[key]
    if isinstance(predictor, PredictionUnsupported):
        raise predictor
    return predictor


def train_samples(cfg: DictConfig) -> int:
    """Training samples of the run's data."""
    data = build_data(cfg)
    return len(data.train_y) if isinstance(data, Splits) else len(data.train)


def predict(cfg: DictConfig, spec: RunSpec) -> Prediction:
    """Predicted peak memory of this run's training step (PredictionUnsupported: measure)."""
    return memory_predictor(cfg, spec).predict(spec.trainer, train_samples(cfg))


# The groups built from `_target_`: a setting their builder does not take is refused before
# the first trial (optimizer and scheduler are partial: otherwise only a trial would call them).
COMPONENTS = ("model", "data", "task", "optimizer", "scheduler")
_HYDRA_KEYS = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")


def unknown_settings(group: str, node: Any) -> list[str]:
    """The keys of a `_target_` node that its builder does not take (none when it takes
    **kwargs or cannot be looked up: building it then says what is wrong)."""
    if not isinstance(node, DictConfig) or not node.get("_target_"):
        return []
    try:
        params = inspect.signature(get_object(node._target_)).parameters
    except (ValueError, TypeError, ImportError, AttributeError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    keys = [k for k in node if k not in _HYDRA_KEYS]
    known = [p for p in params if p != "self"]
    return unknown_keys(group, keys, known, owner=f"a setting of {node._target_}")


def _built(group: str, cfg: DictConfig, build: Callable[[], Any]) -> Any:
    try:
        return build()
    except (TypeError, ValueError) as error:
        target = cfg[group].get("_target_")
        raise ConfigError([f"{group} ({target}) cannot be built: {error}"]) from None


def check_builds(cfg: DictConfig, spec: RunSpec) -> str | None:
    """Data and model build, and the budget holds what training needs whatever the batch:
    parameters, gradients and optimizer state (predicted; the parameters alone when the model
    cannot be predicted, which is returned as a note). Errors in the user's builder arguments
    become ConfigErrors naming the group."""
    problems = [p for group in COMPONENTS for p in unknown_settings(group, cfg.get(group))]
    if problems:
        raise ConfigError(problems)
    torch.manual_seed(spec.trainer.seed)
    pipeline = build_pipeline(cfg, spec.device)
    try:
        model = build_model(cfg, pipeline, build_task(cfg))
    except InstantiationException as error:
        if isinstance(error.__cause__, TypeError | ValueError):
            raise ConfigError(
                [f"model ({cfg.model.get('_target_')}) cannot be built: {error.__cause__}"]
            ) from None
        raise
    # Partial builders: called only now, with the model's parameters, and by a trial otherwise.
    optimizer = _built(
        "optimizer", cfg, lambda: instantiate(cfg.optimizer, lr=spec.lr)(model.parameters())
    )
    _built("scheduler", cfg, lambda: instantiate(cfg.scheduler)(optimizer, total_steps=10))
    if spec.budget_bytes is None:
        return None
    try:
        predictor = memory_predictor(cfg, spec)
    except PredictionUnsupported as error:
        needed, what, note = param_bytes(model), "the model's parameters alone", str(error)
    else:
        needed, note = predictor.state_bytes, None
        what = "the parameters, gradients and optimizer state alone (predicted)"
    if spec.budget_bytes < needed:
        smallest = _smallest_step(predictor, spec, pipeline.num_train) if note is None else None
        step = (
            f"; the smallest step ({smallest[0]}) needs {format_bytes(smallest[1])}"
            if smallest
            else ""
        )
        suggest = smallest[1] if smallest else 2 * needed
        raise ConfigError(
            [
                f"search.memory_budget={format_bytes(spec.budget_bytes)} is below the "
                f"{format_bytes(needed)} that {what} need{step}. Raise it, e.g. "
                f"search.memory_budget={-(-suggest * 5 // 4 // 2**20)}MiB, or pick a smaller "
                "model or optimizer"
            ]
        )
    return note and f"memory cannot be predicted for this model, so trials measure it ({note})"


def _smallest_step(
    predictor: MemoryPredictor, spec: RunSpec, num_train: int
) -> tuple[str, int] | None:
    """(description, predicted peak) of the smallest batch this model trains with (BatchNorm
    over a 1x1 feature map needs 2 samples, for one)."""
    for batch_size in (1, 2, 4, 8):
        trainer = dataclasses.replace(
            spec.trainer, batch_size=batch_size, accum_steps=1, effective_batch_size=None
        )
        try:
            peak = predictor.predict(trainer, num_train).peak_bytes
        except PredictionUnsupported:
            continue
        return f"batch size {batch_size} in {trainer.precision}", peak
    return None


def run(cfg: DictConfig, spec: RunSpec, hooks: Hooks | None = None) -> RunResult:
    """Build data, task, model, optimizer and schedule on the device and train."""
    torch.manual_seed(spec.trainer.seed)
    pipeline = build_pipeline(cfg, spec.device)
    task = build_task(cfg)
    model = build_model(cfg, pipeline, task).to(spec.device)
    optimizer = instantiate(cfg.optimizer, lr=spec.lr)(model.parameters())
    _, num_steps = steps_plan(pipeline.num_train, spec.trainer)
    scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=num_steps)
    meter = MemoryMeter(spec.device, spec.budget_bytes)
    return fit(model, optimizer, scheduler, pipeline, spec.trainer, spec.device, meter, hooks, task)
