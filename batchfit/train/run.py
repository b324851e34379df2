"""One training run, planned (train/plan.py): `check_builds` builds what a run builds once
before the first one, `run` builds the model, optimizer and schedule on the data of a
train/workload.py Workload and trains, and `train_one` runs it and works out every figure of
the run (its own, memory against the prediction, FLOPs and MFU) before it returns a
`Trained`. `Planned` is the one orchestration of a run, for `python -m train` and every
search trial alike: plan, preflight (the step predicted against the budget), then
`train_one`; so a trial and its rerun execute the same code, and neither calls back into
train/ once the run has returned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.common.checks import ConfigError
from batchfit.tracking.metrics import (
    BUDGET_BYTES,
    CUDNN_WORKSPACE_BYTES,
    PREDICTED_BYTES,
    PREDICTED_RESERVED_BYTES,
    PREDICTION_ERROR,
)
from batchfit.train.batches import Pipeline, steps_plan
from batchfit.train.build import (
    COMPONENTS,
    build_model,
    build_optimizer,
    build_scheduler,
    unimportable_targets,
    unknown_settings,
)
from batchfit.train.config import RunSpec
from batchfit.train.device.sizes import format_bytes
from batchfit.train.device.spec import DeviceSpec
from batchfit.train.loop import Run, fit
from batchfit.train.measure.flops import perf_metrics
from batchfit.train.measure.memory import MemoryMeter, MemoryStats
from batchfit.train.memory.fakes import fake_first
from batchfit.train.memory.fitting import fits_budget
from batchfit.train.memory.predict import MemoryPredictor, Prediction, PredictionUnsupported
from batchfit.train.memory.preflight import Misfit, misfit
from batchfit.train.models import param_bytes
from batchfit.train.plan import plan
from batchfit.train.step import Hooks, Metrics, RunResult
from batchfit.train.tasks import Task
from batchfit.train.workload import Workload, Workloads, workload_key


def _built(group: str, cfg: DictConfig, build: Callable[[], Any]) -> Any:
    try:
        return build()
    except (TypeError, ValueError) as error:
        target = cfg[group].get("_target_")
        raise ConfigError([f"{group} ({target}) cannot be built: {error}"]) from None


def check_builds(cfg: DictConfig, spec: RunSpec, workloads: Workloads | None = None) -> str | None:
    """Data and model build, and the budget holds what training needs whatever the batch:
    parameters, gradients and optimizer state (predicted; the parameters alone when the model
    cannot be predicted, which is returned as a note). Errors in the user's builder arguments
    become ConfigErrors naming the group. What it builds (data, predictor) stays in
    `workloads` for the runs that follow."""
    workload = workloads or Workloads()
    model = check_model_builds(cfg, spec, workload)
    return _budget_note(cfg, spec, workload.of(cfg), model)


def check_model_builds(
    cfg: DictConfig, spec: RunSpec, workloads: Workloads | None = None
) -> torch.nn.Module:
    """The data, the model (on fake tensors), optimizer and schedule build as a run builds
    them; the user's builder-argument errors (the model's own line, e.g. a data.seq_len
    beyond its max_position_embeddings) as ConfigErrors naming the group."""
    problems = unimportable_targets(cfg) or [
        p for group in COMPONENTS for p in unknown_settings(group, cfg.get(group))
    ]
    if problems:
        raise ConfigError(problems)
    workload = (workloads or Workloads()).of(cfg)
    torch.manual_seed(spec.trainer.seed)
    pipeline = workload.pipeline(spec.device)
    mode = spec.trainer.activation_checkpointing
    # Built on fake tensors, as the predictor builds it: a model of any size costs nothing.
    return fake_first(
        lambda: _build_all(cfg, spec, pipeline, workload.task, mode),
        FakeTensorMode(allow_non_fake_inputs=True),
    )


def _build_all(
    cfg: DictConfig, spec: RunSpec, pipeline: Pipeline, task: Task, mode: str
) -> torch.nn.Module:
    """The model, optimizer and schedule, built as a run builds them; builder-argument
    errors as ConfigErrors naming the group."""
    try:
        model = build_model(cfg, pipeline, task, mode)
    except InstantiationException as error:
        if isinstance(error.__cause__, TypeError | ValueError):
            raise ConfigError(
                [f"model ({cfg.model.get('_target_')}) cannot be built: {error.__cause__}"]
            ) from None
        raise
    # Partial builders: called only now, with the model's parameters, and by a trial otherwise.
    optimizer = _built("optimizer", cfg, lambda: build_optimizer(cfg, model.parameters(), spec.lr))
    _built("scheduler", cfg, lambda: build_scheduler(cfg, optimizer, total_steps=10))
    return model


class OverBudget(ConfigError):
    """The budget cannot hold what training needs whatever the batch: the parameters,
    gradients and optimizer state alone (`needed_bytes`). No batch size, accumulation or
    precision of the space helps; search/fit/advice.py says what would."""

    def __init__(self, problems: list[str], needed_bytes: int):
        super().__init__(problems)
        self.needed_bytes = needed_bytes


def _budget_note(
    cfg: DictConfig, spec: RunSpec, workload: Workload, model: torch.nn.Module
) -> str | None:
    """An OverBudget error when the budget cannot hold the parameters, gradients and
    optimizer state; the note that memory cannot be predicted, when it cannot."""
    if spec.budget_bytes is None:
        return None
    try:
        predictor = workload.predictor(spec, cfg.optimizer)
    except PredictionUnsupported as error:
        needed, what, note = param_bytes(model), "the model's parameters alone", str(error)
    else:
        needed, note = predictor.state_bytes, None
        what = "the parameters, gradients and optimizer state alone (predicted)"
    if spec.budget_bytes < needed:
        smallest = _smallest_step(predictor, spec, workload.num_train) if note is None else None
        seq_len = OmegaConf.select(cfg, "data.seq_len", default=None)
        if smallest and seq_len is not None:  # the step's length too: the advice's may differ
            smallest = (f"{smallest[0]}, data.seq_len={seq_len}", smallest[1])
        step = (
            f"; the smallest step ({smallest[0]}) needs {format_bytes(smallest[1])}"
            if smallest
            else ""
        )
        need = smallest[1] if smallest else 2 * needed
        suggest = -(-need * 5 // 4 // 2**20)  # MiB, a quarter above what it needs
        total, device = spec.target.total_bytes, _device_name(spec.target)
        if suggest * 2**20 <= total:
            fix = (
                f"Raise it, e.g. search.memory_budget={suggest}MiB, or pick a smaller model or "
                "optimizer"
            )
        elif need <= total:
            fix = (
                f"Raise it to all of the {format_bytes(total)} {device} has "
                "(search.memory_budget=null), or pick a smaller model or optimizer"
            )
        else:  # no budget on this device holds it: raising it is no advice
            fix = (
                f"That is more than the {format_bytes(total)} {device} has, so no budget on it "
                "holds this run, whatever the batch; the fit report (python -m search.fit "
                "with these overrides) predicts what would: bf16 weights, LoRA, 4-bit "
                "weights, checkpointing, more devices, a larger card"
            )
        raise OverBudget(
            [
                f"search.memory_budget={format_bytes(spec.budget_bytes)} is below the "
                f"{format_bytes(needed)} that {what} need{step}. {fix}"
            ],
            needed,
        )
    return note and f"memory cannot be predicted for this model, so trials measure it ({note})"


def _device_name(target: DeviceSpec) -> str:
    return target.name if target.type == "cuda" else "of memory this machine"


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


def run(
    cfg: DictConfig, spec: RunSpec, hooks: Hooks | None = None, workload: Workload | None = None
) -> RunResult:
    """Build the model (on the device: train/build.py), optimizer and schedule over the data
    of `workload` (cfg's, from a study's Workloads: trials share its data) and train."""
    workload = workload or Workloads().of(cfg)
    assert workload.key == workload_key(cfg), "the workload of another model, data or loader"
    if spec.trainer.distributed:  # one process per device (train/launch/distributed.py)
        from batchfit.train.launch.distributed import launch

        return launch(cfg, spec, hooks, workload)
    torch.manual_seed(spec.trainer.seed)
    pipeline = workload.pipeline(spec.device)
    task = workload.task
    # Built on the device it trains on: its weights never pass through the host first.
    model = build_model(cfg, pipeline, task, spec.trainer.activation_checkpointing, spec.device)
    optimizer = build_optimizer(cfg, model.parameters(), spec.lr)
    _, num_steps = steps_plan(workload.num_train, spec.trainer)
    scheduler = build_scheduler(cfg, optimizer, total_steps=num_steps)
    meter = MemoryMeter(spec.device, spec.budget_bytes)
    hooks = hooks or Hooks()
    return fit(
        Run(model, optimizer, scheduler, pipeline, spec.trainer, spec.device, meter, hooks, task)
    )


@dataclass(frozen=True)
class Trained:
    """A run trained to its end, with every figure of it worked out before `train_one`
    returned: the callers format and log these and call nothing of train/ afterwards."""

    result: RunResult
    metrics: Metrics  # the run's final figures under their metric names (RunResult.metrics)
    figures: Metrics  # those and the last validation's val/*: what a study ranks by
    memory: Metrics  # memory/* against the budget and the prediction (memory_figures)
    perf: Metrics  # perf/*: FLOPs per sample and MFU (perf_figures)
    mfu_note: str | None  # why an MFU above 1 cannot be right, where it is

    @property
    def prediction_error(self) -> float | None:
        """The prediction's error against the measured peak; None where none was made."""
        return self.memory.get(PREDICTION_ERROR)


