"""A run planned from its composed config: `plan` validates and derives a RunSpec (every problem at
once): the device it trains on and the one its memory is planned for, the precision, the memory
budget (bytes, a size, or a share of a card named by search.gpu) and the scaled learning rate;
and the budget's and learning rate's overrides a study and `python -m train` derive from the
command line.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from batchfit.common.checks import ConfigError, number_problems
from batchfit.common.overrides import override_key
from batchfit.train.config import RunSpec, TrainerConfig
from batchfit.train.device.cudnn_workspaces import CONFIG_KEY as CUDNN_CAP_KEY
from batchfit.train.device.cudnn_workspaces import DEFAULT_CAP_MIB
from batchfit.train.device.cudnn_workspaces import apply_cap as apply_cudnn_cap
from batchfit.train.device.cudnn_workspaces import cap_problems as cudnn_cap_problems
from batchfit.train.device.gpus import Gpu
from batchfit.train.device.sizes import MAX_BUDGET_BYTES, format_bytes, parse_budget
from batchfit.train.device.spec import DeviceSpec, device_spec
from batchfit.train.lr import rule_for, scaled_lr
from batchfit.train.precision import unsupported_reason


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
    target, budget_bytes = _target(cfg, device, problems), None
    if trainer is not None and device.type == "cuda" and torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if trainer.devices > visible:
            problems.append(
                f"trainer.devices={trainer.devices} but {visible} CUDA device(s) are visible; "
                f"use trainer.devices={visible} or fewer"
            )
    if target is not None and trainer is not None:
        problems += _precision_problems(trainer.precision, target)
    quantization = OmegaConf.select(cfg, "model.quantization", default="none")
    if trainer is not None and trainer.strategy == "fsdp" and quantization not in (None, "none"):
        problems.append(
            f"model.quantization={quantization} with trainer.strategy=fsdp: FSDP2 does not "
            "shard bitsandbytes' packed 4-bit weights as batchfit builds them; use "
            "trainer.strategy=ddp, or model.quantization=none"
        )
    if target is not None:
        try:
            budget_bytes = card_budget_bytes(budget, target)
        except ValueError as error:
            problems.append(f"search.memory_budget: {error}")
        problems += _budget_problems(budget, budget_bytes, target)
        if trainer is not None and _ranks_share_the_host(budget, target, trainer.devices):
            whole = budget_bytes if budget_bytes is not None else target.total_bytes
            budget_bytes = whole // trainer.devices  # each rank's share of the host's memory
    base_lr = cfg.optimizer.get("lr")
    problems += number_problems(
        "optimizer.lr", base_lr, "a number > 0", above=0, hint="e.g. optimizer.lr=0.05"
    )
    if problems:
        raise ConfigError(problems)
    rule = trainer.lr_scaling
    if rule == "auto":
        rule = rule_for(str(cfg.optimizer.get("_target_", "")))
    ref = trainer.lr_ref_batch_size or trainer.global_batch_size
    # to the global batch: all devices' samples per optimizer step
    lr = scaled_lr(float(base_lr), trainer.global_batch_size, rule, ref)
    return RunSpec(trainer, device, target, budget_bytes, float(base_lr), lr, rule, ref)


BUDGET_KEY = "search.memory_budget"
GPU_KEY = "search.gpu"
GPU_BUDGET_KEY = "search.gpu_budget"


# A budget of what the card offers a process: its memory less the CUDA context and what the
# runtime keeps (train/device/gpus.py Gpu.usable_bytes); search.gpu_budget's default
USABLE = "usable"


def is_share(budget: Any) -> bool:
    """Whether a budget is a share of the device (90%)."""
    return isinstance(budget, str) and budget.strip().endswith("%")


def follows_card(budget: Any) -> bool:
    """Whether a budget follows the card it is for: all of it (None), a share, or usable."""
    return budget is None or budget == USABLE or is_share(budget)


def card_budget_bytes(budget: Any, target: DeviceSpec | Gpu) -> int | None:
    """The bytes of a budget on a device (or a card of the table): `usable` is the card's
    usable_bytes; anything else as parse_budget reads it (None: no budget)."""
    card = target if isinstance(target, Gpu) else target.gpu
    if budget == USABLE:
        if card is None:
            raise ValueError(
                f"{USABLE!r} is what a GPU offers a process, and this device is the CPU; give a "
                "size or a share, e.g. search.memory_budget=8GiB, or plan for a card with "
                "search.gpu=A100-40GB"
            )
        return card.usable_bytes
    return parse_budget(budget, target.total_bytes)


def gpu_budget_problems(share: Any) -> list[str]:
    """What is wrong with search.gpu_budget: `usable` (the card less its CUDA context) or a
    share of the card, e.g. 90%."""
    if share == USABLE:
        return []
    if is_share(share):
        try:
            parse_budget(share, 2**40)
            return []
        except ValueError:
            pass
    return [
        f"{GPU_BUDGET_KEY} must be {USABLE} (the card less its CUDA context) or a share of the "
        f"card named by {GPU_KEY}, got {share!r}; override with {GPU_BUDGET_KEY}={USABLE} or "
        f"{GPU_BUDGET_KEY}=90%"
    ]


def with_gpu_budget(cfg: DictConfig, overrides: Sequence[str]) -> list[str]:
    """A card named on the command line is the budget: with `search.gpu=CARD` there and no
    `search.memory_budget` beside it, the run plans for search.gpu_budget of that card
    (`usable`: what the card offers a process, its memory less the CUDA context and what the
    runtime keeps, train/device/gpus.py; or a share, e.g. 90%), whatever budget an
    experiment sets for the machine at hand (gpt's 160MiB). cfg's search.memory_budget is set
    to it in place, and `overrides` are returned with it added, so that the configs composed
    from them (a study's trials, a rerun command) plan the same. A budget on the command line
    wins (`search.memory_budget=null`: the whole card); an experiment that names its card
    itself keeps its own budget. Anything else: `overrides` as they are."""
    keys = {override_key(o) for o in overrides}
    if GPU_KEY not in keys or BUDGET_KEY in keys or OmegaConf.select(cfg, GPU_KEY) is None:
        return list(overrides)
    share = cfg.search.gpu_budget
    problems = gpu_budget_problems(share)
    if problems:
        raise ConfigError(problems)
    cfg.search.memory_budget = share
    return [*overrides, f"{BUDGET_KEY}={share}"]


LR_REF_KEY = "trainer.lr_ref_batch_size"
LR_SCALING_KEY = "trainer.lr_scaling"


def with_lr_reference(
    cfg: DictConfig, overrides: Sequence[str], searched: Iterable[str] = ()
) -> list[str]:
    """A study's reference batch for its learning rate: the command line's global batch
    (trainer.batch_size x accum_steps x devices, before any searched value), where
    trainer.lr_ref_batch_size is null and a rule scales the rate (trainer.lr_scaling not
    none, or searched). The search samples optimizer.lr as the rate at that batch, and
    every geometry trains at the rate its rule scales it to, so trials of different batches
    compare like with like. cfg is set in place and `overrides` returned with the key added,
    so that trials, rerun commands and best.yaml train at the same rate. Anything else:
    `overrides` as they are."""
    trainer = cfg.trainer
    if trainer.get("lr_ref_batch_size") is not None:
        return list(overrides)
    scaling = trainer.get("lr_scaling", "none")
    if scaling == "auto":
        scaling = rule_for(str(cfg.optimizer.get("_target_", "")))
    if scaling == "none" and LR_SCALING_KEY not in set(searched):
        return list(overrides)
    batch = trainer.get("effective_batch_size") or trainer.batch_size * trainer.accum_steps
    reference = int(batch) * int(trainer.get("devices", 1))
    trainer.lr_ref_batch_size = reference
    return [*overrides, f"{LR_REF_KEY}={reference}"]


def _ranks_share_the_host(budget: Any, target: DeviceSpec, devices: int) -> bool:
    """Data-parallel ranks on this machine's CPU share its memory: a budget that follows
    the device (all of it, a share) is split between them."""
    return target.type != "cuda" and devices > 1 and follows_card(budget) and budget != USABLE


def budget_source(budget: Any, spec: RunSpec) -> str:
    """Where a run's budget comes from, as a report's title says it: "A100-40GB's 39.4 GiB
    less 512.0 MiB CUDA context" (usable, search.gpu_budget's default when only the card was
    named; "and 438.0 MiB it does not report" where the table's total is not CUDA's, as the
    H100's nvidia-smi total), "90% of H100-80GB" (a share of the card), "all of H100-80GB"
    (none), or "search.memory_budget" (a size)."""
    where = spec.target.name if spec.target.type == "cuda" else "this machine's memory"
    ranks = spec.trainer.devices
    if _ranks_share_the_host(budget, spec.target, ranks):
        of = f"{budget.strip()} of" if is_share(budget) else "all of"
        return f"{of} {where}, shared by its {ranks} ranks"
    if spec.budget_bytes is None:
        return f"all of {where}"
    if budget == USABLE and spec.target.gpu is not None:
        card = spec.target.gpu
        unreported = card.unreported_bytes
        return (
            f"{card.name}'s {format_bytes(spec.target.total_bytes)} less "
            f"{format_bytes(card.context_bytes)} CUDA context"
            + (f" and {format_bytes(unreported)} it does not report" if unreported else "")
        )
    if is_share(budget):
        return f"{budget.strip()} of {where}"
    return "search.memory_budget"


def _target(cfg: DictConfig, device: torch.device, problems: list[str]) -> DeviceSpec | None:
    """The DeviceSpec predicted for (search.gpu's card, or `device`); None, with the
    problem added, when there is none."""
    if device.type == "cuda" and not torch.cuda.is_available():
        problems.append(
            "trainer.device=cuda but no CUDA device is visible; use trainer.device=auto"
        )
        return None
    cap = OmegaConf.select(cfg, CUDNN_CAP_KEY, default=DEFAULT_CAP_MIB)
    cap_errors = cudnn_cap_problems(cap)
    if cap_errors:
        problems += cap_errors
        return None
    apply_cudnn_cap(cap)  # before cuDNN's first convolution, and what predictions count
    try:
        return device_spec(device, OmegaConf.select(cfg, "search.gpu"))
    except ValueError as error:
        problems.append(str(error))
        return None


def _precision_problems(precision: str, target: DeviceSpec) -> list[str]:
    reason = unsupported_reason(precision, target)
    if not reason:
        return []
    where = "here" if target.local else f"on {target.name}"
    others = [p for p in ("fp32", "bf16", "fp16") if not unsupported_reason(p, target)]
    return [
        f"trainer.precision={precision} cannot run {where}: {reason}; "
        f"use trainer.precision={' or '.join(others[:2] or ['fp32'])}"
    ]


def planned_elsewhere(spec: RunSpec) -> str | None:
    """Why a run planned for `search.gpu` cannot train here (a GPU this machine lacks), or
    None when it can."""
    if spec.target.local:
        return None
    gpu = spec.target.name
    where = (
        f"a GPU this run does not train on (trainer.device={spec.device.type})"
        if torch.cuda.is_available()
        else f"a GPU this machine does not have (it would train on {spec.device.type})"
    )
    return (
        f"search.gpu={gpu} plans for {where}; `python -m search.fit ... search.gpu={gpu}` "
        "reports what fits on it, and a study or a run of it trains where the GPU is; drop "
        "search.gpu to train here"
    )


def _budget_problems(budget: Any, budget_bytes: int | None, target: DeviceSpec) -> list[str]:
    """A budget more than the device has: a GPU's is enforced by its allocator, which cannot
    hand out more than the card holds; the CPU's is accounted against the host's memory,
    which a training step really allocates. 1e30 is a typo, not a plan."""
    total = target.total_bytes
    if 0 < total < MAX_BUDGET_BYTES:
        limit, what = total, f"the {format_bytes(total)} that {target.name} has"
    else:  # not known: only the absurd is refused
        limit, what = MAX_BUDGET_BYTES, "1 PiB"
    if budget_bytes is None or budget_bytes <= limit:
        return []
    return [
        f"search.memory_budget={budget!r} ({format_bytes(budget_bytes)}) is more than {what}; "
        "give at most the device's memory, e.g. search.memory_budget=90% (of the device) or "
        "search.memory_budget=8GiB, or null for the whole device"
    ]
