"""How a trial ended, and recording it: the Optuna trial's user attrs and memory constraint,
its MLflow run's figures, tags, name and status (names of what is recorded: search/record.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import optuna

from search import record, report
from search.config import SearchConfig
from tracking.runs import STATE_TAG, RunLog, mib_metrics
from train.loop import RunResult
from train.memory import MemoryStats
from train.predict import Prediction
from train.run import RunSpec

# Logged per interval while a trial trains (the unit's throughput too, e.g. tokens_per_sec).
CURVE_METRICS = ("throughput/samples_per_sec", "time/data_wait_share")


class TrialFailed(Exception):
    """This trial failed; the study goes on (the only exception `optimize` catches)."""


@dataclass
class Outcome:
    state: str  # COMPLETE, PRUNED or FAIL
    reason: str | None = None
    message: str = ""
    result: RunResult | None = None
    peak_bytes: int | None = None  # an OOM's, when it stopped
    # What a run stopped past its memory check (pruned, diverged) measured: it fitted.
    memory: MemoryStats | None = None
    error_traceback: str | None = None
    projected_s: float | None = None  # a `slow` trial's projected training
    prediction: Prediction | None = None
    # A completed run's figures beyond its own: perf/* (MFU), time/to_target_s.
    extra: dict[str, float] = field(default_factory=dict)

    def figures(self) -> dict[str, float]:
        """A completed run's figures by metric name, the extra ones included."""
        return {**self.result.figures(), **self.extra} if self.result else {}


def memory_violation(
    outcome: Outcome, peak_bytes: int | None, budget_bytes: int, margin: float
) -> float | None:
    """(peak - budget) / budget: > 0 for a trial that did not fit, <= 0 for one that did;
    None when nothing is known of its memory. A predicted OOM counts its peak with the
    margin that pruned it. A CUDA OOM stops the allocator before the peak, so an OOM's
    violation is at least 1%."""
    predicted = outcome.prediction.peak_bytes if outcome.prediction else None
    if outcome.reason == "oom_predicted" and predicted is not None:
        return max(predicted * (1 + margin) / budget_bytes - 1, 0.01)
    if outcome.reason in ("oom", "oom_predicted"):
        peak = max(outcome.peak_bytes or 0, predicted or 0)
        return max((peak - budget_bytes) / budget_bytes, 0.01)
    if outcome.result is not None:
        peak = outcome.result.reserved_bytes or outcome.result.peak_bytes
    else:
        peak = peak_bytes if peak_bytes is not None else predicted
    if peak is None:
        return None
    return min((peak - budget_bytes) / budget_bytes, 0.0)  # it ran: it fitted


def objective_values(outcome: Outcome, metrics: list[str]) -> list[float]:
    """A completed run's values of the objectives (NaN where the run has none: Optuna then
    fails the trial, with the reason)."""
    by_name = outcome.figures()
    return [by_name.get(m, float("nan")) for m in metrics]


