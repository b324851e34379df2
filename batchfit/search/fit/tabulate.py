"""A fit report's cells computed: the space's batch sizes, accumulations and precisions, each
predicted with the base config's model and optimizer (train/memory/predict.py), searched or
derived.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from batchfit.search.core.study_config import SearchConfig
from batchfit.search.fit.report import Cell, FitReport
from batchfit.search.sampling.space import SearchSpace, parse_space
from batchfit.train.config import RunSpec, TrainerConfig
from batchfit.train.device.sizes import format_bytes
from batchfit.train.device.spec import DeviceSpec
from batchfit.train.memory.fitting import fits_budget, largest_fitting_batch
from batchfit.train.memory.predict import MemoryPredictor, PredictionUnsupported
from batchfit.train.params import (
    ACCUM_KEY,
    BATCH_KEY,
    CHECKPOINTING_KEY,
    EFFECTIVE_KEY,
    PRECISION_KEY,
)
from batchfit.train.plan import budget_source
from batchfit.train.precision import unsupported_reason
from batchfit.train.workload import Workloads


def _values(dist: BaseDistribution | None, fixed: str | None, default: object) -> list:
    """The values a space key takes: its choices, the powers of two in an int range (plus
    its ends), its fixed value, or the config's."""
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    if isinstance(dist, IntDistribution):
        step = dist.step or 1
        powers = [
            2**k
            for k in range(32)
            if dist.low <= 2**k <= dist.high and (2**k - dist.low) % step == 0
        ]
        return sorted({dist.low, *powers, dist.high})
    if fixed is not None:
        return [type(default)(fixed)] if default is not None else [fixed]
    return [default]


def space_values(space: SearchSpace, key: str, default: object) -> list:
    return _values(space.distributions.get(key), space.fixed.get(key), default)


def fit_report(
    cfg: DictConfig,
    space: SearchSpace,
    spec: RunSpec,
    settings: SearchConfig,
    workloads: Workloads | None = None,
) -> FitReport:
    """Predict every (precision, row, accumulation) of the space with the predictor of
    `workloads` (a study's: its trials then predict with the same one); PredictionUnsupported
    when the model cannot run on fake tensors."""
    return Tabulation(cfg, space, spec, settings, workloads or Workloads()).finish()


