"""The learning rates a study reports: the rate each trial trained with beside optimizer.lr
(the rate at the reference batch, trainer.lr_ref_batch_size) and the rule that scaled it
(train/lr.py), and the rate to use at another batch."""

from __future__ import annotations

import math
from collections.abc import Sequence

from optuna.trial import FrozenTrial

from batchfit.search.core.record import TrialRecord, records
from batchfit.train.lr import scaled_lr
from batchfit.train.params import GLOBAL_PARAM, LR_PARAM, LR_REF_PARAM, LR_RULE_PARAM

LR_KEY = "optimizer.lr"  # the rate at the reference batch (trainer.lr_ref_batch_size)


def trained_lr(t: TrialRecord, rule: bool = True) -> str | None:
    """'0.0259 (0.0518 at 128, linear)': the rate a trial trained with, then optimizer.lr (the
    rate at the reference batch) and, with `rule`, the rule that scaled it; the rate alone
    where the two are one. None: no rate recorded."""
    trained, base = t.lr, t.run.get(LR_KEY)
    scaling, ref = t.run.get(LR_RULE_PARAM), t.run.get(LR_REF_PARAM)
    if trained is None:
        return None
    if base is None or scaling in (None, "none") or not ref or math.isclose(trained, base):
        return f"{trained:.3g}"
    return f"{trained:.3g} ({base:.3g} at {ref}" + (f", {scaling})" if rule else ")")


def lr_caption(trials: Sequence[FrozenTrial]) -> str | None:
    """Under a table of trials, the rule once: what the lr column's two rates are."""
    for t in records(trials):
        scaling, ref = t.run.get(LR_RULE_PARAM), t.run.get(LR_REF_PARAM)
        if LR_KEY in t.params and scaling not in (None, "none") and ref:
            return (
                f"lr: the rate each trial trained with; in brackets {LR_KEY}, the rate at a "
                f"batch of {ref}, scaled {scaling} to each trial's batch "
                f"(trainer.lr_scaling={scaling}, trainer.lr_ref_batch_size={ref})"
            )
    return None


def planned_lr(trial: FrozenTrial, batch: int | None = None) -> float | None:
    """The learning rate at the global batch one will train with (the trial's, or `batch`):
    the study's rule (train/lr.py) applied to the trial's rate; None where not recorded."""
    run = TrialRecord.of(trial).run
    rule, base, scaled = run.get(LR_RULE_PARAM), run.get("optimizer.lr"), run.get(LR_PARAM)
    batch, ref = batch or run.get(GLOBAL_PARAM), run.get(LR_REF_PARAM)
    if rule is None or base is None or scaled is None or not batch:
        return None
    if ref and rule != "none":
        return scaled_lr(base, batch, rule, ref)
    return scaled


def lr_plan(trial: FrozenTrial, batch: int | None = None) -> str | None:
    """The learning rate to use at the global batch one will train with: the study's rule
    (train/lr.py) applied to the recommended trial's rate, at its global batch or `batch`
    (a fit report cell no trial trained, which takes the trial's rate)."""
    run = TrialRecord.of(trial).run
    rule, base = run.get(LR_RULE_PARAM), run.get("optimizer.lr")
    batch, ref = batch or run.get(GLOBAL_PARAM), run.get(LR_REF_PARAM)
    scaled = planned_lr(trial, batch)
    if scaled is None:
        return None
    if rule == "none" or not ref:
        return (
            f"Learning rate: {scaled:.3g} at any global batch (trainer.lr_scaling={rule}: the "
            "rate as given; a rule such as linear or sqrt scales it with the batch)"
        )
    examples = ", ".join(
        f"{b} -> {scaled_lr(base, b, rule, ref):.3g}"
        for b in sorted({max(1, batch // 2), batch * 2})
    )
    return (
        f"Learning rate: the run trains at {scaled:.3g} at this global batch of {batch}: "
        f"batchfit scales optimizer.lr={base:.3g}, the rate at a global batch of {ref} "
        f"(trainer.lr_ref_batch_size), {rule} with the batch, so leave optimizer.lr as it is. "
        f"At another global batch (trainer.batch_size or trainer.accum_steps given after the "
        f"commands below) it trains at that batch's scaled rate: {examples}."
    )
