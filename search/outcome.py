"""How a trial ended, and recording it: the `Outcome` becomes the trial's record
(search/record.py), which is written to the Optuna trial (user attrs, memory constraint)
and logged to its MLflow run (figures, tags, name, status); `end` then hands Optuna the
objective values, or the exception that tells it the trial was pruned or failed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import optuna

from search.config import SearchConfig
from search.record import (
    CONSTRAINT,
    ERROR,
    MESSAGE_CHARS,
    OOM_REASONS,
    PREDICTED_OOM,
    PRUNER,
    TrialRecord,
)
from tracking.runs import RunLog
from tracking.tags import PRUNE_REASON_TAG, STATE_TAG
from train.loop import RunResult
from train.memory.budget import MemoryStats
from train.memory.predict import Prediction
from train.run import RunSpec, memory_figures

MLFLOW_MESSAGE_CHARS = 5000


class TrialFailed(Exception):
    """This trial failed; the study goes on (the only exception `optimize` catches)."""


@dataclass
class Outcome:
    state: str  # COMPLETE, PRUNED or FAIL
    reason: str | None = None
    message: str = ""
    result: RunResult | None = None
    peak_bytes: int | None = None  # an OOM's, when it stopped
    # What a run that stopped past its memory check (pruned, diverged, failed) measured.
    memory: MemoryStats | None = None
    error_traceback: str | None = None
    projected_s: float | None = None  # a `slow` trial's projected training
    prediction: Prediction | None = None
    probe_s_per_sample: float | None = None  # the slow-trial probe's, when it ran
    mfu_note: str | None = None  # why perf/mfu is above 1
    # A completed run's figures beyond its own: perf/* (MFU), time/to_target_s.
    extra: dict[str, float] = field(default_factory=dict)

    def figures(self) -> dict[str, float]:
        """A completed run's figures by metric name, the extra ones included."""
        return {**self.result.figures(), **self.extra} if self.result else {}

    @property
    def measured_peak(self) -> int | None:
        """The peak it measured: the whole run's, an OOM's, or as far as it ran."""
        if self.result is not None:
            return self.result.peak_bytes
        if self.peak_bytes is not None:
            return self.peak_bytes
        return self.memory.peak_bytes if self.memory is not None else None


def memory_violation(outcome: Outcome, budget_bytes: int, margin: float) -> float | None:
    """(peak - budget) / budget: > 0 for a trial that did not fit, <= 0 for one that did;
    None when nothing is known of its memory. A predicted OOM counts its peak with the
    margin that pruned it. A CUDA OOM stops the allocator before the peak, so an OOM's
    violation is at least 1%."""
    predicted = outcome.prediction.peak_bytes if outcome.prediction else None
    if outcome.reason == PREDICTED_OOM and predicted is not None:
        return max(predicted * (1 + margin) / budget_bytes - 1, 0.01)
    if outcome.reason in OOM_REASONS:
        peak = max(outcome.peak_bytes or 0, predicted or 0)
        return max((peak - budget_bytes) / budget_bytes, 0.01)
    if outcome.result is not None:
        peak = outcome.result.reserved_bytes or outcome.result.peak_bytes
    else:
        peak = outcome.measured_peak if outcome.measured_peak is not None else predicted
    if peak is None:
        return None
    return min((peak - budget_bytes) / budget_bytes, 0.0)  # it ran: it fitted