class Tabulation:
    """One report being predicted: its cells' predictions are started one at a time
    (`advance`: fit_reports has the next table's started while the allocator replays of
    this one's last cells finish in replays_beside's second process), then collected in
    order (`finish`)."""

    def __init__(
        self,
        cfg: DictConfig,
        space: SearchSpace,
        spec: RunSpec,
        settings: SearchConfig,
        workloads: Workloads,
    ) -> None:
        self.cfg, self.spec, self.settings, self.workloads = cfg, spec, settings, workloads
        self.started: float | None = None
        trainer = spec.trainer
        derived = settings.accumulation == "derived"
        # validate drops the precisions this device cannot run from `space`; the report
        # shows them, from the space as configured, with the reason.
        configured = parse_space(cfg.search.params or {})
        precisions = [str(p) for p in space_values(configured, PRECISION_KEY, trainer.precision)]
        unsupported = {
            p: reason for p in precisions if (reason := unsupported_reason(p, spec.target))
        }
        if derived:
            rows = space_values(space, EFFECTIVE_KEY, trainer.effective_batch_size)
            accums: list[int | None] = [None]
        else:
            rows = space_values(space, BATCH_KEY, trainer.batch_size)
            accums = sorted({int(a) for a in space_values(space, ACCUM_KEY, trainer.accum_steps)})
        report = self.report = FitReport(
            spec.budget_bytes,
            settings.margin.value,
            derived,
            precisions,
            unsupported,
            sorted({int(b) for b in rows}),
            accums,
        )
        geometry_keys = {*GEOMETRY_KEYS, "optimizer.lr"}
        report.checkpointing = trainer.activation_checkpointing
        report.strategy, report.world_size = trainer.strategy, trainer.devices
        report.device = _device_words(spec.target)
        report.limit_bytes = spec.limit_bytes
        report.budget_source = budget_source(settings.memory_budget, spec)
        report.margin_why = settings.margin.why
        report.cuda = spec.target.type == "cuda"
        report.model_dtype = (
            str(cfg.model.dtype) if "dtype" in cfg.model and cfg.model.dtype is not None else None
        )
        report.searched = tuple(space.distributions)
        report.held = {
            key: OmegaConf.select(cfg, key)
            for key in space.distributions
            if key not in geometry_keys and OmegaConf.select(cfg, key) is not None
        }
        # The most micro-batches first: the predictor derives the step of one micro-batch
        # from a step of several (train/memory/step_events.py first_micro_batch).
        self.order = [
            (precision, row, accum)
            for precision in precisions
            for row in report.batch_sizes
            for accum in sorted(accums, key=lambda a: -(a or 0))
        ]
        # the cells whose predictions advance starts: searched ones the device can run
        self._todo = iter(
            [] if derived else [cell for cell in self.order if cell[0] not in unsupported]
        )
        self.predictor: MemoryPredictor | None = None
        self.num_train = 0
        self._keys: dict[tuple[str, int, int | None], tuple] = {}  # started: cache keys
        self._error: Exception | None = None  # raised by advance: raised again by finish

    def advance(self) -> bool:
        """Does the next piece of this report's work (its predictor, or one more cell's
        prediction started); False when there is none. An error is kept for finish."""
        if self._error is not None:
            return False
        if self.started is None:
            self.started = time.perf_counter()
        try:
            if self.predictor is None:
                workload = self.workloads.of(self.cfg)
                self.predictor = workload.predictor(self.spec, self.cfg.optimizer)
                self.num_train = workload.num_train
                return True
            for precision, row, accum in self._todo:
                geometry = _geometry(self.spec.trainer, row, accum, precision)
                with contextlib.suppress(PredictionUnsupported):  # _searched_cell says it
                    self._keys[precision, row, accum] = self.predictor.prefetch(
                        geometry, self.num_train, self.spec.limit_bytes
                    )
                return True
        except Exception as error:  # noqa: BLE001 - raised where this report is asked for
            self._error = error
        return False

    def finish(
        self, idle: Callable[[], bool] = lambda: False, since: float | None = None
    ) -> FitReport:
        """The report, its cells predicted in order. While a cell waits for its allocator
        replays, `idle()` is called (other work; False: none left). `seconds`: from its
        first piece of work, or from `since` (the previous report handed over) if later."""
        while self.advance():
            pass
        if self._error is not None:
            raise self._error
        report, predictor, spec, settings = self.report, self.predictor, self.spec, self.settings
        assert predictor is not None and self.started is not None
        trainer = spec.trainer
        for precision, row, accum in self.order:
            key = self._keys.get((precision, row, accum))
            while key is not None and not predictor.ready(key) and idle():
                pass
            if precision in report.unsupported:
                effective = row if accum is None else row * accum
                batch = None if report.derived else row
                reason = report.unsupported[precision]
                cell = Cell(effective, batch, accum, None, None, reason)
            elif report.derived:
                geometry = _geometry(trainer, row, 1, precision)
                cell = _derived_cell(predictor, geometry, self.num_train, spec, settings)
            else:
                geometry = _geometry(trainer, row, accum, precision)
                cell = _searched_cell(predictor, geometry, self.num_train, spec, settings)
            report.cells[precision, row, accum] = cell
        report.cells = {
            key: report.cells[key]
            for key in itertools.product(report.precisions, report.batch_sizes, report.accum_steps)
        }
        report.seconds = time.perf_counter() - max(self.started, since or self.started)
        if report.cuda and predictor.workspace_source:  # the steps have cuDNN convolutions
            report.workspaces = predictor.workspace_source
            report.workspace_cap_bytes = predictor.workspaces.cap_bytes
        report.norms_unknown = report.cuda and predictor.norms_unknown
        return report


GEOMETRY_KEYS = {BATCH_KEY, ACCUM_KEY, PRECISION_KEY, EFFECTIVE_KEY, CHECKPOINTING_KEY}


def _geometry(trainer: TrainerConfig, batch: int, accum: int, precision: str) -> TrainerConfig:
    return dataclasses.replace(
        trainer,
        batch_size=batch,
        accum_steps=accum,
        effective_batch_size=None,  # batch x accum, filled in by TrainerConfig
        precision=precision,
    )


def _searched_cell(
    predictor: MemoryPredictor,
    geometry: TrainerConfig,
    num_train: int,
    spec: RunSpec,
    settings: SearchConfig,
) -> Cell:
    batch, accum = geometry.batch_size, geometry.accum_steps
    assert geometry.effective_batch_size is not None
    try:
        # the limit _prefetch started it with: predict's cache key holds it
        peak = predictor.predict(geometry, num_train, spec.limit_bytes).peak_bytes
    except PredictionUnsupported as error:
        if batch != 1:  # the model does not run on fake tensors: no report
            raise
        # BatchNorm over a 1x1 feature map cannot train on a single sample
        return Cell(geometry.effective_batch_size, batch, accum, None, False, str(error))
    fits = fits_budget(peak, spec.limit_bytes, settings.margin.value)
    return Cell(geometry.effective_batch_size, batch, accum, peak, fits)


def _derived_cell(
    predictor: MemoryPredictor,
    geometry: TrainerConfig,
    num_train: int,
    spec: RunSpec,
    settings: SearchConfig,
) -> Cell:
    effective = geometry.batch_size  # the whole effective batch as one micro-batch
    found = largest_fitting_batch(
        predictor, geometry, num_train, spec.limit_bytes, settings.margin.value
    )
    if found is None:
        return Cell(effective, None, None, None, False)
    batch, prediction = found
    return Cell(effective, batch, effective // batch, prediction.peak_bytes, True)


def _device_words(target: DeviceSpec) -> str:
    if target.type != "cuda":
        return target.name
    where = "" if target.local else ", planned: not on this machine"
    return f"{target.name} ({format_bytes(target.total_bytes)}, CUDA reserve{where})"
