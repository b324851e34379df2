"""One trial's record: what a trial of the study trained with and how it ended, as a value.

The objective writes it into the Optuna trial (`to_attrs`: user attrs, the only place
their names appear) and logs it to the trial's MLflow run (search/trial/ending.py); everything
that reads a trial afterwards (the report, the plots, the recommendation, the sampler, the
trial budget of search/core/trial_count.py) reads `TrialRecord.of(trial)`.

Which trials count is decided here too, once: `is_finished` (ended with a result of its
own), `is_unbilled` (answered without training), `is_trained` (one of search.n_trials) and
`is_settled` (a new run of its configuration would repeat it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from optuna.trial import FrozenTrial

from batchfit.tracking.metrics import PEAK_BYTES, STEP_MS, THROUGHPUT_PREFIX, VAL_ACC, VAL_PREFIX
from batchfit.tracking.metrics import throughput as throughput_metric
from batchfit.tracking.tags import DIVERGED, OOM
from batchfit.train.params import (
    ACCUM_KEY,
    BATCH_KEY,
    EFFECTIVE_PARAM,
    LR_PARAM,
    PRECISION_KEY,
    lever_words,
)

# Why a trial was pruned (`reason`), besides the study pruner's "pruner"; OOM (over the budget
# as it trained) and DIVERGED (NaN or infinite loss) are a run's own (tracking/tags.py).
PREDICTED_OOM = "oom_predicted"  # its step was predicted not to fit, before training
OOM_REASONS = (OOM, PREDICTED_OOM)
OVER_DATA = "over_data"  # its step was larger than the training set, before training
UNTRAINED = (PREDICTED_OOM, OVER_DATA)  # pruned before training: not counted in n_trials
SLOW = "slow"  # its measured speed cannot finish within search.trial_time_budget_s
PRUNER = "pruner"  # search.pruner, on a validation metric
MISSED_TARGET = "missed_target"  # pruned at the end of its budget short of search.target
ERROR = "error"  # the reason of a FAIL: an exception of its own

# Outcomes that training the same configuration again would repeat: training is seeded, and
# on CPU the memory check is exact. A prediction is made again (the margin may have changed
# on resume; it is cheap and takes no slot), and `slow` (timing noise), `pruner` (depends on
# the other trials), failures and a CUDA OOM (fragmentation, other processes) train again.
SETTLED_REASONS = (DIVERGED, MISSED_TARGET)
CONSTRAINT = "memory"  # the Optuna constraint: (peak - budget) / budget, > 0 did not fit
MESSAGE_CHARS = 1000  # of a message kept in the study (the MLflow run has 5000)

# conf/search/default.yaml's objectives, for a run name made without the study's
RUN_NAME_OBJECTIVES = (VAL_ACC,)


class Attr:
    """The user attr names a trial's record is stored under (`TrialRecord.to_attrs`), one
    constant each: what users, optuna-dashboard and the tests read a trial by."""

    STATE = "state"
    REASON = "reason"
    MESSAGE = "message"
    PEAK_BYTES = "peak_bytes"
    PREDICTED_BYTES = "predicted_bytes"
    PREDICTION_ERROR = "prediction_error"
    UNIT = "unit"
    METRICS = "metrics"
    VAL_CURVE = "val_curve"
    TARGET_CURVE = "target_curve"
    TIMED_STEPS = "timed_steps"
    TIMED_SAMPLES = "timed_samples"
    MFU_NOTE = "mfu_note"
    PROBE_S_PER_SAMPLE = "probe_s_per_sample"
    PROJECTED_S = "projected_s"
    REPEAT_OF = "repeat_of"
    SURPLUS = "surplus"
    RUN_ID = "mlflow_run_id"
    SECONDS = "seconds"
    STORAGE_S = "storage_s"
    TRACKING_S = "tracking_s"
    BUDGET_BYTES = "budget_bytes"
    TIME_BUDGET_S = "time_budget_s"
    # written, not read back (DERIVED_ATTRS)
    ERROR = "error"
    THROUGHPUT = "throughput"
    VAL_ACC = "val_acc"
    STEP_MS = "step_ms"
    VIOLATION = "memory_violation"  # the constraint CONSTRAINT, for optuna-dashboard


def _attr(name: str, default: Any = None) -> Any:
    """A field stored as the user attr `name`."""
    factory = {"default_factory": dict} if default is dict else {"default": default}
    return field(metadata={"attr": name}, **factory)


@dataclass(frozen=True)
class Outcome:
    """How a trial's training ended and what it measured, built once where it ended
    (search/trial/ending.py) and nested in its TrialRecord. Each figure is kept once: a completed
    run's by metric name in `metrics` (its throughput, val/acc, step time among them); the
    rest, known of any run that trained or was predicted, in the fields below."""

    state: str | None = _attr(Attr.STATE)  # COMPLETE, PRUNED or FAIL; None: it has not ended
    reason: str | None = _attr(Attr.REASON)  # why it was pruned (PREDICTED_OOM...); a FAIL: ERROR
    message: str | None = _attr(Attr.MESSAGE)  # what happened, in words
    # Memory: the measured peak (the whole run's, an OOM's, or as far as it ran past its
    # memory check), the predicted one and the prediction's error against the measured.
    peak_bytes: int | None = _attr(Attr.PEAK_BYTES)
    predicted_bytes: int | None = _attr(Attr.PREDICTED_BYTES)
    prediction_error: float | None = _attr(Attr.PREDICTION_ERROR)
    # A completed (or missed-target) run's figures by metric name, in its task's `unit`.
    unit: str | None = _attr(Attr.UNIT)
    metrics: Mapping[str, float] = _attr(Attr.METRICS, dict)
    # [optimizer step, val/loss] at each validation: time to target
    # (search/results/time_to_target.py)
    val_curve: list | None = _attr(Attr.VAL_CURVE)
    # [optimizer step, value] of search.target's metric where it is not val/loss
    target_curve: list | None = _attr(Attr.TARGET_CURVE)
    # what the throughput clock timed (warm-up and memory-measured steps out)
    timed_steps: int | None = _attr(Attr.TIMED_STEPS)
    timed_samples: int | None = _attr(Attr.TIMED_SAMPLES)
    mfu_note: str | None = _attr(Attr.MFU_NOTE)  # why perf/mfu is above 1 (train/measure/flops.py)
    # The slow-trial probe's seconds per sample (the yardstick of later trials); a `slow`
    # trial's projected training.
    probe_s_per_sample: float | None = _attr(Attr.PROBE_S_PER_SAMPLE)
    projected_s: float | None = _attr(Attr.PROJECTED_S)
    # For the trial's MLflow run only, not kept in the study: the steps it trained (the step
    # of its end figures), the end figures only MLflow shows, the traceback of its error.
    num_steps: int = field(default=0, compare=False)
    logged: Mapping[str, float] = field(default_factory=dict, compare=False)
    error_traceback: str | None = field(default=None, compare=False)

    @property
    def throughput(self) -> float | None:
        """A completed run's throughput in its unit per second."""
        return self.figure(throughput_metric(self.unit or "samples"))

    @property
    def val_acc(self) -> float | None:
        return self.figure(VAL_ACC)

    @property
    def step_ms(self) -> float | None:
        return self.figure(STEP_MS)

    @property
    def error(self) -> str | None:
        """A FAIL's own exception, in words."""
        return self.message if self.state == "FAIL" else None

    def figure(self, metric: str) -> float | None:
        """A completed run's figure by metric name (NaN and unknown: None)."""
        value = self.metrics.get(metric)
        return None if value is None or value != value else float(value)


