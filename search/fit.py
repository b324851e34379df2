"""The fit report: which batch sizes fit the memory budget, per accumulation and precision,
without training.

    python -m search.fit +experiment=resnet data=digits

For every precision, batch size and accumulation of the search space, with the base config's
model and optimizer (other searched keys at their configured values), the predicted peak
memory of a training step (train/memory/predict.py: the step computed on fake tensors) and the
largest batch size that fits the budget with the margin to spare (search.preflight_margin, by
default from the prediction's measured error for the kind of step: the title says which and
why, with where the budget comes from). Accumulation matters: the second micro-batch of a
step runs over the gradients the first one left, so it can peak higher. Accumulations whose
peaks are the same at every batch size and precision share one block of rows. A precision
this device cannot run (tf32 off CUDA) is shown as n/a with the reason; trials skip it. With
search.accumulation=derived, the rows are the searched effective batch sizes and each cell
gives the micro-batch x accumulation a trial would train with. A study logs the same table
to its parent MLflow run (`fit_report.json`, `fit_report.txt`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from rich.console import Console
from rich.markup import escape  # messages carry [...]: not markup
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from search.advice import what_would_fit
from search.compose import task_overrides
from search.config import SearchConfig
from search.levers import with_default_space
from search.space import SearchSpace, parse_space
from tracking.config import ConfigError
from tracking.console import config_error, crashed, stopped
from tracking.redact import redact_logging
from train.config import RunSpec, TrainerConfig
from train.memory.budget import format_bytes
from train.memory.device import DeviceSpec
from train.memory.fitting import fits_budget, largest_fitting_batch
from train.memory.predict import MemoryPredictor, PredictionUnsupported, replays_beside
from train.memory.preflight import Margin
from train.overrides import composed, run_checked, unknown_top_level
from train.params import (
    ACCUM_KEY,
    BATCH_KEY,
    CHECKPOINTING_KEY,
    DEVICES_KEY,
    EFFECTIVE_KEY,
    PRECISION_KEY,
    STRATEGY_KEY,
)
from train.precision import unsupported_reason
from train.run import OverBudget, budget_source, with_gpu_budget
from train.workload import Workloads


@dataclass
class Cell:
    effective_batch_size: int  # samples per optimizer step: batch_size x accum_steps
    batch_size: int | None  # the micro-batch (searched: the row's; derived: chosen, or None)
    accum_steps: int | None  # derived: chosen, or None when not even a micro-batch of 1 fits
    peak_bytes: int | None  # None: not predicted (see reason) or, derived, nothing fits
    fits: bool | None  # None: not applicable, the device cannot run the precision
    reason: str | None = None  # why there is no prediction


@dataclass
class FitReport:
    budget_bytes: int | None
    margin: float  # the share of each peak kept free under the budget
    derived: bool
    precisions: list[str]  # every precision of the space, those the device cannot run included
    unsupported: dict[str, str]  # precision -> why the device cannot run it (not predicted)
    batch_sizes: list[int]  # rows: micro-batches (searched) or effective batches (derived)
    accum_steps: list[int | None]  # searched: every accumulation of the space; derived: [None]
    cells: dict[tuple[str, int, int | None], Cell] = field(default_factory=dict)
    seconds: float = 0.0
    # Other searched keys, held at the config's value here (e.g. data.seq_len: memory also
    # follows it; each trial is predicted with its own).
    held: dict[str, object] = field(default_factory=dict)
    checkpointing: str = "none"  # trainer.activation_checkpointing of every cell
    searched: tuple[str, ...] = ()  # the keys of the space
    # The values of the other discrete searched keys memory follows (data.seq_len=128) that
    # this report is for: fit_reports gives one report per combination.
    at: dict[str, object] = field(default_factory=dict)
    device: str = ""  # what is predicted for: "cpu", "A100-40GB (CUDA reserve, planned)"
    strategy: str = "none"  # a data-parallel layout: each cell is one rank's step
    world_size: int = 1
    limit_bytes: int = 0  # what the cells must fit: the budget, or the whole device
    budget_source: str = ""  # where the budget comes from: "90% of H100-80GB", ...
    # why the margin is what it is: "language-model LoRA steps measured within 0.71% on an
    # H200", "search.preflight_margin" (given), "" (CPU's default)
    margin_why: str = ""
    cuda: bool = False  # cells are CUDA's reserve (the caching allocator's), not live tensors
    # cuDNN convolutions' workspaces (train/memory/cudnn.py): "cap" (each call counted at the
    # cap, a bound), "measured" (on this GPU), "none" (not counted: no cap), "" (no
    # convolutions, or not CUDA); the cap
    workspaces: str = ""
    workspace_cap_bytes: int | None = None
    # model.dtype, the weights' dtype (float32, bfloat16, auto); None: the model has no such
    # key, its weights are float32
    model_dtype: str | None = None
    # The peaks of the same cells without activation checkpointing, when this report is a
    # checkpointing one and the report without it was predicted first (fit_reports)
    without_checkpointing: dict[tuple[str, int, int | None], int | None] = field(
        default_factory=dict
    )

    def largest(self, precision: str, accum: int | None = None) -> int | None:
        """The largest row that fits with every smaller row of its column fitting too: what
        a user can count on (a row that cannot train, BatchNorm on one sample, is passed)."""
        largest = None
        for row in self.batch_sizes:
            cell = self.cells[precision, row, accum]
            if cell.reason is not None and cell.peak_bytes is None:
                continue
            if not cell.fits:
                break
            largest = row
        return largest

    def placement_only(self, precision: str, accum: int | None) -> tuple[int, int] | None:
        """(first row that fits above a smaller one that does not, that smaller row), or None:
        the caching allocator placed the larger step's blocks better (on a CPU: its peak is
        not monotonic in the batch)."""
        failed = None
        for row in self.batch_sizes:
            cell = self.cells[precision, row, accum]
            if cell.fits is False and cell.reason is None and failed is None:
                failed = row
            elif cell.fits and failed is not None:
                return row, failed
        return None

    def marked(self, precision: str, row: int, accum: int | None) -> str:
        """The marks of a cell: † it fits above a smaller row that does not; ‡ it needs more
        with activation checkpointing than without."""
        marks = ""
        found = self.placement_only(precision, accum)
        cell = self.cells[precision, row, accum]
        if found is not None and cell.fits and row >= found[0]:
            marks += "†"
        baseline = self.without_checkpointing.get((precision, row, accum))
        if baseline is not None and cell.peak_bytes is not None and cell.peak_bytes > baseline:
            marks += "‡"
        return marks

    def bf16_over_fp32(self) -> list[tuple[int, int | None]]:
        """(row, accumulation) where bf16 is predicted to need more than fp32."""
        if self.derived or not {"fp32", "bf16"} <= set(self.precisions):
            return []
        over = []
        for accum in self.accum_steps:
            for row in self.batch_sizes:
                fp32, bf16 = (self.cells[p, row, accum].peak_bytes for p in ("fp32", "bf16"))
                if fp32 is not None and bf16 is not None and bf16 > fp32:
                    over.append((row, accum))
        return over

    def layout_words(self) -> str:
        """The layout this report is for: activation_checkpointing=blocks, data.seq_len=256."""
        words = []
        if self.checkpointing != "none" or CHECKPOINTING_KEY in self.searched:
            words.append(f"activation_checkpointing={self.checkpointing}")
        if self.strategy != "none":
            words.append(f"{self.strategy} on {self.world_size} devices")
        words += [f"{key}={value}" for key, value in self.at.items()]
        return ", ".join(words) or "as configured"

    def fits_anywhere(self) -> bool:
        return any(cell.fits for cell in self.cells.values())

    def accum_groups(self) -> list[list[int | None]]:
        """The accumulations, those whose cells are the same at every batch size and precision
        together (a prediction runs a step's first two micro-batches only: 2 and 4 usually
        peak alike, 1 lower)."""
        groups: dict[tuple, list[int | None]] = {}
        for accum in self.accum_steps:
            outcome = tuple(
                (c.peak_bytes, c.fits, c.reason)
                for c in (
                    self.cells[p, b, accum] for p in self.precisions for b in self.batch_sizes
                )
            )
            groups.setdefault(outcome, []).append(accum)
        return list(groups.values())

    def rows(self) -> dict[str, list]:
        """Column-wise, for mlflow's log_table: one row per (precision, row, accumulation)."""
        columns: dict[str, list] = {
            "precision": [], "batch_size": [], "accum_steps": [], "effective_batch_size": [],
            "predicted_bytes": [], "fits": [], "reason": [], "activation_checkpointing": [],
            "strategy": [], "world_size": [],
        }  # fmt: skip
        for key in self.at:
            columns[key] = []
        for (precision, _, _), cell in self.cells.items():
            for key, value in self.at.items():
                columns[key].append(value)
            columns["precision"].append(precision)
            columns["activation_checkpointing"].append(self.checkpointing)
            columns["strategy"].append(self.strategy)
            columns["world_size"].append(self.world_size)
            columns["batch_size"].append(cell.batch_size)
            columns["accum_steps"].append(cell.accum_steps)
            columns["effective_batch_size"].append(cell.effective_batch_size)
            columns["predicted_bytes"].append(cell.peak_bytes)
            columns["fits"].append(cell.fits)
            columns["reason"].append(cell.reason)
        return columns


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


