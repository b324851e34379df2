"""Typed, validated settings of one training run (the non-`_target_` part of the config), and
the RunSpec derived from them: what a run will do, before anything is built.

YAML holds the values; the entry points turn them into these frozen dataclasses, which check
themselves in `__post_init__` and report every problem at once as a `ConfigError`.
`train.plan.plan` derives the RunSpec (device, budget, scaled learning rate); it lives here,
not in train/run.py, so that train/workload.py, which train/run.py imports, can take one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchfit.common.checks import (
    ConfigError,
    choice_problems,
    flag_problems,
    integer_problems,
    must_be,
    number_problems,
    section_from_mapping,
)
from batchfit.train.params import (
    ACCUM_KEY,
    BATCH_KEY,
    CHECKPOINTING_KEY,
    DEVICES_KEY,
    EFFECTIVE_PARAM,
    GLOBAL_PARAM,
    LR_PARAM,
    LR_REF_PARAM,
    LR_RULE_PARAM,
    PRECISION_KEY,
    STRATEGY_KEY,
)
from batchfit.train.precision import PRECISIONS

if TYPE_CHECKING:
    import torch

    from batchfit.train.device.spec import DeviceSpec

LR_SCALING_RULES = ("auto", "none", "linear", "sqrt")  # auto: by the optimizer (train/lr.py)
CHECKPOINTING_MODES = ("none", "blocks")  # train/checkpointing.py
DEVICES = ("auto", "cpu", "cuda")
STRATEGIES = ("none", "ddp", "fsdp")  # train/launch/distributed.py
FSDP_SHARDING = ("blocks", "model")  # blocks: each block and the rest; model: one unit
FSDP_PARAM_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class TrainerConfig:
    """How one run trains: its batch geometry, precision and budget."""

    batch_size: int = 32  # samples per micro-batch (what one forward/backward sees)
    accum_steps: int = 1  # micro-batches per optimizer step
    precision: str = "fp32"
    max_epochs: int | None = 3
    max_steps: int | None = None
    val_every_steps: int | None = None  # None: validate at the end of each epoch
    log_every_steps: int = 10
    warmup_steps: int = 2  # optimizer steps left out of throughput timing
    grad_clip_norm: float | None = None
    lr_scaling: str = "auto"
    # The global batch at which optimizer.lr is right. None: the run's own (the rate is used
    # as given), except in a study, which fixes it at the command line's (search/study/driver.py).
    lr_ref_batch_size: int | None = None
    # Steps of the gradient noise scale's split estimator where a step has one micro-batch
    # (train/measure/noise.py): that many steps run as two halves, off the throughput clock. 0:
    # none.
    noise_scale_window: int = 8
    device: str = "auto"
    seed: int = 0
    # Samples per optimizer step. None: batch_size x accum_steps, filled in here; given, it
    # must equal that product (search.accumulation=derived sets the two from it).
    effective_batch_size: int | None = None
    # The device's peak FLOP/s for perf/mfu. None: the table of known GPUs, or on CPU a GEMM
    # probe measured once per machine (train/measure/flops.py).
    peak_flops: float | None = None
    # none | blocks: recompute each block's activations in the backward pass (less memory,
    # about one more forward of compute; train/checkpointing.py).
    activation_checkpointing: str = "none"
    # none: one process on one device. ddp | fsdp: one process per device, `devices` of
    # them on one node (train/launch/distributed.py); batch_size and accum_steps are per device.
    strategy: str = "none"
    devices: int = 1
    fsdp: FSDPConfig | dict | None = None  # FSDP2's settings (trainer.strategy=fsdp)

    def __post_init__(self) -> None:
        problems = []
        fsdp = self.fsdp
        if fsdp is None or isinstance(fsdp, dict):
            try:
                fsdp = section_from_mapping(FSDPConfig, "trainer.fsdp", fsdp or {})
            except ConfigError as error:
                problems += error.problems
                fsdp = FSDPConfig()
            object.__setattr__(self, "fsdp", fsdp)
        problems += integer_problems("trainer.devices", self.devices, 1)
        bad_strategy = choice_problems("trainer.strategy", self.strategy, STRATEGIES, "ddp")
        problems += bad_strategy
        if not bad_strategy and self.strategy == "none" and self.devices != 1:
            problems.append(
                f"trainer.devices={self.devices!r} needs a data-parallel strategy: set "
                "trainer.strategy=ddp or trainer.strategy=fsdp, or trainer.devices=1"
            )
        if self.strategy == "fsdp" and self.precision == "fp16":
            problems.append(
                "trainer.precision=fp16 with trainer.strategy=fsdp needs a sharded gradient "
                "scaler batchfit does not have; use trainer.precision=bf16"
            )
        problems += integer_problems("trainer.batch_size", self.batch_size, 1)
        problems += integer_problems("trainer.accum_steps", self.accum_steps, 1)
        problems += integer_problems("trainer.noise_scale_window", self.noise_scale_window, 0)
        if not problems:
            product = self.batch_size * self.accum_steps
            if self.effective_batch_size is None:
                object.__setattr__(self, "effective_batch_size", product)
            elif self.effective_batch_size != product:
                problems.append(
                    f"trainer.effective_batch_size={self.effective_batch_size!r} is not "
                    f"trainer.batch_size x trainer.accum_steps = {self.batch_size} x "
                    f"{self.accum_steps} = {product}; leave it null, set the two to match, or "
                    "search it with search.accumulation=derived, which sets both from it"
                )
        problems += integer_problems("trainer.log_every_steps", self.log_every_steps, 1)
        problems += integer_problems("trainer.warmup_steps", self.warmup_steps, 0)
        for key in ("lr_ref_batch_size", "max_epochs", "max_steps", "val_every_steps"):
            if getattr(self, key) is not None:
                problems += integer_problems(f"trainer.{key}", getattr(self, key), 1)
        if self.max_epochs is None and self.max_steps is None:
            problems.append(
                "trainer.max_epochs and trainer.max_steps are both null: a run needs a budget; "
                "override with trainer.max_epochs=3"
            )
        problems += choice_problems("trainer.precision", self.precision, PRECISIONS, "bf16")
        problems += choice_problems(
            "trainer.lr_scaling", self.lr_scaling, LR_SCALING_RULES, "linear"
        )
        problems += choice_problems("trainer.device", self.device, DEVICES, "auto")
        problems += choice_problems(
            "trainer.activation_checkpointing",
            self.activation_checkpointing,
            CHECKPOINTING_MODES,
            "blocks",
        )
        problems += number_problems(
            "trainer.peak_flops", self.peak_flops, "FLOP/s > 0", above=0, or_null=True,
            hint="e.g. trainer.peak_flops=989e12 (an H100 in bf16), or null to look it up",
        )  # fmt: skip
        problems += number_problems(
            "trainer.grad_clip_norm", self.grad_clip_norm, "> 0", above=0, or_null=True, fix=1.0
        )
        if problems:
            raise ConfigError(problems)

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all devices: what the learning rate follows."""
        assert self.effective_batch_size is not None
        return self.effective_batch_size * self.devices

    @property
    def distributed(self) -> bool:
        return self.strategy != "none"

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> TrainerConfig:
        return section_from_mapping(cls, "trainer", values)


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP2's settings (torch.distributed.fsdp.fully_shard), `trainer.fsdp.*`; searchable
    like any key."""

    # Free each unit's gathered parameters after its forward and gather them again for the
    # backward (less memory, one more all-gather per unit).
    reshard_after_forward: bool = True
    # What is sharded as a unit: each block (the modules activation checkpointing wraps)
    # and the rest of the model, or the whole model as one.
    sharding: str = "blocks"
    # The dtype the gathered parameters compute in (MixedPrecisionPolicy.param_dtype);
    # gradients are reduced in float32. float32: no cast.
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        problems = flag_problems("trainer.fsdp.reshard_after_forward", self.reshard_after_forward)
        problems += choice_problems("trainer.fsdp.sharding", self.sharding, FSDP_SHARDING, "blocks")
        problems += choice_problems(
            "trainer.fsdp.param_dtype", self.param_dtype, FSDP_PARAM_DTYPES, "bfloat16"
        )
        if problems:
            raise ConfigError(problems)


@dataclass(frozen=True)
class LoaderConfig:
    """How a `Datasets` pair is read (torch.utils.data.DataLoader's settings; in-memory
    `Splits` are gathered directly and ignore them). The `loader:` section of the config."""

    num_workers: int = 0  # worker processes; 0 reads in the training process
    pin_memory: bool | None = None  # None: pinned when training on CUDA
    persistent_workers: bool = True  # keep the validation loader's workers between epochs
    prefetch_factor: int | None = None  # batches each worker reads ahead (None: 2)
    collate_fn: Any = None  # a callable (None: torch's default_collate)

    def __post_init__(self) -> None:
        problems = integer_problems("loader.num_workers", self.num_workers, 0)
        if self.prefetch_factor is not None:
            problems += integer_problems("loader.prefetch_factor", self.prefetch_factor, 1)
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            problems.append(
                must_be("loader.pin_memory", "true, false or null", self.pin_memory,
                        "null (pinned on CUDA)")
            )  # fmt: skip
        problems += flag_problems("loader.persistent_workers", self.persistent_workers)
        if self.collate_fn is not None and not callable(self.collate_fn):
            problems.append(
                f"loader.collate_fn must be a callable, got {self.collate_fn!r}; give "
                "{_target_: my_module.collate, _partial_: true} or null"
            )
        if problems:
            raise ConfigError(problems)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> LoaderConfig:
        return section_from_mapping(cls, "loader", values)


@dataclass(frozen=True)
class RunSpec:
    """What a run will do, derived from the config before anything is built."""

    trainer: TrainerConfig
    device: torch.device  # where it trains
    target: DeviceSpec  # what its memory is predicted for: that device, or search.gpu's
    budget_bytes: int | None
    base_lr: float
    lr: float  # base_lr scaled to the global batch size by lr_rule from lr_ref
    lr_rule: str = "none"  # trainer.lr_scaling, `auto` resolved by the optimizer (train/lr.py)
    lr_ref: int | None = None  # trainer.lr_ref_batch_size, None resolved to the global batch

    def params(self) -> dict[str, Any]:
        """What the run trains with, searched or not, and what follows from it."""
        return {
            BATCH_KEY: self.trainer.batch_size,
            ACCUM_KEY: self.trainer.accum_steps,
            PRECISION_KEY: self.trainer.precision,
            CHECKPOINTING_KEY: self.trainer.activation_checkpointing,
            "optimizer.lr": self.base_lr,
            EFFECTIVE_PARAM: self.trainer.effective_batch_size,
            STRATEGY_KEY: self.trainer.strategy,
            DEVICES_KEY: self.trainer.devices,
            GLOBAL_PARAM: self.trainer.global_batch_size,
            LR_PARAM: self.lr,
            LR_RULE_PARAM: self.lr_rule,
            LR_REF_PARAM: self.lr_ref,
            "device": str(self.device),
        }

    @property
    def limit_bytes(self) -> int:
        """The memory the run may use: its budget, or the whole device without one."""
        return self.budget_bytes or self.target.total_bytes