NOT_ENDED = Outcome()


@dataclass(frozen=True)
class TrialRecord:
    """A trial as the study recorded it. `run` holds what it trained with, as
    train/run.py's RunSpec.params names it (batch size to the scaled lr and the device);
    `outcome` how it ended and what it measured; the other fields are None until known."""

    number: int
    state: str  # Optuna's: COMPLETE, PRUNED, FAIL, RUNNING, WAITING
    params: Mapping[str, Any] = field(default_factory=dict)  # the sampled values
    values: tuple[float, ...] | None = None  # the objectives of a COMPLETE trial
    # The constraint CONSTRAINT, when known; also a user attr, which optuna-dashboard shows.
    memory_violation: float | None = None
    run: Mapping[str, Any] = field(default_factory=dict)
    # How it ended (its state there: a trial that died mid-way has none), what it measured.
    outcome: Outcome = NOT_ENDED
    repeat_of: int | None = _attr(Attr.REPEAT_OF)  # the trial whose record answered this one
    surplus: bool = _attr(Attr.SURPLUS, False)  # started past search.n_trials: never ran
    run_id: str | None = _attr(Attr.RUN_ID)
    # Seconds of the whole trial, and of its storage and MLflow calls (tracking/overhead.py).
    seconds: float | None = _attr(Attr.SECONDS)
    storage_s: float | None = _attr(Attr.STORAGE_S)
    tracking_s: float | None = _attr(Attr.TRACKING_S)
    budget_bytes: int | None = _attr(Attr.BUDGET_BYTES)
    # The search.trial_time_budget_s a `slow` trial was held to.
    time_budget_s: float | None = _attr(Attr.TIME_BUDGET_S)

    @classmethod
    def of(cls, trial: FrozenTrial) -> TrialRecord:
        values = tuple(trial.values) if trial.values is not None else None
        return cls.from_attrs(
            trial.number,
            trial.user_attrs,
            state=trial.state.name,
            params=trial.params,
            values=values,
            memory_violation=trial.constraints.get(CONSTRAINT),
        )

    @classmethod
    def from_attrs(cls, number: int, attrs: Mapping[str, Any], **known: Any) -> TrialRecord:
        """The record stored as user attrs `attrs` (what `to_attrs` wrote), with what Optuna
        keeps itself (`state`, `params`, `values`, `memory_violation`) given by name."""
        rest = dict(attrs)
        ended = _pop_stored(Outcome, rest)
        if Attr.ERROR in rest:  # written for a FAIL of its own: its message
            ended = {"state": "FAIL", "message": rest[Attr.ERROR], **ended}
        outcome = Outcome(**ended)
        stored = _pop_stored(TrialRecord, rest)
        for name in DERIVED_ATTRS:
            rest.pop(name, None)
        violation = rest.pop(Attr.VIOLATION, None)
        if known.get("memory_violation") is None:
            known["memory_violation"] = violation
        known.setdefault("state", outcome.state or "RUNNING")
        # what is left is what the objective wrote first: the run's params
        return cls(number=number, run=rest, outcome=outcome, **known, **stored)

    def to_attrs(self) -> dict[str, Any]:
        """The user attrs that store this record: the run's params, then what is known of
        its outcome and of the trial. A message is kept to MESSAGE_CHARS; a FAIL's is its
        `error` too, and a completed run's throughput, val/acc and step time are also
        written under names of their own (read by users and optuna-dashboard, not back)."""
        outcome = self.outcome
        if outcome.message is not None:
            outcome = dataclasses.replace(outcome, message=outcome.message[:MESSAGE_CHARS])
        derived = dict(zip(DERIVED_ATTRS, _derived(outcome), strict=True))
        attrs = {**self.run, **_stored(outcome), **_stored(self)}
        attrs.update({k: v for k, v in derived.items() if v is not None})
        if self.memory_violation is not None:
            attrs[Attr.VIOLATION] = self.memory_violation
        return attrs

    def replace(self, **changes: Any) -> TrialRecord:
        return dataclasses.replace(self, **changes)

    # What it trained with (None until configured).
    @property
    def batch_size(self) -> int | None:
        return self.run.get(BATCH_KEY)

    @property
    def accum_steps(self) -> int | None:
        return self.run.get(ACCUM_KEY)

    @property
    def precision(self) -> str | None:
        return self.run.get(PRECISION_KEY)

    @property
    def effective_batch_size(self) -> int | None:
        return self.run.get(EFFECTIVE_PARAM)

    @property
    def lr(self) -> float | None:
        return self.run.get(LR_PARAM)

    @property
    def device(self) -> str | None:
        return self.run.get("device")

    @property
    def configured(self) -> bool:
        """Whether it got as far as its config (a surplus or a repeat never does)."""
        return BATCH_KEY in self.run

    # Which trials count (one definition each; search/core/trial_count.py counts with them).
    @property
    def is_repeat(self) -> bool:
        return self.repeat_of is not None

    @property
    def is_finished(self) -> bool:
        """Complete, pruned, or failed with an error of its own; not a trial that was
        interrupted (Ctrl-C, or a worker that died), which is run again, nor a surplus."""
        if self.state in ("COMPLETE", "PRUNED"):
            return True
        return self.state == "FAIL" and self.outcome.error is not None

    @property
    def is_unbilled(self) -> bool:
        """A proposal answered without training: predicted not to fit (the fit report knew
        it) or larger than the training set, or a configuration already trained, answered
        from its record. Optuna has it, so the sampler learns from it; search.n_trials does
        not count it."""
        return self.is_repeat or self.outcome.reason in UNTRAINED

    @property
    def is_trained(self) -> bool:
        """Finished, and not unbilled: one of the search.n_trials the user asked for."""
        return self.is_finished and not self.is_unbilled

    @property
    def is_settled(self) -> bool:
        """Finished with an outcome that a new run of its configuration would repeat, so
        that such a proposal is answered from this record (SETTLED_REASONS)."""
        if self.is_repeat or self.state not in ("COMPLETE", "PRUNED"):
            return False
        if self.state == "COMPLETE":
            return True
        if self.outcome.reason == OOM:
            return self.device == "cpu"  # exact there; a CUDA OOM may not happen again
        return self.outcome.reason in SETTLED_REASONS

    @property
    def infeasible(self) -> bool:
        """Known not to fit: its memory constraint is positive (an OOM, real or predicted)."""
        return self.memory_violation is not None and self.memory_violation > 0

    @property
    def trained_its_budget(self) -> bool:
        """Trained all it was to train: completed, or ended short of search.target."""
        return not self.is_repeat and (
            self.state == "COMPLETE"
            or (self.state == "PRUNED" and self.outcome.reason == MISSED_TARGET)
        )

    @property
    def label(self) -> str:
        """'COMPLETE', 'PRUNED (oom)', 'REPEAT', 'FAIL'."""
        if self.is_repeat:
            return "REPEAT"
        if self.state == "PRUNED":
            return f"PRUNED ({self.outcome.reason or PRUNER})"
        return self.state

    def run_name(self, objectives: Sequence[str] = RUN_NAME_OBJECTIVES) -> str:
        """Its MLflow run name, the first thing the runs table shows: its configuration,
        and once it has ended its outcome (pruned and failed ones say so, a slow one with
        its projection) and key figures: the study's objectives, its throughput in its
        unit and its peak memory."""
        name = " · ".join(
            [
                f"trial-{self.number}",
                f"{self.batch_size}x{self.accum_steps} {self.precision}",
                *lever_words({**self.run, **self.params}),
            ]
        )
        outcome = self.outcome
        if outcome.state == "COMPLETE":
            throughput = throughput_metric(outcome.unit or "samples")
            metrics = [m for m in dict.fromkeys([*objectives, throughput]) if m != PEAK_METRIC]
            figures = [(m, outcome.figure(m)) for m in metrics]
            words = [_figure_words(m, v) for m, v in figures if v is not None]
            if outcome.peak_bytes:
                words.append(f"{mib(outcome.peak_bytes)} MiB")
            return " · ".join([name, *words])
        if outcome.state == "PRUNED":
            reason = outcome.reason or PRUNER
            projected = outcome.projected_s
            if reason == SLOW and projected is not None and self.time_budget_s:
                reason += f" (projected {projected:.0f} s, budget {self.time_budget_s:g} s)"
            return f"{name} · PRUNED {reason}"
        if outcome.state == "FAIL":
            return f"{name} · FAILED"
        return name


