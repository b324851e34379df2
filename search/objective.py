"""One trial: sample, re-compose the config with the sampled values, train, record.

The trial re-composes the config from the command line's overrides plus its own, so group
choices and interpolations behave exactly as on the command line. How it ends:
- COMPLETE with the objective values;
- PRUNED with a reason: `oom` (over the memory budget), `diverged` (NaN/inf loss), `slow`
  (its measured speed cannot finish within search.trial_time_budget_s), `pruner` (the
  study's pruner, on per-epoch val/acc);
- FAIL with the error's message for anything unexpected; the study goes on.
Memory of a failed run is released after its exception is dropped, before the next trial.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from search.config import SearchConfig
from search.space import SearchSpace
from search.tracking import RunLog, Tracker
from train.config import ConfigError
from train.loop import Diverged, Hooks, RunResult
from train.memory import OutOfMemory, release_memory
from train.run import RunSpec, plan, run

# The probe overestimates per-sample time (8 samples run less efficiently than a real
# micro-batch), so it only stops a trial projected far past its budget. Calibrated on
# ResNet-18/digits on an idle 2-core CPU: fp32 probes project 41-53 s for trials that train
# in 20-28 s; bf16/fp16 without native kernels project 680-840 s, over 4 x 60 s = 240 s.
PROBE_MARGIN = 4.0
# After a few real steps the projection is close; allow some slack for validation.
STEP_MARGIN = 1.5


class Prune(Exception):
    """Stop this trial as PRUNED for `reason`."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class TrialFailed(Exception):
    """This trial failed; the study goes on (the only exception `optimize` catches)."""


@dataclass
class Outcome:
    state: str  # COMPLETE, PRUNED or FAIL
    reason: str | None = None
    message: str = ""
    result: RunResult | None = None
    peak_bytes: int | None = None
    error_traceback: str | None = None


class TimeBudget:
    """Prunes a trial as `slow` as soon as its measured speed shows it cannot fit its budget."""

    def __init__(self, budget_s: float | None):
        self.budget_s = budget_s

    def on_probe(self, seconds_per_sample: float, num_samples: int) -> None:
        projected = seconds_per_sample * num_samples
        if self.budget_s and projected > PROBE_MARGIN * self.budget_s:
            raise Prune(
                "slow",
                f"a probe step projects {projected:.0f} s of training for {num_samples} samples, "
                f"far over search.trial_time_budget_s={self.budget_s:g}",
            )

    def on_step(self, step: int, num_steps: int, elapsed_s: float) -> None:
        if not self.budget_s:
            return
        projected = elapsed_s / step * num_steps
        if elapsed_s > STEP_MARGIN * self.budget_s or (
            step >= 3 and projected > STEP_MARGIN * self.budget_s
        ):
            raise Prune(
                "slow",
                f"{step} of {num_steps} steps took {elapsed_s:.0f} s, projecting "
                f"{projected:.0f} s, over search.trial_time_budget_s={self.budget_s:g}",
            )


def objective_values(result: RunResult, metrics: list[str]) -> list[float]:
    by_name = {
        "val/acc": result.val_acc,
        "val/loss": result.val_loss,
        "throughput/samples_per_sec": result.throughput_samples_per_sec,
        "memory/peak_bytes": float(result.peak_bytes),
    }
    return [by_name[m] for m in metrics]