def record_outcome(
    trial: optuna.Trial,
    outcome: Outcome,
    log: RunLog,
    spec: RunSpec,
    seconds: float,
    settings: SearchConfig,
    overhead: dict[str, float],
) -> list[float]:
    """Write how a trial ended to Optuna (user attrs, memory constraint) and to its MLflow
    run (figures, tags, name, status); return its objective values, or raise
    optuna.TrialPruned / TrialFailed."""
    attrs: dict[str, Any] = {record.STATE: outcome.state, "seconds": round(seconds, 2)}
    metrics: dict[str, float] = {"time/trial_s": seconds, **overhead}
    attrs.update({key.removeprefix("time/"): value for key, value in overhead.items()})
    if "mlflow_run_id" not in trial.user_attrs and log.run_id is not None:
        attrs["mlflow_run_id"] = log.run_id
    if spec.budget_bytes is not None:
        attrs[record.BUDGET] = metrics["memory/budget_bytes"] = spec.budget_bytes
    result = outcome.result
    if result is not None:
        attrs.update(
            {
                record.THROUGHPUT: result.figures().get(
                    f"throughput/{result.unit}_per_sec", result.throughput_samples_per_sec
                ),
                record.UNIT: result.unit,
                "step_ms": result.step_ms,
                # what the throughput clock timed (warm-up and memory-measured steps out)
                "timed_steps": result.timed_steps,
                "timed_samples": result.timed_samples,
                record.VAL_ACC: result.val.get("val/acc"),
                record.PEAK: result.peak_bytes,
                record.METRICS: outcome.figures(),
            }
        )
        metrics.update({**result.metrics(), **outcome.extra})
    elif outcome.peak_bytes is not None:
        attrs[record.PEAK] = metrics["memory/peak_bytes"] = outcome.peak_bytes
    elif outcome.memory is not None:
        attrs[record.PEAK] = metrics["memory/peak_bytes"] = outcome.memory.peak_bytes
        if outcome.memory.reserved_bytes is not None:
            metrics["memory/reserved_bytes"] = outcome.memory.reserved_bytes
    # What the prediction is compared with: the caching allocator's reserve is what runs
    # out on CUDA; on CPU the peak. A stopped run's as far as it ran, past its memory check
    # (the steady-state step it predicts); an OOM's is no steady state.
    measured = result or outcome.memory
    if outcome.prediction is not None:
        predicted = outcome.prediction.peak_bytes
        attrs[record.PREDICTED] = metrics["memory/predicted_bytes"] = predicted
        metrics["time/prediction_s"] = outcome.prediction.seconds
        if measured is not None:
            actual = measured.reserved_bytes or measured.peak_bytes
            error = (predicted - actual) / actual
            attrs["prediction_error"] = metrics["memory/prediction_error"] = error
    if settings.oom_constraint and spec.budget_bytes is not None:
        violation = memory_violation(
            outcome,
            attrs.get(record.PEAK, trial.user_attrs.get(record.PEAK)),
            spec.budget_bytes,
            settings.preflight_margin,
        )
        if violation is not None:
            trial.set_constraint("memory", violation)
            attrs["memory_violation"] = violation
    if outcome.projected_s is not None:
        attrs[record.PROJECTED] = metrics["time/projected_s"] = round(outcome.projected_s, 1)
        attrs[record.TIME_BUDGET] = settings.trial_time_budget_s
    if outcome.reason:
        attrs[record.REASON] = outcome.reason
        attrs[record.MESSAGE] = outcome.message[:1000]
    if outcome.state == "FAIL":
        attrs["error"] = outcome.message[:1000]
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    # The trial's end figures at step 0: MLflow's chart view draws a metric whose last
    # step is 0 as one bar per run (a comparison), not as a one-point line. Figures
    # with a curve (throughput, logged per interval) end at the last step instead.
    curves = {
        k: v
        for k, v in metrics.items()
        if (k in CURVE_METRICS or k.startswith("throughput/")) and v == v
    }
    metrics.update(mib_metrics(metrics))  # memory/peak_mib beside memory/peak_bytes
    log.metrics({k: v for k, v in metrics.items() if k not in curves and v == v}, step=0)
    if curves:
        log.metrics(curves, step=result.num_steps if result else 0)
    tags = {STATE_TAG: outcome.state}
    if outcome.reason:
        tags.update(
            {
                "batchfit.prune_reason": outcome.reason,
                "batchfit.message": outcome.message[:5000],
            }
        )
    log.tags(tags)
    if outcome.state != "COMPLETE" and outcome.message:  # why, whole, atop the run's page
        label = f"PRUNED ({outcome.reason or 'pruner'})" if outcome.state == "PRUNED" else "FAILED"
        log.description(f"**{label}**: {outcome.message[:5000]}")
    log.rename(report.run_name(trial.number, {**trial.user_attrs, **attrs}, settings.metrics))
    if outcome.error_traceback:
        log.text(outcome.error_traceback, "error.txt")
    log.finish("FAILED" if outcome.state == "FAIL" else "FINISHED")
    if outcome.state == "PRUNED":
        raise optuna.TrialPruned(f"{outcome.reason}: {outcome.message}")
    if outcome.state == "FAIL":
        raise TrialFailed(outcome.message)
    assert result is not None
    return objective_values(outcome, settings.metrics)
