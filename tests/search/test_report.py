"""The summary's derived facts: the OOM boundary and the rerun command."""

from __future__ import annotations

import io
import re

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial
from rich.console import Console

from search.report import (
    StudyProgress,
    counts_line,
    rerun_overrides,
    summary,
    summary_markdown,
    trial_line,
)
from tracking.metrics import THROUGHPUT_SAMPLES, THROUGHPUT_SPREAD, VAL_ACC


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
