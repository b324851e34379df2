"""One trial: sample, answer a settled configuration from its record, configure, train,
record.

How a trial ends:
- COMPLETE with the objective values;
- PRUNED with a reason (search/core/record.py): `oom_predicted` (its step, computed on fake
  tensors before training, needs more than the budget: search/trial/trial_config.py), `oom` (over
  the budget when it ran), `diverged` (NaN/inf loss, or trained to its end without
  learning: learning_failure), `slow` (its measured speed cannot
  finish within search.trial_time_budget_s: search/trial/stopping.py), `pruner` (the study's
  pruner, per validation), `missed_target` (short of search.target at its end);
- FAIL with the error's message for anything unexpected; the study goes on.
- A configuration trained before with an outcome a new run would repeat is answered from
  that trial's record, without training (search/core/trial_count.py).
Memory of a failed run is released after its exception is dropped, before the next trial.
How it ended is recorded by search/trial/ending.py, with the memory constraint from which the
sampler learns where the boundary is (search/sampling/sampler.py).
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import optuna
from omegaconf import OmegaConf

from batchfit.common import interrupts
from batchfit.common.checks import ConfigError
from batchfit.search.core.record import (
    DIVERGED,
    MISSED_TARGET,
    OOM,
    OVER_DATA,
    PREDICTED_OOM,
    PRUNER,
    Outcome,
    TrialRecord,
)
from batchfit.search.core.study_config import TO_TARGET, SearchConfig
from batchfit.search.core.trial_count import answer_for, study_records
from batchfit.search.storage.journal import JournalWriteError
from batchfit.search.trial.ending import end, ended, failed, log, run_metrics, trial_record, write
from batchfit.search.trial.scaling import scaling_efficiency
from batchfit.search.trial.stopping import (
    TARGET_VALIDATIONS_PER_EPOCH,
    Prune,
    TargetWatch,
    TimeBudget,
    Yardstick,
)
from batchfit.search.trial.trial_config import Configured, Configurer
from batchfit.tracking.metrics import SCALING_EFFICIENCY, TO_TARGET_J, VAL_LOSS
from batchfit.tracking.metrics import throughput as throughput_metric
from batchfit.tracking.runs import RunLog, Tracker
from batchfit.tracking.tags import ROLE_TAG, STATE_TAG, STUDY_TAG, TRIAL_TAG
from batchfit.train.batches import larger_than_data, steps_plan
from batchfit.train.config import RunSpec
from batchfit.train.measure.energy import ENERGY_TAG
from batchfit.train.measure.flops import MFU_NOTE_TAG
from batchfit.train.measure.memory import MemoryStats, OutOfMemory, release_memory
from batchfit.train.measure.noise import NOISE_TAG
from batchfit.train.memory.predict import Prediction
from batchfit.train.params import lever_params
from batchfit.train.run import Trained
from batchfit.train.step import Diverged, Hooks, RunResult


def answer_from_record(trial: optuna.Trial, earlier: TrialRecord) -> list[float]:
    """End `trial` as `earlier` ended, without training it or opening an MLflow run: the
    sampler sees the same state, values and memory constraint (not a pruned trial's
    intermediate values), search.n_trials does not count it."""
    message = (
        f"the configuration of trial {earlier.number} ({earlier.label}): answered from its record"
    )
    pruned = earlier.state == "PRUNED"
    answer = TrialRecord(
        trial.number,
        earlier.state,
        outcome=Outcome(earlier.state, earlier.outcome.reason if pruned else None, message),
        repeat_of=earlier.number,
        memory_violation=earlier.memory_violation,
    )
    write(trial, answer)
    if pruned:
        raise optuna.TrialPruned(message)
    return list(earlier.values)


class _Watch:
    """What a trial's hooks saw while it trained: its probe, its memory past the memory
    check, and the stopping rules they feed (search/trial/stopping.py); with the prediction it
    was configured with, what its outcome is built from."""

    def __init__(self, budget: TimeBudget, target: TargetWatch, prediction: Prediction | None):
        self.budget = budget
        self.target = target
        self.prediction = prediction
        self.probe_s_per_sample: float | None = None
        self.memory: MemoryStats | None = None  # past the memory check: it fits

    def probed(self, seconds_per_sample: float, num_samples: int) -> None:
        self.probe_s_per_sample = seconds_per_sample  # later trials' yardstick
        self.budget.on_probe(seconds_per_sample, num_samples)

    def memory_seen(self, stats: MemoryStats) -> None:
        self.memory = stats

    def seen(self) -> dict[str, Any]:
        """What the run left, whatever stopped it, as `ended` and `failed` take it."""
        return {
            "memory": self.memory,
            "prediction": self.prediction,
            "probe_s_per_sample": self.probe_s_per_sample,
        }

    def stopped(self, reason: str, message: str, projected_s: float | None = None) -> Outcome:
        return ended("PRUNED", reason, message, projected_s=projected_s, **self.seen())


class Objective:
    def __init__(
        self,
        configure: Configurer,
        settings: SearchConfig,
        tracker: Tracker,
        parent_run_id: str,
        notify: Callable[[str], None] = print,
        overhead: Callable[[], dict[str, float]] | None = None,
        on_epoch: Callable[[int, dict, float], None] | None = None,
    ):
        self.configure = configure
        self.settings = settings
        self.tracker = tracker
        self.parent_run_id = parent_run_id
        self.notify = notify  # says a thing once to the user, between trial lines
        # Seconds of storage and MLflow calls since the previous trial (tracking/overhead.py).
        self.overhead = overhead or dict
        # (trial number, validation metrics, seconds since the trial began): progress display
        self.on_epoch = on_epoch
        self._mfu_said = False

    def __call__(self, trial: optuna.Trial) -> list[float]:
        interrupts.check()
        started = time.perf_counter()
        params = self.configure.space.suggest(trial)
        earlier = answer_for(study_records(trial.study), trial.number, params)
        if earlier is not None:
            return answer_from_record(trial, earlier)
        configured = self.configure(params)
        run = {**configured.spec.params(), **lever_params(configured.cfg)}
        begun = TrialRecord(trial.number, "RUNNING", params=params, run=run)
        write(trial, begun)  # what it trains with, first: a trial that dies still shows it
        run_log = self._start_run(begun)
        try:  # from the run's start: a stop while its id is written ends it KILLED too
            if run_log.run_id is not None:  # None while MLflow is unreachable: known later
                begun = begun.replace(run_id=run_log.run_id)
                write(trial, begun)
            self._log_config(run_log, begun, configured)
            workload = configured.planned.workload
            larger = larger_than_data(
                configured.spec.trainer, workload.num_train, workload.data_named
            )
            if larger:
                outcome = ended("PRUNED", OVER_DATA, larger)
            elif configured.fits:
                outcome = self._train(trial, configured, run_log)
            else:
                message = configured.misfit_message(self.settings.preflight_margin)
                outcome = ended("PRUNED", PREDICTED_OOM, message, prediction=configured.prediction)
        except KeyboardInterrupt:
            interrupts.delivered()  # this trial ends here; the study's handler stops
            run_log.tags({STATE_TAG: "KILLED"})  # as a dead worker's runs are ended
            run_log.finish("KILLED")
            raise
        seconds, overhead = time.perf_counter() - started, self.overhead()
        spec = configured.spec
        record = trial_record(begun, outcome, spec, seconds, self.settings, overhead)
        record = record.replace(run_id=run_log.run_id)
        write(trial, record)
        log(run_log, record, run_metrics(record, seconds, overhead), self.settings.metrics)
        return end(outcome, self.settings.metrics)

    def _start_run(self, begun: TrialRecord) -> RunLog:
        tags = {ROLE_TAG: "trial", STUDY_TAG: self.settings.study_name, TRIAL_TAG: begun.number}
        return self.tracker.start_run(begun.run_name(), tags=tags, parent_id=self.parent_run_id)

    def _log_config(self, run_log: RunLog, begun: TrialRecord, configured: Configured) -> None:
        """What the trial trains with, searched or not, its data and its whole config."""
        cfg = configured.cfg
        data = configured.planned.workload.data_params()
        run_log.params({**begun.run, **begun.params, **data})
        run_log.text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")

    def _train(self, trial: optuna.Trial, configured: Configured, log: RunLog) -> Outcome:
        spec = configured.spec
        yardstick = Yardstick.of(study_records(trial.study))
        watch = _Watch(
            TimeBudget(self.settings.trial_time_budget_s, yardstick),
            TargetWatch(self.settings.target),
            configured.prediction,
        )
        workload = configured.planned.workload
        steps_per_epoch, num_steps = steps_plan(workload.num_train, spec.trainer)
        per_epoch = self.settings.validations_per_epoch
        if self.settings.target is not None and per_epoch is None:
            per_epoch = TARGET_VALIDATIONS_PER_EPOCH
        if per_epoch is not None and spec.trainer.val_every_steps is None:
            every = max(1, steps_per_epoch // per_epoch)
            spec = replace(spec, trainer=replace(spec.trainer, val_every_steps=every))
        on_eval = self._on_eval(trial, log)

        def on_validation(step: int, metrics: dict) -> bool:
            # The run ends here when it has reached its target or trained all its steps:
            # the pruner then would save nothing and throw a result away.
            reached = watch.target.reached(metrics)
            on_eval(step, metrics, final=reached or step >= num_steps)
            return reached

        hooks = Hooks(
            on_probe=watch.probed,
            on_step=_checked(watch.budget.on_step),
            on_log=lambda step, metrics: log.metrics(metrics, step),
            on_eval=on_validation,
            on_memory=watch.memory_seen,
        )
        try:
            with self.tracker.system_metrics(log.run_id):
                trained = replace(configured.planned, spec=spec).train(hooks)
            outcome = self._completed(trial, spec, trained, watch, log)
        except OutOfMemory as oom:
            seen = {**watch.seen(), "memory": None}  # the OOM's peak, not as far as it ran
            outcome = ended("PRUNED", OOM, str(oom), oom_peak_bytes=oom.peak_bytes, **seen)
        except Diverged as diverged:
            outcome = watch.stopped(DIVERGED, str(diverged))
        except Prune as prune:
            outcome = watch.stopped(prune.reason, str(prune), prune.projected_s)
        except (ConfigError, JournalWriteError):  # the study's, not the trial's: it stops
            raise
        except Exception as error:  # noqa: BLE001 - one trial's error must not end the study
            outcome = failed(error, traceback.format_exc(), **watch.seen())
        # Outside the except blocks: the exception and the frames it pinned are gone.
        release_memory(spec.device)
        return outcome

    def _completed(
        self,
        trial: optuna.Trial,
        spec: RunSpec,
        trained: Trained,
        watch: _Watch,
        log: RunLog,
    ) -> Outcome:
        """A run that trained to its end (or its target); pruned as `missed_target` when it
        ended short of search.target, its figures kept (it cannot be ranked by time)."""
        result, perf, note = trained.result, trained.perf, trained.mfu_note
        self._say_mfu(note, log)
        log.tags({NOISE_TAG: result.noise_estimator, ENERGY_TAG: result.energy_note})
        extra = {**perf, **watch.target.figures()}
        if TO_TARGET in extra and result.energy is not None:  # the timed steps' mean power
            extra[TO_TARGET_J] = result.energy.mean_watts * extra[TO_TARGET]
        throughput = trained.figures.get(throughput_metric(result.unit))
        efficiency = scaling_efficiency(
            study_records(trial.study), trial.params, spec.params(), throughput
        )
        if efficiency is not None:
            extra[SCALING_EFFICIENCY] = efficiency
        state, reason, message = "COMPLETE", None, None
        failure = learning_failure(result)
        if watch.target.missed:  # short of search.target: whether it learned at all or not
            state, reason, message = "PRUNED", MISSED_TARGET, watch.target.missed_message(result)
        elif failure is not None:  # counted and shown, never recommended nor on the front
            state, reason, message = "PRUNED", DIVERGED, failure
        seen = {**watch.seen(), "memory": None}  # the whole run's, in `result`
        target = self.settings.target.metric if self.settings.target else None
        return ended(
            state, reason, message, trained=trained, extra=extra, mfu_note=note,
            target_metric=target, **seen,
        )  # fmt: skip

    def _say_mfu(self, note: str | None, log: RunLog) -> None:
        """An MFU above 1 (train/measure/flops.py) comes with a note of why: tagged on the
        run, kept in the record, and said once."""
        if note:
            log.tags({MFU_NOTE_TAG: note})
            if not self._mfu_said:
                self._mfu_said = True
                self.notify(note)

    def _on_eval(self, trial: optuna.Trial, log: RunLog) -> Callable[..., None]:
        single = len(self.settings.objectives) == 1
        started = time.perf_counter()
        validations = 0

        def on_eval(step: int, metrics: dict, final: bool) -> None:
            nonlocal validations
            log.validation(step, metrics)
            if self.on_epoch:
                self.on_epoch(trial.number, metrics, time.perf_counter() - started)
            validations += 1
            if single:
                metric = self.settings.metrics[0]
                value = metrics.get(metric)
                if value is not None:
                    # Report per validation, not per optimizer step: trials with different
                    # effective batches validate at different steps, and pruners compare
                    # trials at equal steps. Counted from 0, as Optuna's pruners count
                    # epochs: n_warmup_steps=1 spares the first validation (they prune from
                    # step == n_warmup_steps). The final one is reported, for the pruner to
                    # compare other trials with, but never pruned.
                    trial.report(value, validations - 1)
                    if not final and trial.should_prune():
                        raise Prune(
                            PRUNER,
                            f"{metric}={value:.4f} at validation {validations} (step {step}) "
                            "is worse than the pruner allows",
                        )

        return on_eval


def _checked(on_step: Callable[[int, int, float], None]) -> Callable[[int, int, float], None]:
    """on_step, after raising a stop a signal asked for and Python swallowed
    (common/interrupts.py)."""

    def checked(step: int, num_steps: int, elapsed_s: float) -> None:
        interrupts.check()
        on_step(step, num_steps, elapsed_s)

    return checked


ACC_ABOVE_CHANCE = 2.0  # val/acc at twice a uniform guess's or more: it learned something


def learning_failure(result: RunResult) -> str | None:
    """Why a run that trained to its end did not learn, or None: its last validation loss
    is not finite, or no better than a uniform guess (RunResult.chance_loss: ln C for a
    cross-entropy over C classes; a run at chance level, such as one whose weights blew
    up to a finite loss of 1e16), unless its val/acc is at least twice chance's. A task
    without that baseline (regression, a loss of one's own) did not learn when no
    validation after its first was below the first. Not "the last above the first" where
    there is a baseline: a run that learned in its first epoch and then overfit has learned.
    Such a run is pruned as `diverged`: its configuration and rate are no answer."""
    last = result.val_loss
    if not math.isfinite(last):
        return f"did not learn: {VAL_LOSS} is {last}"
    chance = result.chance_loss
    if chance is not None:
        if last < chance:
            return None
        classes = round(math.exp(chance))
        # Its loss above chance, its accuracy not: overconfident where wrong, yet it learned
        # (a ResNet at a high rate: val/acc 0.62 at val/loss 4.9 over 10 classes).
        if result.val_acc >= ACC_ABOVE_CHANCE / classes:
            return None
        return (
            f"did not learn: val/loss {last:.4g} is no better than a uniform guess over "
            f"{classes} classes (ln {classes} = {chance:.4g})"
        )
    losses = [e.get(VAL_LOSS, math.nan) for e in result.evals]
    if len(losses) > 1 and all(loss >= losses[0] for loss in losses[1:]):
        return (
            f"did not learn: val/loss {last:.4g}, no validation after its first below the "
            f"first's {losses[0]:.4g}"
        )
    return None
