"""The fit reports of a study's space: one per layout of the searched trainer keys (checkpointing,
data.seq_len, ...), printed as each is predicted, and whether nothing fits.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
import time
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf, open_dict
from optuna.distributions import CategoricalDistribution
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from batchfit.common.checks import ConfigError
from batchfit.search.core.study_config import SearchConfig
from batchfit.search.fit.render import notes, render
from batchfit.search.fit.report import FitReport
from batchfit.search.fit.tabulate import GEOMETRY_KEYS, Tabulation, space_values
from batchfit.search.sampling.space import SearchSpace
from batchfit.train.config import RunSpec
from batchfit.train.memory.predict import replays_beside
from batchfit.train.params import (
    CHECKPOINTING_KEY,
    DEVICES_KEY,
    STRATEGY_KEY,
)
from batchfit.train.workload import Workloads

# Trainer keys a layout sets on the run's TrainerConfig (the rest on the config it builds)
TRAINER_LAYOUT = (CHECKPOINTING_KEY, STRATEGY_KEY, DEVICES_KEY)
MAX_LAYOUTS = 8  # more combinations of the other keys: those are held at their configured value


def layouts(cfg: DictConfig, space: SearchSpace, spec: RunSpec) -> list[dict[str, object]]:
    """Every combination of trainer.activation_checkpointing and the other discrete searched
    keys a step's memory may follow (data.seq_len, a model's width: anything but the
    geometry and the optimizer's and schedule's numbers; not a group choice, e.g. optimizer,
    which a trial composes), as {key: value}. At most MAX_LAYOUTS: the keys listed last in
    the space are dropped first (held at their configured value)."""
    modes = space_values(space, CHECKPOINTING_KEY, spec.trainer.activation_checkpointing)
    axes = {CHECKPOINTING_KEY: [str(m) for m in modes]}
    for key, default in (
        (STRATEGY_KEY, spec.trainer.strategy),
        (DEVICES_KEY, spec.trainer.devices),
    ):
        if key in space.distributions:  # searched: one report per data-parallel layout
            axes[key] = space_values(space, key, default)
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
        Tabulation(layout_cfg, space, layout_spec, settings, workloads)
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


COMMAND = "python -m search.fit"
NOTHING_FITS = (
    "Nothing fits: the smallest batch is predicted with each lever batchfit has, cheapest first"
)
