"""When a trial stops before the end of its training, besides running out of memory.

- `slow` (`TimeBudget`): its measured speed shows that it cannot train within
  search.trial_time_budget_s, judged against the study's trials that trained their whole
  budget (`Yardstick`), so that a busy machine, which slows every trial alike, does not
  prune them all.
- search.target (`TargetWatch`): a run ends at the first validation that reaches it; one
  that never does is pruned `missed_target` at its end.
- `pruner` and the others are raised as `Prune` from the training loop's hooks
  (search/trial/objective.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from batchfit.search.core.record import SLOW, TrialRecord
from batchfit.search.core.study_config import TO_TARGET, Target
from batchfit.tracking.metrics import TRAIN_S
from batchfit.train.step import RunResult

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
    def of(cls, trials: Iterable[TrialRecord]) -> Yardstick:
        done = [t for t in trials if t.trained_its_budget]
        probes = (t.outcome.probe_s_per_sample for t in done)
        return cls(_median(t.seconds for t in done), _median(probes))


def _median(values: Iterable[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 2] if known else None


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
            self.seconds = metrics[TRAIN_S]
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
                raise Prune(SLOW, f"{probe}, over {self._budget(PROBE_MARGIN)}", projected)
        elif (
            projected > STEP_MARGIN * self.budget_s
            and seconds_per_sample > PROBE_OTHERS_MARGIN * reference
        ):
            raise Prune(
                SLOW,
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
            raise Prune(SLOW, f"{evidence}, over {self._limit_words()}", projected)