def _space_values(space: SearchSpace, key: str, default: object) -> list:
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
    return _Tabulation(cfg, space, spec, settings, workloads or Workloads()).finish()


class _Tabulation:
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
        precisions = [str(p) for p in _space_values(configured, PRECISION_KEY, trainer.precision)]
        unsupported = {
            p: reason for p in precisions if (reason := unsupported_reason(p, spec.target))
        }
        if derived:
            rows = _space_values(space, EFFECTIVE_KEY, trainer.effective_batch_size)
            accums: list[int | None] = [None]
        else:
            rows = _space_values(space, BATCH_KEY, trainer.batch_size)
            accums = sorted({int(a) for a in _space_values(space, ACCUM_KEY, trainer.accum_steps)})
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
        return report


GEOMETRY_KEYS = {BATCH_KEY, ACCUM_KEY, PRECISION_KEY, EFFECTIVE_KEY, CHECKPOINTING_KEY}
# Trainer keys a layout sets on the run's TrainerConfig (the rest on the config it builds)
TRAINER_LAYOUT = (CHECKPOINTING_KEY, STRATEGY_KEY, DEVICES_KEY)
MAX_LAYOUTS = 8  # more combinations of the other keys: those are held at their configured value


def layouts(cfg: DictConfig, space: SearchSpace, spec: RunSpec) -> list[dict[str, object]]:
    """Every combination of trainer.activation_checkpointing and the other discrete searched
    keys a step's memory may follow (data.seq_len, a model's width: anything but the
    geometry and the optimizer's and schedule's numbers; not a group choice, e.g. optimizer,
    which a trial composes), as {key: value}. At most MAX_LAYOUTS: the keys listed last in
    the space are dropped first (held at their configured value)."""
    modes = _space_values(space, CHECKPOINTING_KEY, spec.trainer.activation_checkpointing)
    axes = {CHECKPOINTING_KEY: [str(m) for m in modes]}
    for key, default in (
        (STRATEGY_KEY, spec.trainer.strategy),
        (DEVICES_KEY, spec.trainer.devices),
    ):
        if key in space.distributions:  # searched: one report per data-parallel layout
            axes[key] = _space_values(space, key, default)
    for key, dist in space.distributions.items():
        numeric = key.startswith(("optimizer.", "scheduler."))
        value = OmegaConf.select(cfg, key)
        group = value is None or OmegaConf.is_config(value)  # a config group, not a value
        discrete = isinstance(dist, CategoricalDistribution)
        layout = key in GEOMETRY_KEYS or key in axes
        if discrete and not layout and not numeric and not group:
            axes[key] = list(dist.choices)
    # Too many combinations: the last keys of the space are held at their configured value
    # (the report says so), checkpointing and the first keys kept.
    while len(axes) > 1 and math.prod(map(len, axes.values())) > MAX_LAYOUTS:
        axes.popitem()
    if math.prod(map(len, axes.values())) > MAX_LAYOUTS:
        axes = {CHECKPOINTING_KEY: axes[CHECKPOINTING_KEY]}
    return [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]


