"""Which batch sizes of your own model fit a card, per precision and accumulation: the fit
report of `python -m search.fit`, as data, for a model built in your own code.

    table = batchfit.fit_table(model, batch, gpu="A100-40GB", precisions=("fp32", "bf16"))
    print(table)                    # rendered as the fit report renders it
    table.largest("bf16")           # the largest batch that fits, every smaller one too
    table.predictions["bf16", 16, 1].peak_bytes
"""

from __future__ import annotations

import io
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from torch import nn

from batchfit.prediction import Prediction, StepPredictor
from batchfit.search.fit.render import notes, render
from batchfit.search.fit.report import Cell, FitReport
from batchfit.train.memory.predict import PredictionUnsupported

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
RENDER_WIDTH = 160  # wide enough for four precisions and the title on one line


@dataclass(frozen=True)
class FitTable:
    """Predicted peaks over batch sizes x precisions x accumulation steps, for one device
    and budget.

    `predictions[precision, batch_size, accum_steps]` is the step's Prediction, or None
    where it has none: the device cannot run the precision (`unsupported` says why), or the
    step cannot run at that size (a BatchNorm over one sample)."""

    predictions: dict[tuple[str, int, int], Prediction | None]
    unsupported: dict[str, str]  # precision -> why the device cannot run it
    batch_sizes: tuple[int, ...]
    precisions: tuple[str, ...]
    accum_steps: tuple[int, ...]
    device: str
    budget_bytes: int | None
    margin: float
    seconds: float
    _report: FitReport

    def largest(self, precision: str, accum_steps: int = 1) -> int | None:
        """The largest batch size that fits with every smaller one of the table fitting too
        (what the fit report's "largest that fits" row says); None when none does."""
        if precision in self.unsupported:
            return None
        return self._report.largest(precision, accum_steps)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per cell: precision, batch_size, accum_steps, peak_bytes, fits, reason."""
        rows = []
        for (precision, batch, accum), found in self.predictions.items():
            cell = self._report.cells[precision, batch, accum]
            rows.append(
                {
                    "precision": precision,
                    "batch_size": batch,
                    "accum_steps": accum,
                    "peak_bytes": None if found is None else found.peak_bytes,
                    "fits": cell.fits,
                    "reason": cell.reason,
                }
            )
        return rows

    def render(self, width: int = RENDER_WIDTH) -> str:
        """The table as `python -m search.fit` prints it, with its notes, as plain text."""
        console = Console(width=width, record=True, file=io.StringIO())  # kept, not shown
        console.print(render(self._report))
        for line in notes(self._report):
            console.print(line, soft_wrap=True, markup=False, highlight=False)
        return console.export_text()

    def __str__(self) -> str:
        return self.render()


def fit_table(
    model: nn.Module,
    batch: Any,
    *,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    precisions: Sequence[str] = ("fp32", "bf16"),
    accum_steps: Sequence[int] = (1,),
    **settings: Any,
) -> FitTable:
    """Predict every batch size x precision x accumulation of `model`'s training step.

    Args:
        model: the model (any device, the meta device included); it is not changed.
        batch: one example batch, as the step receives it (see StepPredictor).
        batch_sizes: the rows: samples per micro-batch per device.
        precisions: the columns: any of "fp32", "tf32", "bf16", "fp16".
        accum_steps: micro-batches per optimizer step; one block of rows each.
        **settings: StepPredictor's keywords: optimizer, loss, forward, task, gpu, budget,
            margin, strategy, devices, grad_clip_norm.

    Returns:
        The FitTable; `str(table)` renders it as the fit report does.

    Raises:
        ValueError: an argument out of its range (an empty list, a size below 1).
        PredictionUnsupported: the model does not run on fake tensors.
    """
    for name, values in (("batch_sizes", batch_sizes), ("precisions", precisions),
                         ("accum_steps", accum_steps)):  # fmt: skip
        if not values:
            raise ValueError(f"{name} is empty; give at least one value")
    step = StepPredictor(model, batch, **settings)
    return tabulate(step, batch_sizes, precisions, accum_steps)


def tabulate(
    step: StepPredictor,
    batch_sizes: Sequence[int],
    precisions: Sequence[str],
    accum_steps: Sequence[int],
) -> FitTable:
    """fit_table over a StepPredictor already built (its predictions cached)."""
    started = time.perf_counter()
    rows, accums = sorted(set(batch_sizes)), sorted(set(accum_steps))
    unsupported = {p: r for p in precisions if (r := step.unsupported(p)) is not None}
    target = step.target
    limit = step.budget_bytes or target.total_bytes
    report = FitReport(
        step.budget_bytes, step.margin, False, list(precisions), unsupported, rows, list(accums)
    )
    report.device = target.name if target.local else f"{target.name} (planned)"
    report.strategy, report.world_size = step.strategy, step.devices
    report.limit_bytes = limit
    report.budget_source = "budget" if step.budget_bytes is not None else "the whole device"
    if target.gpu is not None and step.budget_bytes == target.gpu.usable_bytes:
        report.budget_source = f"what {target.name} offers a process"
    report.margin_why, report.cuda = step.margin_why, target.type == "cuda"
    predictions: dict[tuple[str, int, int], Prediction | None] = {}
    # the most micro-batches first: the predictor derives one micro-batch's step from them
    for precision in precisions:
        for row in rows:
            for accum in sorted(accums, reverse=True):
                found, cell = _cell(step, precision, row, accum, unsupported, limit)
                predictions[precision, row, accum] = found
                report.cells[precision, row, accum] = cell
    report.cells = {key: report.cells[key] for key in sorted(report.cells, key=_order(report))}
    report.seconds = time.perf_counter() - started
    if report.cuda and step.predictor.workspace_source:  # the steps have cuDNN convolutions
        report.workspaces = step.predictor.workspace_source
        report.workspace_cap_bytes = step.predictor.workspaces.cap_bytes
    predictions = {key: predictions[key] for key in report.cells}
    return FitTable(
        predictions, unsupported, tuple(rows), tuple(precisions), tuple(accums),
        report.device, step.budget_bytes, step.margin, report.seconds, report,
    )  # fmt: skip


def _order(report: FitReport):  # noqa: ANN202 - a sort key
    precisions = report.precisions
    return lambda key: (precisions.index(key[0]), key[1], key[2])


def _cell(
    step: StepPredictor,
    precision: str,
    row: int,
    accum: int,
    unsupported: dict[str, str],
    limit: int,
) -> tuple[Prediction | None, Cell]:
    effective = row * accum * step.devices
    if precision in unsupported:
        return None, Cell(effective, row, accum, None, None, unsupported[precision])
    try:
        found = step.predict(row, accum_steps=accum, precision=precision)
    except PredictionUnsupported as error:
        if row != 1:  # the model does not run on fake tensors: no table
            raise
        # BatchNorm over a 1x1 feature map cannot train on a single sample
        return None, Cell(effective, row, accum, None, False, str(error))
    fits = found.fits if found.fits is not None else found.peak_bytes * (1 + step.margin) <= limit
    return found, Cell(effective, row, accum, found.peak_bytes, fits)