class Objective:
    def __init__(
        self,
        compose: Callable[[list[str]], DictConfig],
        space: SearchSpace,
        settings: SearchConfig,
        tracker: Tracker,
        parent_run_id: str,
    ):
        self.compose = compose
        self.space = space
        self.settings = settings
        self.tracker = tracker
        self.parent_run_id = parent_run_id

    def __call__(self, trial: optuna.Trial) -> list[float]:
        params = self.space.suggest(trial)
        overrides = self.space.overrides(params)
        try:
            cfg = self.compose(overrides)
        except HydraException as error:
            raise ConfigError([f"trial overrides {overrides} do not compose: {error}"]) from None
        spec = plan(cfg, self.settings.memory_budget)
        values = spec.params()
        for key, value in values.items():
            trial.set_user_attr(key, value)
        run_log = self.tracker.start_run(
            f"trial-{trial.number}",
            tags={"batchfit.study": self.settings.study_name, "batchfit.trial": trial.number},
            parent_id=self.parent_run_id,
        )
        trial.set_user_attr("mlflow_run_id", run_log.run_id)
        try:
            run_log.params({**values, **params})
            run_log.text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
            started = time.perf_counter()
            outcome = self._train(trial, cfg, spec, run_log)
            seconds = time.perf_counter() - started
        except KeyboardInterrupt:
            run_log.tags({"batchfit.state": "INTERRUPTED"})
            run_log.finish("KILLED")
            raise
        return self._record(trial, outcome, run_log, spec, seconds)

    def _train(self, trial: optuna.Trial, cfg: DictConfig, spec: RunSpec, log: RunLog) -> Outcome:
        budget = TimeBudget(self.settings.trial_time_budget_s)
        hooks = Hooks(
            on_probe=budget.on_probe,
            on_step=budget.on_step,
            on_log=lambda step, metrics: log.metrics(metrics, step),
            on_eval=self._on_eval(trial, log),
            on_memory=lambda peak: trial.set_user_attr("peak_bytes", peak),
        )
        outcome = None
        try:
            outcome = Outcome("COMPLETE", result=run(cfg, spec, hooks))
        except OutOfMemory as oom:
            outcome = Outcome("PRUNED", "oom", str(oom), peak_bytes=oom.peak_bytes)
        except Diverged as diverged:
            outcome = Outcome("PRUNED", "diverged", str(diverged))
        except Prune as prune:
            outcome = Outcome("PRUNED", prune.reason, str(prune))
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

    def _on_eval(self, trial: optuna.Trial, log: RunLog) -> Callable[[int, dict], None]:
        single = len(self.settings.objectives) == 1

        validations = 0

        def on_eval(step: int, metrics: dict) -> None:
            nonlocal validations
            log.metrics({k: v for k, v in metrics.items() if "/" in k}, step, flush=True)
            validations += 1
            if single:
                metric = self.settings.metrics[0]
                value = metrics.get(metric)
                if value is not None:
                    # Report per validation, not per optimizer step: trials with different
                    # effective batches validate at different steps, and pruners compare
                    # trials at equal steps.
                    trial.report(value, validations)
                    if trial.should_prune():
                        raise Prune(
                            "pruner",
                            f"{metric}={value:.4f} at validation {validations} (step {step}) "
                            "is worse than the pruner allows",
                        )

        return on_eval

    def _record(
        self, trial: optuna.Trial, outcome: Outcome, log: RunLog, spec: RunSpec, seconds: float
    ) -> list[float]:
        attrs: dict[str, Any] = {"state": outcome.state, "seconds": round(seconds, 2)}
        metrics: dict[str, float] = {"time/trial_s": seconds}
        if spec.budget_bytes is not None:
            attrs["budget_bytes"] = metrics["memory/budget_bytes"] = spec.budget_bytes
        result = outcome.result
        if result is not None:
            attrs.update(
                throughput=result.throughput_samples_per_sec,
                step_ms=result.step_ms,
                val_acc=result.val_acc,
                peak_bytes=result.peak_bytes,
            )
            metrics.update(result.metrics())
        elif outcome.peak_bytes is not None:
            attrs["peak_bytes"] = metrics["memory/peak_bytes"] = outcome.peak_bytes
        if outcome.reason:
            attrs["reason"] = outcome.reason
            attrs["message"] = outcome.message[:1000]
        if outcome.state == "FAIL":
            attrs["error"] = outcome.message[:1000]
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        log.metrics(
            {k: v for k, v in metrics.items() if v == v}, step=result.num_steps if result else 0
        )
        tags = {"batchfit.state": outcome.state}
        if outcome.reason:
            tags.update(
                {
                    "batchfit.prune_reason": outcome.reason,
                    "batchfit.message": outcome.message[:5000],
                }
            )
        log.tags(tags)
        if outcome.error_traceback:
            log.text(outcome.error_traceback, "error.txt")
        log.finish("FAILED" if outcome.state == "FAIL" else "FINISHED")
        if outcome.state == "PRUNED":
            raise optuna.TrialPruned(f"{outcome.reason}: {outcome.message}")
        if outcome.state == "FAIL":
            raise TrialFailed(outcome.message)
        assert result is not None
        return objective_values(result, self.settings.metrics)