def fit_reports(
    cfg: DictConfig,
    space: SearchSpace,
    spec: RunSpec,
    settings: SearchConfig,
    workloads: Workloads | None = None,
    on_report: Callable[[FitReport, int, int], None] | None = None,
    beside: bool = False,
) -> list[FitReport]:
    """fit_report per layout (`layouts`): trainer.activation_checkpointing and the other
    discrete keys the space searches, side by side, so that the report has the cells a
    trial can land in (a trial at seq_len 256 is not predicted at the configured 64). The
    predictors stay in `workloads` (a study's) for its trials. `on_report(report, number,
    total)` is called as each report is done, before the next is predicted (show_fit_reports
    prints it then). Layouts without checkpointing come first: a checkpointing report
    marks the cells that need more than without it. `beside`: a CUDA report's allocator
    replays in a second process (replays_beside), the next table's steps computed here
    while the last cells of one wait for theirs."""
    workloads = workloads or Workloads()
    planned = []
    for layout in layouts(cfg, space, spec):
        layout_cfg = copy.deepcopy(cfg)
        with open_dict(layout_cfg):
            for key, value in layout.items():
                OmegaConf.update(layout_cfg, key, value, force_add=True)
        try:
            trainer = dataclasses.replace(
                spec.trainer,
                activation_checkpointing=str(layout[CHECKPOINTING_KEY]),
                strategy=str(layout.get(STRATEGY_KEY, spec.trainer.strategy)),
                devices=int(layout.get(DEVICES_KEY, spec.trainer.devices)),
            )
        except ConfigError:  # e.g. several devices without a strategy: no trial trains it
            continue
        planned.append((layout, layout_cfg, dataclasses.replace(spec, trainer=trainer)))
    planned.sort(key=lambda each: each[2].trainer.activation_checkpointing != "none")
    tabulations = [
        _Tabulation(layout_cfg, space, layout_spec, settings, workloads)
        for _, layout_cfg, layout_spec in planned
    ]
    reports: list[FitReport] = []
    since = time.perf_counter()
    # CUDA, from `python -m search.fit` only (a study's process holds signal handlers and
    # threads a forked worker must not inherit): the allocator's replays in a second
    # process; while a table's last cells wait for theirs, the next table's steps are
    # computed here.
    with replays_beside() if beside else contextlib.nullcontext():
        for number, tabulation in enumerate(tabulations, 1):
            layout = planned[number - 1][0]
            following = tabulations[number] if number < len(tabulations) else None
            idle = following.advance if following is not None and beside else lambda: False
            report = tabulation.finish(idle, since)
            report.at = {k: v for k, v in layout.items() if k not in TRAINER_LAYOUT}
            report.held = {k: v for k, v in report.held.items() if k not in layout}
            report.without_checkpointing = _without_checkpointing(report, reports)
            reports.append(report)
            if on_report is not None:
                on_report(report, number, len(planned))
            since = time.perf_counter()
    return reports


