"""The summary's derived facts: the OOM boundary and the rerun command."""

from __future__ import annotations

import io
import re

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial
from rich.console import Console

from batchfit.search.core.study_config import RecommendRule
from batchfit.search.results.critical_batch import StepsModel
from batchfit.search.results.recommend import Recommendation
from batchfit.search.results.summary import (
    StudyProgress,
    counts_line,
    rerun_overrides,
    summary,
    summary_markdown,
    trial_line,
)
from batchfit.search.results.time_to_target import Plan, Predicted
from batchfit.tracking.metrics import (
    ENERGY_PER_SAMPLE,
    THROUGHPUT_SAMPLES,
    THROUGHPUT_SPREAD,
    THROUGHPUT_TOKENS,
    TO_TARGET_J,
    TO_TARGET_S,
    VAL_ACC,
    VAL_LOSS,
    joules_per,
)


def _trial(batch: int, precision: str, state: TrialState, **attrs) -> optuna.trial.FrozenTrial:
    return create_trial(
        state=state,
        value=0.5 if state == TrialState.COMPLETE else None,
        params={"trainer.batch_size": batch},
        distributions={"trainer.batch_size": CategoricalDistribution([16, 64, 256, 512])},
        user_attrs={"trainer.batch_size": batch, "trainer.precision": precision, **attrs},
    )


def test_rerun_overrides_replace_sampled_keys_and_drop_study_settings() -> None:
    trial = _trial(64, "fp32", TrialState.COMPLETE, peak_bytes=1)
    base = [
        "+experiment=resnet",
        "data=digits",
        "trainer.batch_size=8",
        "search.n_trials=3",
        "search.memory_budget=1GiB",
    ]
    assert rerun_overrides(trial, base, {"optimizer.momentum": "0.8"}) == [
        "+experiment=resnet",
        "data=digits",
        "search.memory_budget=1GiB",
        "optimizer.momentum=0.8",
        "trainer.batch_size=64",
    ]


def test_trial_line_puts_the_spread_next_to_the_throughput() -> None:
    trial = _trial(
        64, "fp32", TrialState.COMPLETE, throughput=412.0, unit="samples", peak_bytes=1,
        metrics={THROUGHPUT_SAMPLES: 412.0, THROUGHPUT_SPREAD: 0.12},
    )  # fmt: skip
    assert "412 samples/s (±6%)" in trial_line(trial)


def test_trial_line_shows_state_reason_and_figures() -> None:
    line = trial_line(
        _trial(512, "fp32", TrialState.PRUNED, reason="oom", peak_bytes=3 * 2**20, message="over")
    )
    assert "PRUNED (oom)" in line and "batch_size=512" in line and "peak 3.0 MiB" in line


def test_a_trial_reason_is_printed_whole_wrapped_in_a_terminal() -> None:
    """A slow trial's reason runs past 120 characters: whole on the console, wrapped to a
    terminal's width, on one line in a log."""
    reason = (
        "a probe step projects 203 s of training for 1438 samples, over 1.5 x "
        "search.trial_time_budget_s=60, and 141 ms per sample is 3.1x the fastest trial's "
        "46 ms (the machine is not the cause)"
    )
    trial = _trial(64, "fp16", TrialState.PRUNED, reason="slow", message=reason)
    for terminal in (True, False):
        out = io.StringIO()
        console = Console(file=out, width=80, force_terminal=terminal, color_system=None)
        with StudyProgress(console, n_trials=4, done=0, metric=VAL_ACC) as progress:
            progress.print(trial_line(trial))
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
        lines = [line for line in re.split(r"[\r\n]", text) if line.strip()]
        assert reason in " ".join(text.split())  # whole
        if terminal:
            assert max(map(len, lines)) <= 80  # wrapped to the terminal
        else:
            assert any(reason in line for line in lines)  # one line in a log


