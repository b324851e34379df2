"""One trial: sample, re-compose the config with the sampled values, train, record.

The trial re-composes the config from the command line's overrides plus its own, so group
choices and interpolations behave exactly as on the command line. How it ends:
- COMPLETE with the objective values;
- PRUNED with a reason: `oom_predicted` (its step, computed on fake tensors before training,
  needs more than the budget), `oom` (over the budget when it ran), `diverged` (NaN/inf
  loss), `slow` (its measured speed cannot finish within search.trial_time_budget_s),
  `pruner` (the study's pruner, on per-epoch val/acc);
- FAIL with the error's message for anything unexpected; the study goes on.
Memory of a failed run is released after its exception is dropped, before the next trial.
With search.oom_constraint, every trial with a known (or predicted) peak also reports the
constraint `memory` = (peak - budget) / budget, positive for OOM, from which the sampler
learns where the boundary is (search/sampler.py).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import optuna
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from optuna.trial import FrozenTrial, TrialState

from search import record, report
from search.config import TO_TARGET, SearchConfig, Target
from search.outcome import Outcome, record_outcome
from search.sampler import CONSTRAINT
from search.space import SearchSpace
from search.study import REPEAT_ATTR, is_settled
from tracking.runs import ROLE_TAG, STATE_TAG, STUDY_TAG, TRIAL_TAG, RunLog, Tracker
from train.batches import steps_plan
from train.config import ConfigError
from train.flops import MFU_NOTE_TAG, perf_metrics
from train.loop import Diverged, Hooks, RunResult
from train.memory import MemoryStats, OutOfMemory, format_bytes, release_memory
from train.predict import Prediction, PredictionUnsupported, fits_budget, largest_fitting_batch
from train.run import RunSpec, data_params, memory_predictor, plan, predict, run, train_samples

# What is slow, on evidence that survives a busy machine: every trial of a study is slowed
# alike, so a trial is held to its budget *and* to the study's completed trials, not to the
# budget alone. Calibrated on ResNet-18/digits (2876 samples) on a 2-core AVX2 CPU, 60 s
# budget, where fp32 trials train in 10-28 s on an idle machine:
# - the probe (8 samples, timed once before the first step) projects 36-53 s for those
#   idle, but 250-1587 s beside other busy processes (the old absolute margin, 4 x 60 s,
#   then pruned every trial: issue 16); fp16/bf16 run 30-40x slower than fp32 there (no
#   native kernels): 680-1300 s idle. Alone, a probe prunes over PROBE_MARGIN x the budget;
#   beside completed trials, over STEP_MARGIN x the budget and PROBE_OTHERS_MARGIN x their
#   median probe. In the quick start beside two CPU-bound processes (load 4-5), the fp32
#   probes of its 11 completed trials ranged 14-75 ms per sample (median 48.5) and its fp16
#   probe took 716 ms, 14.8x that median.
PROBE_MARGIN = 100.0
PROBE_OTHERS_MARGIN = 10.0
# - real steps: the first SETTLE_STEPS (memory-tracked, warm-up, kernel selection) are left
#   out, and the mean of at least TIMED_STEPS after them projects the run. Slow: over
#   STEP_MARGIN x the budget and OTHERS_MARGIN x the completed trials' median time; while
#   none has completed, over ALONE_MARGIN x the budget. In that quick start the completed
#   trials took 53-163 s (median 80): none over 1.8x the median of those before it.
SETTLE_STEPS = 3
TIMED_STEPS = 3
STEP_MARGIN = 1.5
OTHERS_MARGIN = 4.0
ALONE_MARGIN = 10.0


@dataclass(frozen=True)
class Yardstick:
    """What the study's trials that trained their whole budget (all workers') took: the
    median of their wall time and of their probe's seconds per sample; None before one did.
    Those are the completed trials and the ones pruned at the end for missing search.target
    (a time-to-target study whose trials all miss it still has a yardstick). A trial's whole
    time (build, prediction, records) is a little more than its training: the rule errs
    lenient."""

    seconds: float | None = None
    probe_s_per_sample: float | None = None

    @classmethod
    def of(cls, study: optuna.Study) -> Yardstick:
        done = [
            t.user_attrs
            for t in study.get_trials(
                deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)
            )
            if REPEAT_ATTR not in t.user_attrs and _trained_its_budget(t)
        ]
        return cls(
            _median(a.get("seconds") for a in done), _median(a.get(record.PROBE) for a in done)
        )


def _trained_its_budget(trial: FrozenTrial) -> bool:
    missed = trial.user_attrs.get(record.REASON) == record.MISSED_TARGET
    return trial.state == TrialState.COMPLETE or missed


def _median(values: Iterable[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 2] if known else None


def trained_before(trial: optuna.Trial) -> FrozenTrial | None:
    """The earlier trial of the same configuration (all sampled values equal) whose outcome a
    new run would repeat (search/study.py `is_settled`), if any."""
    for earlier in trial.study.get_trials(
        deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)
    ):
        same = earlier.number != trial.number and earlier.params == trial.params
        if same and is_settled(earlier):
            return earlier
    return None


def answer_from_record(trial: optuna.Trial, earlier: FrozenTrial) -> list[float]:
    """End `trial` as `earlier` ended, without training it or opening an MLflow run: the
    sampler sees the same state, values and memory constraint (not a pruned trial's
    intermediate values), search.n_trials does not count it."""
    trial.set_user_attr(REPEAT_ATTR, earlier.number)
    trial.set_user_attr(record.STATE, earlier.state.name)
    if CONSTRAINT in earlier.constraints:
        trial.set_constraint(CONSTRAINT, earlier.constraints[CONSTRAINT])
    message = (
        f"the configuration of trial {earlier.number} ({report.state_label(earlier)}): answered "
        "from its record"
    )
    trial.set_user_attr(record.MESSAGE, message)
    if earlier.state == TrialState.PRUNED:
        trial.set_user_attr(record.REASON, earlier.user_attrs[record.REASON])
        raise optuna.TrialPruned(message)
    return list(earlier.values)


def last(items: list[Any]) -> Any:
    return items[-1] if items else None


class Prune(Exception):
    """Stop this trial as PRUNED for `reason` (`slow`: with the training it projected)."""

    def __init__(self, reason: str, message: str, projected_s: float | None = None):
        super().__init__(message)
        self.reason = reason
        self.projected_s = projected_s


# With search.target and no trainer.val_every_steps, a trial validates this often an epoch, so
# that the time to the target is known to a quarter of an epoch.
TARGET_VALIDATIONS_PER_EPOCH = 4


class TargetWatch:
    """Ends a run at the first validation that reaches search.target (none: never) and
    keeps the training seconds until then."""

    def __init__(self, target: Target | None):
        self.target = target
        self.seconds: float | None = None  # time/train_s when it was reached
        self.best: float | None = None

    def reached(self, metrics: dict) -> bool:
        if self.target is None:
            return False
        value = metrics.get(self.target.metric)
        if value is not None and (self.best is None or self.target.met_better(value, self.best)):
            self.best = value
        if self.target.met(value):
            self.seconds = metrics["time/train_s"]
            return True
        return False

    @property
    def missed(self) -> bool:
        return self.target is not None and self.seconds is None

    def figures(self) -> dict[str, float]:
        return {TO_TARGET: self.seconds} if self.seconds is not None else {}

    def missed_message(self, result: RunResult) -> str:
        epochs = result.evals[-1]["epoch"] if result.evals else 0
        return (
            f"{self.target.metric} reached {self.best:.4g} at best in {epochs:g} epochs, short "
            f"of search.target {self.target}"
        )


class TimeBudget:
    """Prunes a trial as `slow` once its measured speed shows that it cannot fit its budget:
    its probe, or its real steps, over the budget and far over the study's completed trials
    (far over the budget while none has completed)."""

    def __init__(self, budget_s: float | None, yardstick: Yardstick | None = None):
        self.budget_s = budget_s
        self.yardstick = yardstick or Yardstick()
        self._settled_s: float | None = None  # elapsed at SETTLE_STEPS

    def _budget(self, margin: float) -> str:
        return f"{margin:g} x search.trial_time_budget_s={self.budget_s:g}"

    def on_probe(self, seconds_per_sample: float, num_samples: int) -> None:
        if not self.budget_s:
            return
        projected = seconds_per_sample * num_samples
        probe = f"a probe step projects {projected:.0f} s of training for {num_samples} samples"
        reference = self.yardstick.probe_s_per_sample
        if reference is None:
            if projected > PROBE_MARGIN * self.budget_s:
                raise Prune("slow", f"{probe}, over {self._budget(PROBE_MARGIN)}", projected)
        elif (
            projected > STEP_MARGIN * self.budget_s
            and seconds_per_sample > PROBE_OTHERS_MARGIN * reference
        ):
            raise Prune(
                "slow",
                f"{probe}, over {self._budget(STEP_MARGIN)}, and {seconds_per_sample * 1000:.3g} "
                f"ms per sample is over {PROBE_OTHERS_MARGIN:g} x the {reference * 1000:.3g} ms "
                "of the study's completed trials' probes (median)",
                projected,
            )

    def limit_s(self) -> float:
        """The projection of real steps past which a trial is slow."""
        assert self.budget_s
        if self.yardstick.seconds is None:
            return ALONE_MARGIN * self.budget_s
        return max(STEP_MARGIN * self.budget_s, OTHERS_MARGIN * self.yardstick.seconds)

    def _limit_words(self) -> str:
        if self.yardstick.seconds is None:
            return f"{self._budget(ALONE_MARGIN)} (no trial has completed to compare with)"
        return (
            f"{self._budget(STEP_MARGIN)} and {OTHERS_MARGIN:g} x the "
            f"{self.yardstick.seconds:.0f} s of the study's completed trials (median)"
        )

    def on_step(self, step: int, num_steps: int, elapsed_s: float) -> None:
        """After optimizer step `step` of `num_steps`, `elapsed_s` into the run."""
        if not self.budget_s:
            return
        if step == SETTLE_STEPS:
            self._settled_s = elapsed_s
        timed = step - SETTLE_STEPS
        projected, evidence = elapsed_s, f"{step} of {num_steps} steps took {elapsed_s:.0f} s"
        if self._settled_s is not None and timed >= TIMED_STEPS:
            rate = (elapsed_s - self._settled_s) / timed
            projected = max(elapsed_s, self._settled_s + rate * (num_steps - SETTLE_STEPS))
            evidence = (
                f"steps {SETTLE_STEPS + 1}-{step} of {num_steps} took {rate:.2g} s each, "
                f"projecting {projected:.0f} s"
            )
        if projected > self.limit_s():
            raise Prune("slow", f"{evidence}, over {self._limit_words()}", projected)


class Objective:
    def __init__(
        self,
        compose: Callable[[list[str]], DictConfig],
        space: SearchSpace,
        settings: SearchConfig,
        tracker: Tracker,
        parent_run_id: str,
        notify: Callable[[str], None] = print,
        overhead: Callable[[], dict[str, float]] | None = None,
        on_epoch: Callable[[int, dict, float], None] | None = None,
    ):
        self.compose = compose
        self.space = space
        self.settings = settings
        self.tracker = tracker
        self.parent_run_id = parent_run_id
        self.notify = notify  # says a thing once to the user, between trial lines
        # Seconds of storage and MLflow calls since the previous trial (search/overhead.py).
        self.overhead = overhead or dict
        # (trial number, validation metrics, seconds since the trial began): progress display
        self.on_epoch = on_epoch
        self._unsupported_said = False
        self._mfu_said = False

    def _compose(self, overrides: list[str]) -> DictConfig:
        try:
            return self.compose(overrides)
        except HydraException as error:
            raise ConfigError([f"trial overrides {overrides} do not compose: {error}"]) from None

    def _prediction(self, cfg: DictConfig, spec: RunSpec) -> Prediction | None:
        """The trial's predicted peak, or None (and a note, once) when the model cannot run
        on fake tensors: the trial then measures its memory as it trains."""
        try:
            return predict(cfg, spec)
        except PredictionUnsupported as error:
            self._say_unsupported(error)
            return None

    def _say_unsupported(self, error: PredictionUnsupported) -> None:
        if not self._unsupported_said:
            self._unsupported_said = True
            self.notify(
                f"memory is not predicted for this model: it does not run on fake tensors "
                f"({error}); trials measure their memory as they train"
            )

    def _configure(
        self, params: dict[str, Any]
    ) -> tuple[DictConfig, RunSpec, Prediction | None, bool]:
        """The trial's config, run spec and predicted peak, and whether it is predicted to fit.
        With search.accumulation=derived the effective batch is sampled and the micro-batch is
        the largest divisor of it that is predicted to fit."""
        overrides = self.space.overrides(params)
        if self.settings.accumulation == "derived":
            return self._derive(overrides)
        cfg = self._compose(overrides)
        spec = plan(cfg, self.settings.memory_budget)
        if not self.settings.preflight:
            return cfg, spec, None, True
        prediction = self._prediction(cfg, spec)
        return cfg, spec, prediction, self._fits(prediction, spec.budget_bytes)

    def configuration(self, trial: FrozenTrial) -> tuple[DictConfig, RunSpec]:
        """The config and run spec a finished trial trained with (the speed check's)."""
        cfg, spec, _, _ = self._configure(trial.params)
        return cfg, spec

    def _fits(self, prediction: Prediction | None, budget_bytes: int | None) -> bool:
        if prediction is None or budget_bytes is None:
            return True
        return fits_budget(prediction.peak_bytes, budget_bytes, self.settings.preflight_margin)

    def _derive(self, overrides: list[str]) -> tuple[DictConfig, RunSpec, Prediction | None, bool]:
        # First as one micro-batch of the whole effective batch (a consistent config) ...
        cfg = self._compose(overrides)
        effective = cfg.trainer.effective_batch_size
        whole = [f"trainer.batch_size={effective}", "trainer.accum_steps=1"]
        cfg = self._compose(overrides + whole)
        spec = plan(cfg, self.settings.memory_budget)
        try:
            predictor = memory_predictor(cfg, spec)
            num_train = train_samples(cfg)
            found = largest_fitting_batch(
                predictor, spec.trainer, num_train, spec.limit_bytes, self.settings.preflight_margin
            )
        except PredictionUnsupported as error:
            self._say_unsupported(error)
            return cfg, spec, None, True
        if found is None:  # not even a micro-batch of 1 fits (or trains)
            try:
                prediction = predictor.predict(spec.trainer, num_train)
            except PredictionUnsupported:
                prediction = None
            return cfg, spec, prediction, False
        # ... then as the largest micro-batch that fits, accumulated to the effective batch.
        batch_size, prediction = found
        split = [
            f"trainer.batch_size={batch_size}",
            f"trainer.accum_steps={effective // batch_size}",
        ]
        cfg = self._compose(overrides + split)
        return cfg, plan(cfg, self.settings.memory_budget), prediction, True

    def __call__(self, trial: optuna.Trial) -> list[float]:
        started = time.perf_counter()
        params = self.space.suggest(trial)
        earlier = trained_before(trial)
        if earlier is not None:
            return answer_from_record(trial, earlier)
        cfg, spec, prediction, fits = self._configure(params)
        values = spec.params()
        for key, value in values.items():
            trial.set_user_attr(key, value)
        run_log = self.tracker.start_run(
            report.run_name(trial.number, values),
            tags={
                ROLE_TAG: "trial",
                STUDY_TAG: self.settings.study_name,
                TRIAL_TAG: trial.number,
            },
            parent_id=self.parent_run_id,
        )
        if run_log.run_id is not None:  # None while MLflow is unreachable: known later
            trial.set_user_attr("mlflow_run_id", run_log.run_id)
        try:
            run_log.params({**values, **params, **data_params(cfg)})
            run_log.text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
            if fits:
                outcome = self._train(trial, cfg, spec, run_log)
            else:
                need = (
                    f"its step is predicted to need {format_bytes(prediction.peak_bytes)}"
                    if prediction is not None
                    else "no micro-batch of it can train"
                )
                outcome = Outcome(
                    "PRUNED",
                    "oom_predicted",
                    f"{need}, over the budget of {format_bytes(spec.limit_bytes)} less "
                    f"search.preflight_margin={self.settings.preflight_margin:g}",
                )
            outcome.prediction = prediction
            seconds = time.perf_counter() - started
        except KeyboardInterrupt:
            run_log.tags({STATE_TAG: "KILLED"})  # as a dead worker's runs are ended
            run_log.finish("KILLED")
            raise
        return record_outcome(
            trial, outcome, run_log, spec, seconds, self.settings, self.overhead()
        )

    def _train(self, trial: optuna.Trial, cfg: DictConfig, spec: RunSpec, log: RunLog) -> Outcome:
        budget = TimeBudget(self.settings.trial_time_budget_s, Yardstick.of(trial.study))
        target = TargetWatch(self.settings.target)
        steps_per_epoch, num_steps = steps_plan(train_samples(cfg), spec.trainer)
        if self.settings.target is not None and spec.trainer.val_every_steps is None:
            every = max(1, steps_per_epoch // TARGET_VALIDATIONS_PER_EPOCH)
            spec = replace(spec, trainer=replace(spec.trainer, val_every_steps=every))
        on_eval = self._on_eval(trial, log)
        seen: list[MemoryStats] = []  # past the memory check: what it measured

        def probed(seconds_per_sample: float, num_samples: int) -> None:
            trial.set_user_attr(record.PROBE, seconds_per_sample)  # later trials' yardstick
            budget.on_probe(seconds_per_sample, num_samples)

        def memory_seen(stats: MemoryStats) -> None:
            seen.append(stats)
            trial.set_user_attr(record.PEAK, stats.peak_bytes)

        def on_validation(step: int, metrics: dict) -> bool:
            # The run ends here when it has reached its target or trained all its steps:
            # the pruner then would save nothing and throw a result away.
            reached = target.reached(metrics)
            on_eval(step, metrics, final=reached or step >= num_steps)
            return reached

        hooks = Hooks(
            on_probe=probed,
            on_step=budget.on_step,
            on_log=lambda step, metrics: log.metrics(metrics, step),
            on_eval=on_validation,
            on_memory=memory_seen,
        )
        outcome = None
        try:
            with self.tracker.system_metrics(log.run_id):
                result = run(cfg, spec, hooks)
            perf = self._perf(cfg, spec, result, trial, log)
            extra = {**perf, **target.figures()}
            outcome = Outcome("COMPLETE", result=result, extra=extra)
            if target.missed:  # its figures are kept; it cannot be ranked by time to target
                message = target.missed_message(result)
                outcome = Outcome(
                    "PRUNED", record.MISSED_TARGET, message, result=result, extra=extra
                )
        except OutOfMemory as oom:
            outcome = Outcome("PRUNED", "oom", str(oom), peak_bytes=oom.peak_bytes)
        except Diverged as diverged:
            outcome = Outcome("PRUNED", "diverged", str(diverged), memory=last(seen))
        except Prune as prune:
            outcome = Outcome("PRUNED", prune.reason, str(prune), memory=last(seen))
            outcome.projected_s = prune.projected_s
        except ConfigError:
            raise
        except Exception as error:  # noqa: BLE001 - one trial's error must not end the study
            outcome = Outcome(
                "FAIL",
                "error",
                f"{type(error).__name__}: {error}",
                error_traceback=traceback.format_exc(),
            )
        # Outside the except blocks: the exception and the frames it pinned are gone.
        release_memory(spec.device)
        return outcome

    def _perf(
        self, cfg: DictConfig, spec: RunSpec, result: RunResult, trial: optuna.Trial, log: RunLog
    ) -> dict[str, float]:
        """perf/* of a completed run: FLOPs per sample counted on the predictor's fake model,
        and MFU against the device's peak (train/flops.py); none for a model that does not
        run on fake tensors. An MFU above 1 comes with a note of why (tag, user attr, and
        said once)."""
        try:
            flops = memory_predictor(cfg, spec).flops_per_sample(spec.trainer.batch_size)
        except PredictionUnsupported:
            return {}
        figures, note = perf_metrics(
            flops,
            result.throughput_samples_per_sec,
            spec.device,
            spec.trainer.precision,
            spec.trainer.peak_flops,
        )
        if note:
            log.tags({MFU_NOTE_TAG: note})
            trial.set_user_attr(record.MFU_NOTE, note)
            if not self._mfu_said:
                self._mfu_said = True
                self.notify(note)
        return figures

    def _on_eval(self, trial: optuna.Trial, log: RunLog) -> Callable[..., None]:
        single = len(self.settings.objectives) == 1
        started = time.perf_counter()
        validations = 0

        def on_eval(step: int, metrics: dict, final: bool) -> None:
            nonlocal validations
            figures = {k: v for k, v in metrics.items() if "/" in k}
            # The epoch as a metric of its own at every logged step: the UI's charts can
            # use it as their x-axis, comparing trials of different step sizes.
            figures["train/epoch"] = metrics["epoch"]
            log.metrics(figures, step, flush=True)
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
                            "pruner",
                            f"{metric}={value:.4f} at validation {validations} (step {step}) "
                            "is worse than the pruner allows",
                        )

        return on_eval
