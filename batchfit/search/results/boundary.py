"""The memory boundary a study reports: per cell of the fit report (precision x accumulation
x the other keys memory follows: sequence length, checkpointing), the largest batch size
that fits and the smallest that does not.

Trials sample a few cells; a boundary taken over them per precision alone mixes cells (an
OOM at accumulation 2 read as the limit at accumulation 1). So the boundary is the fit
report's, kept in the study when it starts (user attr `fit_report`), with what the trials
showed beside it: the batch sizes trained in each cell, and any real OOM (on a GPU, where
memory is paid) where the prediction said it fits. A study whose model cannot be predicted
has no fit report; its boundary is then the trials', per the same cells.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna

from batchfit.search.core.record import OOM_REASONS, PREDICTED_OOM, TrialRecord, records
from batchfit.search.fit.report import FitReport
from batchfit.train.params import ACCUM_KEY, BATCH_KEY, CHECKPOINTING_KEY, PRECISION_KEY

FIT_ATTR = "fit_report"  # the study's user attr: the fit report's cells (fit_cells)
CELL_KEYS = (PRECISION_KEY, ACCUM_KEY)  # then the reports' other keys (`at`, checkpointing)


def fit_cells(reports: Sequence[FitReport]) -> list[dict[str, Any]]:
    """The predicted cells of a study's fit reports (searched accumulation), as JSON-able
    rows for the study: the device cannot run an n/a precision, which has none."""
    cells = []
    for report in reports:
        if report.derived:
            return []  # rows are effective batches there, not a boundary of micro-batches
        for (precision, batch, accum), cell in report.cells.items():
            if cell.fits is None:
                continue
            cells.append(
                {
                    PRECISION_KEY: precision, ACCUM_KEY: accum,
                    CHECKPOINTING_KEY: report.checkpointing, **report.at,
                    BATCH_KEY: batch, "fits": bool(cell.fits), "peak_bytes": cell.peak_bytes,
                }
            )  # fmt: skip
    return cells


@dataclass
class Row:
    """One cell of the boundary: `key` (precision, accumulation, ...) -> its limits."""

    key: dict[str, Any]
    largest: int | None = None  # the largest batch size that fits
    smallest_oom: int | None = None  # the smallest that does not
    # (batch size, accumulation) trained by trials in this cell; real OOMs where it was to fit
    trained: set[tuple[int, int]] = field(default_factory=set)
    measured_oom: set[tuple[int, int]] = field(default_factory=set)


def _key_of(values: Mapping[str, Any], keys: Sequence[str]) -> tuple:
    return tuple(str(values.get(k)) for k in keys)


def _trial_values(trial: TrialRecord) -> dict[str, Any]:
    """A trial's cell coordinates: its searched keys and what it trained with."""
    values = {**trial.params, **trial.run}
    values.setdefault(CHECKPOINTING_KEY, "none")
    return values


def rows(study: optuna.Study) -> tuple[list[str], list[Row]]:
    """(the cell keys, the boundary per cell): the fit report's when the study has one, the
    trials' otherwise; the trials' evidence beside it either way."""
    cells = study.user_attrs.get(FIT_ATTR) or []
    trials = study.get_trials(deepcopy=False)
    keys = list(CELL_KEYS)
    extra = {k for c in cells for k in c} - {*keys, BATCH_KEY, "fits", "peak_bytes"}
    layout = sorted(k for k in extra if len({str(c.get(k)) for c in cells}) > 1)
    keys += layout
    found: dict[tuple, Row] = {}
    for cell in cells:
        row = found.setdefault(_key_of(cell, keys), Row({k: cell.get(k) for k in keys}))
        batch = int(cell[BATCH_KEY])
        if cell["fits"]:
            row.largest = max(batch, row.largest or batch)
        else:
            row.smallest_oom = min(batch, row.smallest_oom or batch)
    for trial in records(trials):
        _add_trial(found, keys, trial, predicted=bool(cells))
    ordered = sorted(found.values(), key=lambda r: _key_of(r.key, keys))
    return keys, ordered