def _without_checkpointing(
    report: FitReport, before: list[FitReport]
) -> dict[tuple[str, int, int | None], int | None]:
    """The peaks of `report`'s cells in the report of the same layout without activation
    checkpointing, if it is among `before`."""
    if report.checkpointing == "none":
        return {}
    for other in before:
        layout = (other.at, other.strategy, other.world_size)
        if (
            layout == (report.at, report.strategy, report.world_size)
            and other.checkpointing == "none"
        ):
            return {key: cell.peak_bytes for key, cell in other.cells.items()}
    return {}


def nothing_fits(reports: list[FitReport]) -> bool:
    """Whether no cell of any report fits (and there is a cell that was predicted)."""
    predicted = any(c.fits is not None for r in reports for c in r.cells.values())
    return predicted and not any(r.fits_anywhere() for r in reports)


def show_fit_reports(
    console: Console,
    cfg: DictConfig,
    space: SearchSpace,
    spec: RunSpec,
    settings: SearchConfig,
    workloads: Workloads | None = None,
    record: Console | None = None,
    beside: bool = False,
    tables: bool = True,
) -> list[FitReport]:
    """fit_reports, each table printed as soon as it is predicted (to `console`, unless not
    `tables`: a study says `summary_lines` instead, and to `record` too when given: the
    study's fit_report.txt): under a progress bar over the tables on a terminal, with a line
    per table otherwise (a log, a pipe)."""

    def show(report: FitReport, number: int, total: int) -> None:
        table = render(report)
        for each in [c for c in (console if tables else None, record) if c is not None]:
            each.print(table)
            for line in notes(report):
                each.print(line, soft_wrap=True, markup=False, highlight=False)
        if not console.is_terminal:
            console.print(
                f"fit report: table {number}/{total} ({report.layout_words()}) in "
                f"{report.seconds:.1f} s",
                soft_wrap=True,
                highlight=False,
            )

    args = (cfg, space, spec, settings, workloads)
    if not console.is_terminal:
        return fit_reports(*args, on_report=show, beside=beside)
    progress = Progress(
        TextColumn("fit report"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tables"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    with progress:
        task = progress.add_task("tables", total=len(layouts(cfg, space, spec)))

        def advance(report: FitReport, number: int, total: int) -> None:
            show(report, number, total)
            progress.update(task, completed=number, total=total)

        return fit_reports(*args, on_report=advance, beside=beside)


def summary_lines(reports: list[FitReport]) -> list[str]:
    """A study's few lines in place of the tables: per layout, the largest batch that fits
    per precision (the boundary), at each accumulation where they differ."""
    first = reports[0]
    accums = first.accum_steps
    at = (
        "" if first.derived or len(accums) == 1 else f" at accum_steps {'/'.join(map(str, accums))}"
    )
    budget = f"{format_bytes(first.limit_bytes)} ({first.budget_source})"
    if first.strategy != "none":
        budget += " per rank"
    rows = "effective batch" if first.derived else "batch size"
    seconds = sum(r.seconds for r in reports)
    margin = Margin(first.margin, first.margin_why).words()
    lines = [
        f"Fit report for {first.device}: the largest {rows} predicted to fit {budget}, margin "
        f"{margin}, per precision{at} (predicted in {seconds:.1f} s, nothing trained):"
    ]
    boundary = {}
    for report in reports:
        largest = []
        for precision in report.precisions:
            if precision not in report.unsupported:
                found = [str(report.largest(precision, a) or "-") for a in report.accum_steps]
                each = found[0] if len(set(found)) == 1 else "/".join(found)
                largest.append(f"{precision} {each}")
        boundary[report.layout_words()] = ", ".join(largest)
    if len(boundary) > 1 and len(set(boundary.values())) == 1:  # one line says them all
        keys = ", ".join(dict.fromkeys(w.split("=")[0] for k in boundary for w in k.split(", ")))
        boundary = {f"each of the {len(boundary)} layouts ({keys})": next(iter(boundary.values()))}
    lines += [f"  {layout}: {largest}" for layout, largest in boundary.items()]
    lines += [f"  {p}: n/a ({reason}; trials skip it)" for p, reason in first.unsupported.items()]
    return lines


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


def render(report: FitReport) -> Table:
    budget = f"{format_bytes(report.limit_bytes)} ({report.budget_source})"
    what = (
        "effective batch: micro-batch x accumulation, peak"
        if report.derived
        else "predicted peak per batch size x accum_steps"
    )
    said = [f"n/a: {reason}; trials skip it" for reason in report.unsupported.values()]
    if report.held:
        held = ", ".join(f"{key}={value}" for key, value in report.held.items())
        said.append(f"at {held}, as configured; trials predict their own values")
    lever = (
        f"; activation_checkpointing={report.checkpointing}"
        if report.checkpointing != "none" or CHECKPOINTING_KEY in report.searched
        else ""
    )
    lever += "".join(f"; {key}={value}" for key, value in report.at.items())
    device = report.device
    if report.strategy != "none":
        device = f"one rank of {report.strategy} on {report.world_size} x {device}"
        budget += " per rank"
    margin = Margin(report.margin, report.margin_why).words()
    table = Table(
        title=f"Fit report for {device}: {what}; budget {budget}, margin {margin}{lever}",
        caption="\n".join([f"predicted in {report.seconds:.1f} s, nothing trained", *said]),
    )
    table.add_column("effective batch" if report.derived else "batch size", justify="right")
    for precision in report.precisions:
        table.add_column(precision, justify="right")
    for group in report.accum_groups():
        accum = group[0]
        if not report.derived:
            label = f"accum_steps {', '.join(map(str, group))}"
            if len(group) > 1:
                label += ": same peak"
            table.add_row(Text(label, style="bold", justify="left"))
        for row in report.batch_sizes:
            table.add_row(str(row), *(_cell_text(report, p, row, accum) for p in report.precisions))
        table.add_section()
        largest = [
            "[dim]n/a[/dim]"
            if p in report.unsupported
            else f"[bold]{report.largest(p, accum) or '-'}[/bold]"
            for p in report.precisions
        ]
        table.add_row("largest that fits", *largest, end_section=True)
    return table


def _workspace_words(report: FitReport) -> list[str]:
    """What the cells count for cuDNN convolutions' workspaces (train/memory/cudnn.py)."""
    if report.workspaces == "measured":
        return ["cuDNN convolutions: each call's workspace measured on this GPU"]
    if report.workspaces == "none":
        return [
            "cuDNN convolutions: workspaces not counted (no cap: cudnn_workspace_mib=null); "
            "cells may be under-predicted"
        ]
    if report.workspaces != "cap" or report.workspace_cap_bytes is None:
        return []
    cap = format_bytes(report.workspace_cap_bytes)
    return [
        f"cuDNN convolutions: each call's workspace counted at the {cap} cap batchfit sets "
        f"for cuDNN (cudnn_workspace_mib): an upper bound, measured on the GPU itself"
    ]


def notes(report: FitReport) -> list[str]:
    """The lines printed under a report's table: why cells are marked † or ‡, why bf16
    needs more than fp32 where it does, and what cuDNN convolutions' workspaces are counted
    at (outside the table, whose width would wrap them)."""
    lines = (_placement_note(report), _checkpointing_note(report), _bf16_note(report))
    return [line for line in lines if line] + _workspace_words(report)


def _where(report: FitReport, precision: str, accum: int | None) -> str:
    return precision if report.derived else f"{precision}, accum_steps {accum}"


def _placement_note(report: FitReport) -> str | None:
    """Why a cell is marked †, with the first such column's smaller batch that does not fit."""
    for precision in report.precisions:
        for accum in report.accum_steps:
            found = report.placement_only(precision, accum)
            if found is None:
                continue
            row, smaller = found
            peak = report.cells[precision, smaller, accum].peak_bytes
            needs = f"needs {format_bytes(peak)}" if peak is not None else "does not fit"
            example = f"{_where(report, precision, accum)}: {row} fits, {smaller} {needs}"
            cause = (
                "fits only through the caching allocator's block placement"
                if report.cuda
                else "fits, its peak lower than a smaller batch's"
            )
            return (
                f"†: {cause}; a smaller batch does not fit ({example}), so 'largest that "
                "fits' stops below it"
            )
    return None


def _checkpointing_note(report: FitReport) -> str | None:
    """Why a cell is marked ‡, with the first one and its peak without checkpointing."""
    for (precision, row, accum), cell in report.cells.items():
        if "‡" in report.marked(precision, row, accum):
            without = report.without_checkpointing[precision, row, accum]
            return (
                f"‡: needs more with activation checkpointing than without "
                f"({_where(report, precision, accum)}, {row}: {format_bytes(cell.peak_bytes)} "
                f"against {format_bytes(without)}): at this size recomputing a block in the "
                "backward pass holds more than checkpointing saves; train it without"
            )
    return None


def _bf16_note(report: FitReport) -> str | None:
    """Why bf16 needs more than fp32, where it does over float32 weights."""
    over = report.bf16_over_fp32()
    if not over or report.model_dtype not in (None, "float32"):
        return None
    rows: dict[int | None, list[int]] = {}
    for row, accum in over:
        rows.setdefault(accum, []).append(row)
    by_rows: dict[tuple[int, ...], list[int | None]] = {}
    for accum, each in rows.items():
        by_rows.setdefault(tuple(each), []).append(accum)
    where = "; ".join(
        f"batch {', '.join(map(str, each))} (accum_steps {', '.join(map(str, accums))})"
        for each, accums in by_rows.items()
    )
    fix = (
        "load the base in bfloat16 (model.dtype=bfloat16) to halve the weights"
        if report.model_dtype == "float32"
        else "this model has no model.dtype: bf16 pays off only where the activations it "
        "halves outweigh the copies"
    )
    return (
        f"bf16 needs more than fp32 at {where}: autocast keeps the fp32 weights and adds bf16 "
        "copies of the weights each layer uses (kept for the backward pass), so bf16 autocast "
        f"over fp32 weights needs more; {fix}"
    )


def _cell_text(report: FitReport, precision: str, row: int, accum: int | None) -> str:
    cell = report.cells[precision, row, accum]
    if cell.fits is None:
        return "[dim]n/a[/dim]"
    if cell.peak_bytes is None:
        return "[red]does not fit[/red]" if cell.reason is None else "[dim]cannot train[/dim]"
    text = format_bytes(cell.peak_bytes) + report.marked(precision, row, accum)
    if report.derived:
        text = f"{cell.batch_size} x {cell.accum_steps}, {text}"
    return f"[green]{text}[/green]" if cell.fits else f"[red]{text} (OOM)[/red]"


UNSUPPORTED_STATUS = 3  # the model does not run on fake tensors: nothing to report


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from search.validate import validate  # the study's own checks, storage left alone

    composed()
    redact_logging()
    console, errors = Console(), Console(stderr=True)
    if not console.is_terminal:
        console = Console(width=160)
    hydra_cfg = HydraConfig.get()
    name = cfg.search.study_name or "fit-report"  # checked, not used: nothing is recorded
    given = task_overrides(hydra_cfg)  # the command line, which the advice's commands extend
    workloads = Workloads()  # one data set and predictor for the checks and the report
    try:
        problems = unknown_top_level(cfg, given)
        if problems:
            raise ConfigError(problems)
        base = with_gpu_budget(cfg, given)  # search.gpu=CARD: the card's budget

        def compose(trial_overrides: list[str]) -> DictConfig:
            return hydra.compose(config_name="config", overrides=base + trial_overrides)

        space_note = with_default_space(cfg, workloads)
        if space_note:
            console.print(f"[yellow]note[/yellow] {escape(space_note)}", soft_wrap=True)
        checked = validate(cfg, name, compose, open_store=False, workloads=workloads)
    except OverBudget as error:  # no batch helps: what would, predicted
        errors.print(NOTHING_FITS, soft_wrap=True, highlight=False)
        advice = what_would_fit(cfg, given, COMMAND, workloads, error.needed_bytes)
        config_error(errors, ConfigError([*error.problems, "\n".join(advice)]))
    except ConfigError as error:
        config_error(errors, error)
    except Exception as error:  # escaping, Hydra would print the overrides, passwords and all
        crashed(errors, "The fit report failed", f"{type(error).__name__} (above)")
    for note in checked.notes:
        console.print(f"[yellow]note[/yellow] {note}", soft_wrap=True)
    try:
        reports = show_fit_reports(
            console, cfg, checked.space, checked.spec, checked.settings, workloads, beside=True
        )
        if nothing_fits(reports):
            console.print(NOTHING_FITS, soft_wrap=True, highlight=False)
            for line in what_would_fit(cfg, given, COMMAND, workloads):
                console.print(line, soft_wrap=True, markup=False, highlight=False)
    except ConfigError as error:
        config_error(errors, error)
    except PredictionUnsupported as error:
        stopped(
            errors,
            "Memory cannot be predicted for this model",
            f"it does not run on fake tensors ({error}). A study still runs: its trials "
            "measure their memory.",
            UNSUPPORTED_STATUS,
        )
    except Exception as error:  # escaping, Hydra would print the overrides, passwords and all
        crashed(errors, "The fit report failed", f"{type(error).__name__} (above)")


COMMAND = "python -m search.fit"
NOTHING_FITS = (
    "Nothing fits: the smallest batch is predicted with each lever batchfit has, cheapest first"
)


if __name__ == "__main__":
    # The imports' objects out of the collector's reach, as in search/__main__.py.
    gc.freeze()
    try:
        run_checked(main)
    except ConfigError as error:  # an override of a key the config does not have
        config_error(Console(stderr=True), error)
