"""How a trial ended, and recording it: `ended` builds the trial's frozen `Outcome`
(search/core/record.py) once, from what its run left; its TrialRecord nests it and is written to
the Optuna trial (user attrs, memory constraint) and logged to its MLflow run (figures,
tags, name, status); `end` then hands Optuna the objective values, or the exception that
tells it the trial was pruned or failed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import optuna

from batchfit.search.core.record import (
    CONSTRAINT,
    ERROR,
    OOM_REASONS,
    OVER_DATA,
    PREDICTED_OOM,
    PRUNER,
    Outcome,
    TrialRecord,
)
from batchfit.search.core.study_config import SearchConfig
from batchfit.tracking.metrics import (
    BUDGET_BYTES,
    PEAK_BYTES,
    PREDICTED_BYTES,
    PREDICTED_RESERVED_BYTES,
    PREDICTION_ERROR,
    PREDICTION_S,
    PROJECTED_S,
    RESERVED_BYTES,
    STORAGE_S,
    TRACKING_S,
    TRIAL_S,
    VAL_LOSS,
    VAL_PREFIX,
)
from batchfit.tracking.runs import RunLog
from batchfit.tracking.tags import PRUNE_REASON_TAG, STATE_TAG
from batchfit.train.config import RunSpec
from batchfit.train.measure.memory import MemoryStats
from batchfit.train.memory.predict import Prediction
from batchfit.train.run import Trained
from batchfit.train.step import RunResult

MLFLOW_MESSAGE_CHARS = 5000


class TrialFailed(Exception):
    """This trial failed; the study goes on (the only exception `optimize` catches)."""


def ended(
    state: str,
    reason: str | None = None,
    message: str | None = None,
    *,
    trained: Trained | None = None,
    memory: MemoryStats | None = None,
    oom_peak_bytes: int | None = None,
    prediction: Prediction | None = None,
    extra: Mapping[str, float] | None = None,
    target_metric: str | None = None,
    **known: Any,
) -> Outcome:
    """The outcome of a trial that ended in `state`, from what it left, each figure worked
    out here once: a completed run's figures (`trained`, train/run.py's, worked out before the
    run returned; with the `extra` ones: perf/*, time/to_target_s), or what a stopped one
    measured past its memory check (`memory`) or when it ran out (`oom_peak_bytes`), and the
    memory `prediction` it was configured with; `target_metric`: search.target's, whose
    validation curve is kept beside val/loss's for the time to target.
    `known`: the rest of Outcome's fields by name (probe_s_per_sample, projected_s,
    mfu_note, error_traceback)."""
    result = trained.result if trained else None
    peak = result.peak_bytes if result else oom_peak_bytes
    if peak is None and memory is not None:
        peak = memory.peak_bytes
    logged: dict[str, float] = {}  # for MLflow only
    if prediction is not None:
        logged[PREDICTION_S] = prediction.seconds
        if prediction.reserved_bytes is not None:  # CUDA: beside memory/reserved_bytes
            logged[PREDICTED_RESERVED_BYTES] = prediction.reserved_bytes
    if result is None and memory is not None and memory.reserved_bytes is not None:
        logged[RESERVED_BYTES] = memory.reserved_bytes
    if known.get("projected_s") is not None:
        known["projected_s"] = round(known["projected_s"], 1)
    error = trained.prediction_error if trained else None
    if trained is None and prediction is not None and memory is not None:
        error = prediction.error(memory)  # stopped past its memory check
    return Outcome(
        state,
        reason,
        message or None,
        peak_bytes=peak,
        predicted_bytes=prediction.peak_bytes if prediction else None,
        prediction_error=error,
        unit=result.unit if result else None,
        metrics={**trained.figures, **(extra or {})} if trained else {},
        val_curve=_curve(result, VAL_LOSS),
        target_curve=_curve(result, target_metric) if target_metric != VAL_LOSS else None,
        timed_steps=result.timed_steps if result else None,
        timed_samples=result.timed_samples if result else None,
        num_steps=result.num_steps if result else 0,
        logged=logged,
        **known,
    )


def memory_violation(outcome: Outcome, budget_bytes: int, margin: float) -> float | None:
    """(peak - budget) / budget: > 0 for a trial that did not fit, <= 0 for one that did;
    None when nothing is known of its memory. A predicted OOM counts its peak with the
    margin that pruned it. A CUDA OOM stops the allocator before the peak, so an OOM's
    violation is at least 1%."""
    predicted = outcome.predicted_bytes
    if outcome.reason == OVER_DATA:  # infeasible, whatever its memory: the sampler learns so
        return 1.0
    if outcome.reason == PREDICTED_OOM and predicted is not None:
        return max(predicted * (1 + margin) / budget_bytes - 1, 0.01)
    if outcome.reason in OOM_REASONS:
        peak = max(outcome.peak_bytes or 0, predicted or 0)
        return max((peak - budget_bytes) / budget_bytes, 0.01)
    peak = outcome.peak_bytes
    if outcome.metrics:  # a completed run: its reserve where it has one (CUDA)
        peak = outcome.metrics.get(RESERVED_BYTES) or peak
    elif peak is None:
        peak = predicted
    if peak is None:
        return None
    return min((peak - budget_bytes) / budget_bytes, 0.0)  # it ran: it fitted


def trial_record(
    started: TrialRecord,
    outcome: Outcome,
    spec: RunSpec,
    seconds: float,
    settings: SearchConfig,
    overhead: Mapping[str, float],
) -> TrialRecord:
    """The record of a trial that ended with `outcome` (`started`: what it trained with)."""
    violation = None
    if settings.oom_constraint and spec.budget_bytes is not None:
        violation = memory_violation(outcome, spec.budget_bytes, settings.preflight_margin)
    slow = outcome.projected_s is not None
    return started.replace(
        state=outcome.state,
        outcome=outcome,
        seconds=round(seconds, 2),
        storage_s=overhead.get(STORAGE_S),
        tracking_s=overhead.get(TRACKING_S),
        budget_bytes=spec.budget_bytes,
        memory_violation=violation,
        time_budget_s=settings.trial_time_budget_s if slow else None,
    )


def _curve(result: RunResult | None, metric: str | None) -> list[list[float]] | None:
    """[step, value of `metric`] of each validation with a finite value."""
    if result is None or metric is None:
        return None
    curve = [
        [int(e["step"]), round(float(e[metric]), 6)]
        for e in result.evals
        if "step" in e and math.isfinite(e.get(metric, math.nan))
    ]
    return curve or None


def write(trial: optuna.Trial, record: TrialRecord) -> None:
    """The record into the Optuna trial: its user attrs and its memory constraint."""
    written = trial.user_attrs  # a copy: read once
    for key, value in record.to_attrs().items():
        if written.get(key) != value:
            trial.set_user_attr(key, value)
    if record.memory_violation is not None:
        trial.set_constraint(CONSTRAINT, record.memory_violation)


def run_metrics(record: TrialRecord, seconds: float, overhead: Mapping[str, float]) -> dict:
    """The trial's end figures as MLflow metrics (its validations were logged as they ran)."""
    outcome = record.outcome
    metrics: dict[str, float] = {TRIAL_S: seconds, **overhead}
    if record.budget_bytes is not None:
        metrics[BUDGET_BYTES] = record.budget_bytes
    if outcome.predicted_bytes is not None:
        metrics[PREDICTED_BYTES] = outcome.predicted_bytes
    if outcome.prediction_error is not None:
        metrics[PREDICTION_ERROR] = outcome.prediction_error
    ran = {k: v for k, v in outcome.metrics.items() if not k.startswith(VAL_PREFIX)}
    if not ran and outcome.peak_bytes is not None:
        ran[PEAK_BYTES] = outcome.peak_bytes
    metrics.update({**ran, **outcome.logged})
    if outcome.projected_s is not None:
        metrics[PROJECTED_S] = outcome.projected_s
    return metrics


def log(run: RunLog, record: TrialRecord, metrics: dict, objectives: list[str]) -> None:
    """The record into the trial's MLflow run: figures, tags, description, name, status."""
    outcome = record.outcome
    run.end_figures(metrics, outcome.num_steps)
    tags = {STATE_TAG: outcome.state}
    if outcome.reason:
        tags[PRUNE_REASON_TAG] = outcome.reason
        tags["batchfit.message"] = (outcome.message or "")[:MLFLOW_MESSAGE_CHARS]
    run.tags(tags)
    if outcome.state != "COMPLETE" and outcome.message:  # why, whole, atop the run's page
        label = f"PRUNED ({outcome.reason or PRUNER})" if outcome.state == "PRUNED" else "FAILED"
        run.description(f"**{label}**: {outcome.message[:MLFLOW_MESSAGE_CHARS]}")
    run.rename(record.run_name(objectives))
    if outcome.error_traceback:
        run.text(outcome.error_traceback, "error.txt")
    run.finish("FAILED" if outcome.state == "FAIL" else "FINISHED")


def end(outcome: Outcome, objectives: list[str]) -> list[float]:
    """What Optuna is told: the objective values of a completed run (NaN where it has none:
    Optuna then fails the trial, with the reason), or that it was pruned or failed."""
    if outcome.state == "PRUNED":
        raise optuna.TrialPruned(f"{outcome.reason}: {outcome.message}")
    if outcome.state == "FAIL":
        raise TrialFailed(outcome.message)
    return [outcome.metrics.get(m, float("nan")) for m in objectives]


def failed(error: BaseException, traceback_text: str, **left: Any) -> Outcome:
    """The outcome of a trial that raised `error`; `left`: what it left, as for `ended`."""
    message = f"{type(error).__name__}: {error}"
    return ended("FAIL", ERROR, message, error_traceback=traceback_text, **left)