@dataclass(frozen=True)
class Planned:
    """One run's orchestration, the same for `python -m train` and a study's trial: its plan
    (a RunSpec, from `plan`), its preflight (the step predicted against the budget, before
    anything trains), then `train`: the run and every figure of it, as a `Trained`. The
    callers decide what a misfit means: a trial is pruned (`fits`), `python -m train`
    refuses with what fits instead (`misfit`)."""

    cfg: DictConfig
    spec: RunSpec
    workloads: Workloads  # the caller's: a study's trials share their data and predictors
    prediction: Prediction | None  # None: not predicted (see `unsupported`), or not asked
    unsupported: PredictionUnsupported | None = None  # why the model cannot be predicted

    @property
    def workload(self) -> Workload:
        """Its data, task and memory predictor, built once (when first asked for)."""
        return self.workloads.of(self.cfg)

    @classmethod
    def planned(
        cls, cfg: DictConfig, budget: Any, workloads: Workloads, predict: bool = True
    ) -> Planned:
        """`cfg` planned (train/plan.py `plan`, under the memory `budget`) and predicted: the
        whole of it, for a caller with nothing to check between the two."""
        return cls.of(cfg, plan(cfg, budget), workloads, predict)

    @classmethod
    def of(
        cls,
        cfg: DictConfig,
        spec: RunSpec,
        workloads: Workloads,
        predict: bool = True,
        prediction: Prediction | None = None,
    ) -> Planned:
        """`cfg` planned as `spec` (`plan`'s, its problems already said), on the workload
        `workloads` holds for it, its step predicted unless `predict` is off or a
        `prediction` is given (a derived micro-batch's, found by search)."""
        if not predict or prediction is not None:
            return cls(cfg, spec, workloads, prediction)
        try:
            return cls(cfg, spec, workloads, workloads.of(cfg).predict(spec, cfg.optimizer))
        except PredictionUnsupported as error:
            return cls(cfg, spec, workloads, None, error)

    def fits(self, margin: float) -> bool:
        """Whether the predicted step fits the budget with `margin` to spare (True when
        either is unknown: the run then measures its memory as it trains)."""
        if self.prediction is None or self.spec.budget_bytes is None:
            return True
        return fits_budget(self.prediction.peak_bytes, self.spec.budget_bytes, margin)

    def misfit(self, setting: float | None) -> Misfit | None:
        """None when the run is predicted to fit (or is not predicted); else what fits
        instead (train/memory/preflight.py). `setting`: search.preflight_margin."""
        if self.prediction is None:
            return None
        return misfit(
            self.workload.predictor(self.spec, self.cfg.optimizer),
            self.spec.trainer,
            self.workload.num_train,
            self.prediction,
            self.spec.budget_bytes,
            setting,
        )

    def train(self, hooks: Hooks | None = None) -> Trained:
        return train_one(self.cfg, self.spec, hooks, self.workload, self.prediction)