def test_a_study_whose_only_repeat_is_of_a_pruned_oom_is_summarised() -> None:
    """The only REPEAT answers an OOM (no completed trial behind it): the counts, the
    summary and summary.md are made without dividing by the completed trials' repeats."""
    study = optuna.create_study(directions=["maximize"])
    oom = {"reason": "oom", "peak_bytes": 50 * 2**20, "budget_bytes": 40 * 2**20}
    study.add_trial(_trial(64, "fp32", TrialState.PRUNED, **oom))
    repeat = {**oom, "repeat_of": 0, "message": "the configuration of trial 0: answered"}
    study.add_trial(_trial(64, "fp32", TrialState.PRUNED, **repeat))
    study.add_trial(_trial(16, "fp32", TrialState.COMPLETE, val_acc=0.5))
    trials = study.get_trials()
    assert counts_line(trials) == (
        "2 finished trials: 1 COMPLETE, 1 PRUNED (oom); not counted, answered without "
        "training: 1 REPEAT"
    )
    console = Console(record=True, width=200)
    summary(console, study, [VAL_ACC], None)
    assert "1 REPEAT" in console.export_text()
    assert "1 REPEAT" in summary_markdown(study, [VAL_ACC], None)


# Energy, where the hardware counted it (train/measure/energy.py): per unit and to the target.
def _measured(**metrics: float) -> optuna.trial.FrozenTrial:
    unit = "tokens" if joules_per("tokens") in metrics else "samples"
    return _trial(64, "fp32", TrialState.COMPLETE, unit=unit, metrics=metrics)


def test_trial_line_shows_joules_per_unit_and_to_the_target() -> None:
    parts = trial_line(_measured(**{ENERGY_PER_SAMPLE: 0.52})).split(" | ")
    assert "0.52 J/sample" in parts
    parts = trial_line(_measured(**{joules_per("tokens"): 0.00312})).split(" | ")
    assert "0.00312 J/token" in parts
    parts = trial_line(_measured(**{TO_TARGET_S: 12.34, TO_TARGET_J: 1234.0})).split(" | ")
    assert "target in 12.3 s, 1.23 kJ" in parts
    # without an energy counter: no energy figure, nothing said of energy
    line = trial_line(_measured(**{TO_TARGET_S: 12.34}))
    assert "target in 12.3 s" in line.split(" | ") and " J" not in line


def _energy_study(to_target_j: float | None) -> optuna.Study:
    """Two completed trials, the first with its joules to the target where measured."""
    study = optuna.create_study(directions=["maximize"])
    first = {TO_TARGET_S: 12.0} | ({TO_TARGET_J: to_target_j} if to_target_j else {})
    study.add_trial(_trial(64, "fp32", TrialState.COMPLETE, val_acc=0.9, metrics=first))
    study.add_trial(_trial(16, "fp32", TrialState.COMPLETE, val_acc=0.8, metrics={}))
    return study


def _rec(study: optuna.Study) -> Recommendation:
    """Trial 0 recommended by a time-to-target plan made by hand: 64x1 fp32 in 200 steps of
    0.06 s and 9.8 J (12 s, 1960 J), 16x1 fp32 in 500 of 0.03 s without energy (15 s)."""
    plan = Plan(
        1.0, "search.target", StepsModel(100.0, 64.0), "fitted", None, (),
        (Predicted("64x1 fp32", 64, 200.0, 0.06, (0,), step_j=9.8),
         Predicted("16x1 fp32", 16, 500.0, 0.03, (1,))),
    )  # fmt: skip
    trial = study.get_trials()[0]
    return Recommendation(trial, RecommendRule(), 0.9, 2, 0.9, None, by_time=plan)