# User attrs written from the outcome but not read back: `error` (a FAIL's message), and a
# completed run's `throughput` (in its unit), `val_acc` and `step_ms` (of its metrics).
DERIVED_ATTRS = (Attr.ERROR, Attr.THROUGHPUT, Attr.VAL_ACC, Attr.STEP_MS)


def _derived(outcome: Outcome) -> tuple[Any, ...]:
    return outcome.error, outcome.throughput, outcome.val_acc, outcome.step_ms


def _stored(value: Outcome | TrialRecord) -> dict[str, Any]:
    """The fields of `value` stored as user attrs, by attr name; those unknown left out."""
    stored = {}
    for f in dataclasses.fields(value):
        attr = f.metadata.get("attr")
        item = getattr(value, f.name)
        if attr and item is not None and item != f.default and item != {}:
            stored[attr] = item
    return stored


def _pop_stored(cls: type, attrs: dict[str, Any]) -> dict[str, Any]:
    """The fields of `cls` stored in `attrs`, by field name, taken out of `attrs`."""
    return {
        f.name: attrs.pop(f.metadata["attr"])
        for f in dataclasses.fields(cls)
        if "attr" in f.metadata and f.metadata["attr"] in attrs
    }


PEAK_METRIC = PEAK_BYTES  # in a run name in MiB, last


def mib(num_bytes: float | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**20:.1f}"


def figure_text(value: float) -> str:
    """A figure in 4 significant digits, never in exponent notation from 10,000 up
    (14040 samples/s, not 1.404e+04)."""
    return f"{value:.0f}" if 1e4 <= abs(value) < 1e15 else f"{value:.4g}"


def _figure_words(metric: str, value: float) -> str:
    """'acc 0.951', 'loss 2.310', '412/s' (samples), '9120 tokens/s', 'mfu 0.412'."""
    name = metric.rsplit("/", 1)[-1]
    if metric.startswith(THROUGHPUT_PREFIX) and name.endswith("_per_sec"):
        unit = name.removesuffix("_per_sec")
        return f"{value:.0f}/s" if unit == "samples" else f"{value:.0f} {unit}/s"
    if metric.startswith(VAL_PREFIX):
        return f"{name} {value:.3f}"
    return f"{name} {figure_text(value)}"


def records(trials: Sequence[FrozenTrial]) -> list[TrialRecord]:
    return [TrialRecord.of(t) for t in trials]
