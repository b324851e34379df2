"""One training run from a composed config: plan (validate and derive), then build and fit.

`python -m train` and every search trial go through `plan` and `run`, so a trial and its
rerun execute the same code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from train.config import ConfigError, TrainerConfig
from train.data import Splits
from train.loop import Hooks, RunResult, fit, steps_plan
from train.lr import scaled_lr
from train.memory import MemoryMeter, device_total_bytes, format_bytes, parse_budget
from train.models import materialize, param_bytes
from train.precision import unsupported_reason


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
            "trainer.batch_size": self.trainer.batch_size,
            "trainer.accum_steps": self.trainer.accum_steps,
            "trainer.precision": self.trainer.precision,
            "optimizer.lr": self.base_lr,
            "effective_batch_size": self.trainer.effective_batch_size,
            "lr_scaled": self.lr,
            "device": str(self.device),
        }


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


@functools.lru_cache(maxsize=2)
def _data(data_yaml: str) -> Splits:
    # Trials of one study share their dataset: building CIFAR-10 takes seconds.
    return instantiate(OmegaConf.create(data_yaml))


def build_data(cfg: DictConfig) -> Splits:
    try:
        return _data(OmegaConf.to_yaml(cfg.data, resolve=True))
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, FileNotFoundError):  # data absent: the user's to fix
            raise ConfigError([str(cause)]) from None
        if isinstance(cause, TypeError | ValueError):  # bad builder arguments
            raise ConfigError(
                [f"data ({cfg.data.get('_target_')}) cannot be built: {cause}"]
            ) from None
        raise


def build_model(cfg: DictConfig, data: Splits) -> torch.nn.Module:
    model = instantiate(cfg.model, num_classes=data.num_classes, in_channels=data.in_channels)
    materialize(model, data.train_x[:2])
    return model


def check_builds(cfg: DictConfig, spec: RunSpec) -> None:
    """Data and model build, and the budget holds at least the parameters (training needs
    much more). Errors in the user's builder arguments become ConfigErrors naming the group."""
    torch.manual_seed(spec.trainer.seed)
    data = build_data(cfg)
    try:
        model = build_model(cfg, data)
    except InstantiationException as error:
        if isinstance(error.__cause__, TypeError | ValueError):
            raise ConfigError(
                [f"model ({cfg.model.get('_target_')}) cannot be built: {error.__cause__}"]
            ) from None
        raise
    needed = param_bytes(model)
    if spec.budget_bytes is not None and spec.budget_bytes < needed:
        raise ConfigError(
            [
                f"search.memory_budget={format_bytes(spec.budget_bytes)} is smaller than the "
                f"model's parameters alone ({format_bytes(needed)}); raise it, e.g. "
                f"search.memory_budget={max(1, 4 * needed // 2**20)}MiB, or pick a smaller model"
            ]
        )


def run(cfg: DictConfig, spec: RunSpec, hooks: Hooks | None = None) -> RunResult:
    """Build data, model, optimizer and schedule on the device and train."""
    torch.manual_seed(spec.trainer.seed)
    data = build_data(cfg)
    model = build_model(cfg, data).to(spec.device)
    optimizer = instantiate(cfg.optimizer, lr=spec.lr)(model.parameters())
    _, num_steps = steps_plan(len(data.train_y), spec.trainer)
    scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=num_steps)
    meter = MemoryMeter(spec.device, spec.budget_bytes)
    return fit(model, optimizer, scheduler, data, spec.trainer, spec.device, meter, hooks)
