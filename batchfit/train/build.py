"""The builders: a run's data, loader, task, model, optimizer and schedule from its config.

The one module of train/ that instantiates `_target_` nodes (hydra.utils.instantiate), so a
trial, its rerun, the predictor and the speed check build alike. A user's builder arguments
that are wrong become ConfigErrors naming the config group. Nothing here caches: a study
shares what it built through train/workload.py.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
from collections.abc import Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from batchfit.common.checks import ConfigError, unknown_keys
from batchfit.train import checkpointing
from batchfit.train.batches import Pipeline, to_device
from batchfit.train.config import LoaderConfig
from batchfit.train.data import Datasets, Splits
from batchfit.train.models import materialize
from batchfit.train.tasks import Classification, Task

# The groups built from `_target_`: a setting their builder does not take is refused before
# the first trial (optimizer and scheduler are partial: otherwise only a trial would call them).
COMPONENTS = ("model", "data", "task", "optimizer", "scheduler")
_HYDRA_KEYS = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")


def check_data_set(cfg: DictConfig) -> None:
    """A ConfigError naming every data.* key still mandatory (???), nested ones included."""
    missing = sorted(f"data.{key}" for key in _missing_keys(cfg.data))
    if missing:
        raise ConfigError(
            [
                f"{key} is not set (???); set it on the command line, e.g. {key}=/path/to/it"
                for key in missing
            ]
        )


def build_data(cfg: DictConfig) -> Splits | Datasets:
    """The data of `cfg.data`, built anew (train/workload.py builds it once per study)."""
    check_data_set(cfg)
    try:
        data = instantiate(cfg.data)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, FileNotFoundError):  # data absent: the user's to fix
            raise ConfigError([_absent(cfg.data, cause)]) from None
        if isinstance(cause, TypeError | ValueError):  # bad builder arguments
            raise ConfigError(
                [f"data ({cfg.data.get('_target_')}) cannot be built: {cause}"]
            ) from None
        raise
    if not isinstance(data, Splits | Datasets):
        raise ConfigError(
            [
                f"data ({cfg.data.get('_target_')}) built a {type(data).__name__}; a data config "
                "builds batchfit.Datasets (two torch Datasets: _target_: batchfit.Datasets "
                "with train: and val:) or batchfit.Splits (in-memory tensors)"
            ]
        )
    return data


def _absent(data: DictConfig, error: FileNotFoundError) -> str:
    """A data file or folder that is not there, named by the data key that gives it (an
    OSError says only "[Errno 2] No such file or directory: '/x'")."""
    if error.filename is None:
        return str(error)
    keys = [key for key, value in _leaves(data, "data.") if str(value) == str(error.filename)]
    if not keys:
        return f"data: {error.strerror or error}: {error.filename!r}"
    return (
        f"{keys[0]}={error.filename!r}: no such file or directory here; give the path of the "
        f"data on this machine, e.g. {keys[0]}=/path/to/it"
    )


def _leaves(node: Any, prefix: str) -> list[tuple[str, Any]]:
    """(dotted key, resolved value) of every value under a config node."""
    if not isinstance(node, DictConfig):
        return [(prefix.rstrip("."), node)]
    return [leaf for key, child in node.items() for leaf in _leaves(child, f"{prefix}{key}.")]


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
                "batchfit.Task (subclass it and override loss, units or metrics)"
            ]
        )
    return task


def build_pipeline(cfg: DictConfig, device: torch.device) -> Pipeline:
    """A pipeline over data built anew: for one-off builds (a saved model's rebuild); a
    study's runs take theirs from train/workload.py, which builds the data once."""
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


def build_model(
    cfg: DictConfig,
    pipeline: Pipeline,
    task: Task,
    activation_checkpointing: str,
    device: torch.device | None = None,
) -> torch.nn.Module:
    """The model of `cfg.model`, given what it asks of the data's `info`, its lazy layers
    materialised on an example batch, its blocks checkpointed for `activation_checkpointing`
    (trainer.activation_checkpointing, validated by TrainerConfig).

    With `device`, built where it trains: the builder runs under `torch.device(device)`,
    PyTorch's default-device context (torch/utils/_device.py `DeviceContext`), so every
    tensor it creates without naming a device (parameters, buffers, what their own
    initialisation draws) is created there, by the same calls in the same order; nothing of
    the weights is made on the host first. On CPU this is exactly the build without it (the
    same seed gives the same weights); on a GPU the draws come from its generator. A
    checkpoint of Hugging Face is read onto the device by transformers itself (it takes
    the context as its device_map: `transformers.integrations.accelerate.
    check_and_set_device_map`). What a builder still puts elsewhere (a tensor it places on
    the CPU by name, a checkpoint it reads with torch.load) is moved after the build:
    that part alone passes through the host. Without `device` (the predictor's fake and
    meta builds, train/memory/fakes.py `fake_first`): built under whatever the caller
    set, as before."""
    kwargs = _builder_kwargs(cfg.model, pipeline.data.info)
    example = pipeline.example(2)  # host data: collated outside the context
    with torch.device(device) if device is not None else nullcontext():
        model = instantiate(cfg.model, **kwargs)
        materialize(model, task, example if device is None else to_device(example, device))
    if device is not None and _elsewhere(model, device):
        model = model.to(device)
    try:
        checkpointing.apply(model, activation_checkpointing)
    except ValueError as error:
        raise ConfigError([str(error)]) from None
    return model


def _elsewhere(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether a parameter or buffer of `model` is off `device` (cuda means the current
    card, as torch.device("cuda") places tensors)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tensors = itertools.chain(model.parameters(), model.buffers())
    return any(t.device != device for t in tensors)


def build_optimizer(
    cfg: DictConfig, params: Iterable[torch.nn.Parameter], lr: float
) -> torch.optim.Optimizer:
    """The optimizer of `cfg.optimizer` (partial) over the trainable ones of `params` (a
    frozen weight, e.g. the base model under LoRA adapters, gets no optimizer state), at
    rate `lr` (the scaled one: RunSpec.lr), whatever optimizer.lr says."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters (every one is frozen)")
    return instantiate(cfg.optimizer, lr=lr)(trainable)


def build_scheduler(cfg: DictConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """The learning-rate schedule of `cfg.scheduler` (partial) over `total_steps`."""
    return instantiate(cfg.scheduler)(optimizer, total_steps=total_steps)


def unimportable_targets(cfg: DictConfig) -> list[str]:
    """The components whose `_target_`'s package cannot be imported from here (a project's
    own module, run from another directory than the one that holds it), each named by its
    key with the ways to make it importable."""
    problems = []
    for group in COMPONENTS:
        node = cfg.get(group)
        target = node.get("_target_") if isinstance(node, DictConfig) else None
        if not isinstance(target, str) or not target:
            continue
        package = target.split(".")[0]
        if importlib.util.find_spec(package) is None:
            problems.append(
                f"{group}._target_={target}: no module named {package!r} can be imported from "
                f"here ({Path.cwd()}); run from the directory that holds {package}/, install "
                f"its project (pip install -e DIR), or put that directory on PYTHONPATH"
            )
    return problems


def unknown_settings(group: str, node: Any) -> list[str]:
    """The keys of a `_target_` node that its builder does not take (none when it takes
    **kwargs or cannot be looked up: building it then says what is wrong); when it takes
    them all, what its `settings_problems` says of their values (`_value_problems`)."""
    if not isinstance(node, DictConfig) or not node.get("_target_"):
        return []
    try:
        builder = get_object(node._target_)
        params = inspect.signature(builder).parameters
    except (ValueError, TypeError, ImportError, AttributeError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return _value_problems(builder, node)
    keys = [k for k in node if k not in _HYDRA_KEYS]
    known = [p for p in params if p != "self"]
    return unknown_keys(group, keys, known, owner=f"a setting of {node._target_}") or (
        _value_problems(builder, node)
    )


def _value_problems(builder: Any, node: DictConfig) -> list[str]:
    """A builder's `settings_problems` attribute, when it has one: a function of its node's
    settings (resolved) returning their problems, each naming its key (hf.py's causal_lm:
    a LoRA rank of 0). Said before the first build, with the config's other problems,
    rather than as the build's error. Settings that do not resolve: the build says why."""
    check = getattr(builder, "settings_problems", None)
    if check is None:
        return []
    try:
        settings = OmegaConf.to_container(node, resolve=True)
    except Exception:  # noqa: BLE001 - a missing or broken interpolation: the build's to say
        return []
    return list(check(settings))