def train_one(
    cfg: DictConfig,
    spec: RunSpec,
    hooks: Hooks | None,
    workload: Workload,
    prediction: Prediction | None,
) -> Trained:
    """`run`, then the run's figures: the one orchestration of a run after its plan and
    preflight, for `python -m train` and a study's trial alike."""
    result = run(cfg, spec, hooks, workload)
    perf, mfu_note = perf_figures(workload, cfg, spec, result)
    return Trained(
        result,
        metrics=result.metrics(),
        figures=result.figures(),
        memory=memory_figures(spec, prediction, result),
        perf=perf,
        mfu_note=mfu_note,
    )


# What a run measured beyond its own figures, the same for a trial and `python -m train`.


def memory_figures(
    spec: RunSpec, prediction: Prediction | None, measured: MemoryStats | RunResult | None
) -> dict[str, float]:
    """memory/budget_bytes, memory/predicted_bytes (and on CUDA the reserve predicted under
    the run's limit) and memory/prediction_error (train/memory/predict.py `Prediction.error`),
    those known."""
    figures: dict[str, float] = {}
    if spec.budget_bytes is not None:
        figures[BUDGET_BYTES] = spec.budget_bytes
    if prediction is not None:
        figures[PREDICTED_BYTES] = prediction.peak_bytes
        if prediction.reserved_bytes is not None:  # CUDA: beside memory/reserved_bytes
            figures[PREDICTED_RESERVED_BYTES] = prediction.reserved_bytes
        if measured is not None:
            figures[PREDICTION_ERROR] = prediction.error(measured)
        if prediction.workspace_max_bytes is not None:  # cuDNN: at the cap, or measured
            figures[CUDNN_WORKSPACE_BYTES] = prediction.workspace_max_bytes
    return figures


def perf_figures(
    workload: Workload, cfg: DictConfig, spec: RunSpec, result: RunResult
) -> tuple[dict[str, float], str | None]:
    """perf/* of a completed run: FLOPs per sample counted on the predictor's fake model,
    and MFU against the device's peak (train/measure/flops.py), with a note when the MFU is above 1;
    none for a model that does not run on fake tensors."""
    try:
        predictor = workload.predictor(spec, cfg.optimizer)
        flops = predictor.flops_per_sample(spec.trainer.batch_size)
    except PredictionUnsupported:  # building the fake model, or counting on it
        return {}, None
    return perf_metrics(  # per device: a data-parallel run's throughput is all devices'
        flops,
        result.throughput_samples_per_sec / spec.trainer.devices,
        spec.device,
        spec.trainer.precision,
        spec.trainer.peak_flops,
    )