def trial_record(
    started: TrialRecord,
    outcome: Outcome,
    spec: RunSpec,
    seconds: float,
    settings: SearchConfig,
    overhead: dict[str, float],
) -> TrialRecord:
    """The record of a trial that ended with `outcome` (`started`: what it trained with)."""
    result, prediction = outcome.result, outcome.prediction
    measured = result or outcome.memory
    violation = None
    if settings.oom_constraint and spec.budget_bytes is not None:
        violation = memory_violation(outcome, spec.budget_bytes, settings.preflight_margin)
    message = outcome.message[:MESSAGE_CHARS]
    return started.replace(
        state=outcome.state,
        ended=outcome.state,
        reason=outcome.reason,
        message=message if outcome.reason else None,
        error=message if outcome.state == "FAIL" else None,
        seconds=round(seconds, 2),
        storage_s=overhead.get("time/storage_s"),
        tracking_s=overhead.get("time/tracking_s"),
        budget_bytes=spec.budget_bytes,
        peak_bytes=outcome.measured_peak,
        predicted_bytes=prediction.peak_bytes if prediction else None,
        prediction_error=prediction.error(measured) if prediction and measured else None,
        memory_violation=violation,
        throughput=_throughput(result),
        unit=result.unit if result else None,
        val_acc=result.val.get("val/acc") if result else None,
        metrics=outcome.figures(),
        step_ms=result.step_ms if result else None,
        val_curve=_val_curve(result),
        # what the throughput clock timed (warm-up and memory-measured steps out)
        timed_steps=result.timed_steps if result else None,
        timed_samples=result.timed_samples if result else None,
        mfu_note=outcome.mfu_note,
        probe_s_per_sample=outcome.probe_s_per_sample,
        projected_s=round(outcome.projected_s, 1) if outcome.projected_s is not None else None,
        time_budget_s=settings.trial_time_budget_s if outcome.projected_s is not None else None,
    )


def _val_curve(result: RunResult | None) -> list[list[float]] | None:
    """[step, val/loss] of each validation with a finite loss."""
    if result is None:
        return None
    curve = [
        [int(e["step"]), round(float(e["val/loss"]), 6)]
        for e in result.evals
        if "step" in e and math.isfinite(e.get("val/loss", math.nan))
    ]
    return curve or None


def _throughput(result: RunResult | None) -> float | None:
    """A completed run's throughput in its task's unit."""
    if result is None:
        return None
    unit = f"throughput/{result.unit}_per_sec"
    return result.figures().get(unit, result.throughput_samples_per_sec)


def write(trial: optuna.Trial, record: TrialRecord) -> None:
    """The record into the Optuna trial: its user attrs and its memory constraint."""
    written = trial.user_attrs  # a copy: read once
    for key, value in record.to_attrs().items():
        if written.get(key) != value:
            trial.set_user_attr(key, value)
    if record.memory_violation is not None:
        trial.set_constraint(CONSTRAINT, record.memory_violation)


def run_metrics(
    record: TrialRecord, outcome: Outcome, spec: RunSpec, seconds: float, overhead: dict
) -> dict:
    """The trial's end figures as MLflow metrics."""
    metrics: dict[str, float] = {"time/trial_s": seconds, **overhead}
    measured = outcome.result or outcome.memory
    metrics.update(memory_figures(spec, outcome.prediction, measured))
    if outcome.result is not None:
        metrics.update({**outcome.result.metrics(), **outcome.extra})
    elif record.peak_bytes is not None:
        metrics["memory/peak_bytes"] = record.peak_bytes
        if outcome.memory is not None and outcome.memory.reserved_bytes is not None:
            metrics["memory/reserved_bytes"] = outcome.memory.reserved_bytes
    if outcome.prediction is not None:
        metrics["time/prediction_s"] = outcome.prediction.seconds
    if record.projected_s is not None:
        metrics["time/projected_s"] = record.projected_s
    return metrics


def log(
    run: RunLog, record: TrialRecord, outcome: Outcome, metrics: dict, objectives: list[str]
) -> None:
    """The record into the trial's MLflow run: figures, tags, description, name, status."""
    run.end_figures(metrics, outcome.result.num_steps if outcome.result else 0)
    tags = {STATE_TAG: outcome.state}
    if outcome.reason:
        tags[PRUNE_REASON_TAG] = outcome.reason
        tags["batchfit.message"] = outcome.message[:MLFLOW_MESSAGE_CHARS]
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
    by_name = outcome.figures()
    return [by_name.get(m, float("nan")) for m in objectives]


def failed(error: BaseException, traceback_text: str) -> Outcome:
    return Outcome(
        "FAIL", ERROR, f"{type(error).__name__}: {error}", error_traceback=traceback_text
    )