def _add_trial(
    found: dict[tuple, Row], keys: list[str], trial: TrialRecord, predicted: bool
) -> None:
    values = _trial_values(trial)
    batch, reason = values.get(BATCH_KEY), trial.outcome.reason
    oom = reason_oom(reason)
    trained = trial.outcome.peak_bytes is not None and not oom
    if batch is None or values.get(PRECISION_KEY) is None or not (oom or trained):
        return  # failed before its memory was known: no evidence either way
    key = _key_of(values, keys)
    if key not in found:
        if predicted:
            return  # a cell the fit report does not have (another configured value)
        found[key] = Row({k: values.get(k) for k in keys})
    row, batch = found[key], int(batch)
    geometry = (batch, int(values.get(ACCUM_KEY) or 1))
    if oom:
        if reason != PREDICTED_OOM and predicted:
            row.measured_oom.add(geometry)
        if not predicted:
            row.smallest_oom = min(batch, row.smallest_oom or batch)
    else:  # it trained past the memory check
        row.trained.add(geometry)
        if not predicted:
            row.largest = max(batch, row.largest or batch)


def reason_oom(reason: object) -> bool:
    return reason in OOM_REASONS


def grouped(keys: list[str], found: list[Row]) -> list[tuple[dict[str, Any], Row]]:
    """Rows that differ only in accumulation and agree on their limits, as one row whose
    accumulation lists them ('2, 4'), as the fit report groups them."""
    merged: dict[tuple, tuple[dict[str, Any], Row]] = {}
    for row in found:
        rest = tuple(str(row.key[k]) for k in keys if k != ACCUM_KEY)
        group = (rest, row.largest, row.smallest_oom)
        if group in merged:
            key, first = merged[group]
            key[ACCUM_KEY] = f"{key[ACCUM_KEY]}, {row.key[ACCUM_KEY]}"
            first.trained |= row.trained
            first.measured_oom |= row.measured_oom
        else:
            merged[group] = (
                dict(row.key),
                Row(
                    row.key, row.largest, row.smallest_oom, set(row.trained), set(row.measured_oom)
                ),
            )
    return list(merged.values())


def table(study: optuna.Study) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the boundary as the summary prints it."""
    keys, found = rows(study)
    header = [k.rsplit(".", 1)[-1] for k in keys]
    header += ["largest that fits", "smallest OOM", "trained"]
    lines = []
    for key, row in grouped(keys, found):
        several = "," in str(key[ACCUM_KEY])  # name the accumulation of each
        trained = _geometries(row.trained, several) or "-"
        oom = str(row.smallest_oom or "-")
        if row.measured_oom:
            oom += f" (real OOM at {_geometries(row.measured_oom, several)})"
        lines.append([*(str(key[k]) for k in keys), str(row.largest or "-"), oom, trained])
    return header, lines


SEQ_LEN_KEY = "data.seq_len"


def frontier(cells: Sequence[Mapping[str, Any]], searched: Sequence[str]) -> list[dict]:
    """The first trials a study enqueues (search.fit_report_first): per precision, the
    cell with the most samples (tokens, with a searched data.seq_len) per micro-batch that
    fits at the smallest accumulation, as params of the searched keys; the sampler draws
    the rest (the learning rate)."""
    fitting = [c for c in cells if c["fits"]]
    if not fitting or BATCH_KEY not in searched:
        return []
    smallest = min(int(c[ACCUM_KEY]) for c in fitting)
    best: dict[str, Mapping[str, Any]] = {}
    for cell in (c for c in fitting if int(c[ACCUM_KEY]) == smallest):
        size = int(cell[BATCH_KEY]) * int(cell.get(SEQ_LEN_KEY) or 1)
        precision = cell[PRECISION_KEY]
        if precision not in best or size > int(best[precision][BATCH_KEY]) * int(
            best[precision].get(SEQ_LEN_KEY) or 1
        ):
            best[precision] = cell
    return [{k: v for k, v in cell.items() if k in searched} for cell in best.values()]


def _geometries(pairs: set[tuple[int, int]], with_accum: bool) -> str:
    return ", ".join(f"{b}x{a}" if with_accum else str(b) for b, a in sorted(pairs))


def title(study: optuna.Study) -> str:
    source = "the fit report's prediction" if study.user_attrs.get(FIT_ATTR) else "the trials"
    return f"Memory boundary (batch size per cell; {source})"