def test_summaries_show_the_energy_to_target_where_measured() -> None:
    """The time-to-target table gains its energy column ('-' where unmeasured), the trial
    tables an 'energy to target' column: trial 0's 1234 J, trial 1's '-'."""
    study = _energy_study(1234.0)
    text = summary_markdown(study, [VAL_ACC], _rec(study))
    assert "| configuration | global batch | steps | s/step | s/step from | time | energy |" in text
    assert "| 64x1 fp32 | 64 | 200 | 0.06 | measured | 12 s | 1.96 kJ | 12800 | #0 |" in text
    assert "| 16x1 fp32 | 16 | 500 | 0.03 | measured | 15 s | - | 8000 | #1 |" in text
    best = text.split("## Best trials")[1]
    assert best.splitlines()[2].endswith("| predicted MiB | energy to target |")
    rows = [
        line for line in best.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")
    ]
    assert [row.rsplit("|", 2)[1].strip() for row in rows] == ["1.23 kJ", "-"]
    console = Console(record=True, width=250)
    summary(console, study, [VAL_ACC], _rec(study))
    shown = console.export_text()
    assert "energy to target" in shown and "1.23 kJ" in shown and "1.96 kJ" in shown


def test_summaries_without_energy_have_no_energy_columns() -> None:
    study = _energy_study(None)
    rec = _rec(study)
    plan = rec.by_time
    unmeasured = Plan(
        plan.target, plan.target_source, plan.model, plan.source, None, (),
        tuple(Predicted(p.geometry, p.batch, p.steps, p.step_s, p.trials) for p in plan.predicted),
    )  # fmt: skip
    rec = Recommendation(rec.trial, rec.rule, 0.9, 2, 0.9, None, by_time=unmeasured)
    text = summary_markdown(study, [VAL_ACC], rec)
    assert "| time | samples |" in text and "energy" not in text
    console = Console(record=True, width=250)
    summary(console, study, [VAL_ACC], rec)
    assert "energy" not in console.export_text()


# What a trial trained with: the rate at its effective batch, not optimizer.lr at the
# reference batch (issue 41, 11).
def _scaled(batch: int, base_lr: float, scaled_lr: float, **attrs) -> optuna.trial.FrozenTrial:
    lr = FloatDistribution(0.01, 0.2, log=True)
    return create_trial(
        state=TrialState.COMPLETE,
        values=[0.9, 400.0],
        params={"trainer.batch_size": batch, "optimizer.lr": base_lr},
        distributions={
            "trainer.batch_size": CategoricalDistribution([64, 128]), "optimizer.lr": lr,
        },
        user_attrs={
            "trainer.batch_size": batch, "trainer.accum_steps": 1, "trainer.precision": "fp32",
            "effective_batch_size": batch, "global_batch_size": batch, "optimizer.lr": base_lr,
            "lr_scaled": scaled_lr, "lr_rule": "linear", "lr_reference": 128, **attrs,
        },
    )  # fmt: skip


def test_a_trial_line_shows_the_rate_it_trained_with_and_the_rule() -> None:
    line = trial_line(_scaled(64, 0.0518, 0.0259))
    assert "lr=0.0259 (0.0518 at 128, linear)" in line and "lr=0.0518 " not in line
    # at the reference batch the rate is optimizer.lr itself: said once
    assert "lr=0.05 |" in trial_line(_scaled(128, 0.05, 0.05)) + " |"


def test_the_pareto_table_shows_the_rate_trained_with() -> None:
    study = optuna.create_study(directions=["maximize", "maximize"])
    study.add_trial(_scaled(64, 0.0518, 0.0259))
    console = Console(record=True, width=200)
    summary(console, study, [VAL_ACC, THROUGHPUT_SAMPLES], None)
    shown = console.export_text()
    assert "0.0259" in shown and "0.0518 at 128" in shown
    assert "trainer.lr_scaling=linear" in shown  # the rule, said once under the table


def test_a_language_model_trial_line_shows_the_study_objectives() -> None:
    trial = _trial(
        64, "fp32", TrialState.COMPLETE, unit="tokens",
        metrics={VAL_LOSS: 2.3104, THROUGHPUT_TOKENS: 9120.0},
    )  # fmt: skip
    line = trial_line(trial, (VAL_LOSS, THROUGHPUT_TOKENS))
    assert "val loss 2.310" in line.split(" | ") and "val acc" not in line
    assert "9120 tokens/s" in line
