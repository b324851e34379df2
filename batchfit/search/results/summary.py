"""What the user sees: a progress bar over trials, a line per finished trial, and the final
summary (best trials, the OOM boundary per precision, the winner as overrides and as a
`python -m train` command). Everything is read back from the study, so a resumed study
reports all its trials, not only this process's."""

from __future__ import annotations

import math
import os
import shlex
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence

import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from batchfit.common.overrides import BEST_KEY, override_key
from batchfit.common.redact import redact
from batchfit.search.core.record import PRUNER, TrialRecord, figure_text, mib, records
from batchfit.search.core.trial_count import num_trained
from batchfit.search.results import boundary, speed_check, time_to_target
from batchfit.search.results.rates import LR_KEY, lr_caption, lr_plan, trained_lr
from batchfit.search.results.recommend import Recommendation
from batchfit.search.sampling.space import override_value
from batchfit.tracking.metrics import (
    DATA_WAIT_SHARE,
    PEAK_BYTES,
    THROUGHPUT_PREFIX,
    THROUGHPUT_SPREAD,
    TO_TARGET_J,
    TO_TARGET_S,
    VAL_ACC,
    VAL_PREFIX,
    joules_per,
)
from batchfit.train.device.sizes import format_bytes
from batchfit.train.parallel.threads import usable_cores
from batchfit.train.params import (
    ACCUM_KEY,
    BATCH_KEY,
)


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _fmt(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


# A trial line says when a configuration spends this share of its step time or more waiting
# for its input pipeline (loader.num_workers is then worth searching).
STARVED_SHARE = 0.2


def spread_note(t: TrialRecord) -> str:
    """' (±6%)': half the range of a trial's throughput over its logging intervals (how
    steady the machine was while it ran), when it has enough of them."""
    spread = t.outcome.metrics.get(THROUGHPUT_SPREAD)
    return "" if spread is None else f" (±{spread / 2:.0%})"


def energy_per_unit(t: TrialRecord) -> str:
    """'0.52 J/sample', '0.0031 J/token': a trial's joules per unit of its task, where the
    hardware counted them; '' elsewhere."""
    unit = t.outcome.unit or "samples"
    joules = t.outcome.figure(joules_per(unit))
    return "" if joules is None else f"{joules:.3g} J/{unit.removesuffix('s')}"


def _param_words(t: TrialRecord, key: str, value: object) -> str:
    lr = trained_lr(t) if key == LR_KEY else None
    return f"{_short(key)}={lr if lr is not None else _fmt(value)}"


def objective_words(metric: str, value: float) -> str:
    """'val loss 2.310', 'val acc 0.951': an objective as a trial line says it."""
    return (
        f"{metric.replace('/', ' ')} {value:.3f}"
        if abs(value) < 100
        else f"{metric} {figure_text(value)}"
    )


def trial_line(trial: FrozenTrial, objectives: Sequence[str] = (VAL_ACC,)) -> str:
    """A finished trial in one line: its configuration (the rate it trained with), its
    throughput, memory, the study's `objectives` (those not shown already) and how it ended."""
    t = TrialRecord.of(trial)
    o = t.outcome
    params = " ".join(_param_words(t, k, v) for k, v in t.params.items())
    parts = [f"#{t.number:<3} {t.label:<18} {params}"]
    if o.throughput is not None:
        parts.append(f"{o.throughput:.0f} {o.unit or 'samples'}/s{spread_note(t)}")
    per_unit = energy_per_unit(t)
    if per_unit:
        parts.append(per_unit)
    if o.peak_bytes is not None:
        parts.append(f"peak {format_bytes(o.peak_bytes)}")
    if o.predicted_bytes is not None:
        error = o.prediction_error
        parts.append(
            f"predicted {format_bytes(o.predicted_bytes)}"
            + (f" ({error:+.1%})" if error is not None else "")
        )
    for metric in objectives:
        value = o.figure(metric)
        if value is not None and not metric.startswith(THROUGHPUT_PREFIX) and metric != PEAK_BYTES:
            parts.append(objective_words(metric, value))
    to_target = o.figure(TO_TARGET_S)
    if to_target is not None:
        joules = o.figure(TO_TARGET_J)
        energy = f", {time_to_target.format_joules(joules)}" if joules is not None else ""
        parts.append(f"target in {to_target:.1f} s{energy}")
    wait = o.metrics.get(DATA_WAIT_SHARE)
    if wait is not None and wait >= STARVED_SHARE:
        parts.append(f"waiting for data {wait:.0%} of the time")
    if t.seconds is not None:
        parts.append(f"{t.seconds:.1f} s")
    if (t.state != "COMPLETE" or t.is_repeat) and o.message is not None:
        parts.append(f"[dim]{escape(o.message)}[/dim]")
    if t.is_unbilled:
        parts.append("[dim]not counted in search.n_trials[/dim]")
    return " | ".join(parts)


EPOCH_LINES_AFTER_S = 5.0  # a trial running longer shows its epochs


class StudyProgress:
    """Progress over trials, with the best so far, elapsed and estimated remaining time, and
    per-epoch progress inside a trial that runs longer than EPOCH_LINES_AFTER_S. A rich
    live display in a terminal; plain lines when the output is not one (CI and SLURM logs,
    where a live display would print nothing or garbage)."""

    def __init__(
        self,
        console: Console,
        n_trials: int,
        done: int,
        metric: str,
        objectives: Sequence[str] = (),
        timeout_s: float | None = None,
    ):
        self.console = console
        self.timeout_s = timeout_s  # search.timeout_s: no trial starts after it
        self.live = console.is_terminal
        self.n_trials = n_trials
        self.metric = metric
        self.objectives = tuple(objectives) or (metric,)  # what a trial line shows
        self.started = time.monotonic()
        self.done_at_start = done
        self.best = ""
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[left]}"),
            TextColumn("{task.fields[best]}"),
            console=console,
            transient=True,
            disable=not self.live,
        )
        self._trials = self._progress.add_task(
            "[bold]trials", total=n_trials, completed=done, best="", left=""
        )
        self._epochs = None

    def __enter__(self) -> StudyProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def print(self, text: str) -> None:
        """A line whole: wrapped to a terminal's width, on one line in a log (CI, SLURM),
        where a line per trial is what grep finds."""
        self._progress.console.print(text, soft_wrap=not self.live)

    def trial_finished(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.print(trial_line(trial, self.objectives))
        if self._epochs is not None:
            self._progress.remove_task(self._epochs)
            self._epochs = None
        done = num_trained(records(study.get_trials(deepcopy=False)))
        best = best_trials(study, limit=1)
        if best:
            self.best = f"best {self.metric} {_fmt(best[0].values[0])} (#{best[0].number})"
        left = self._left(done)
        self._progress.update(self._trials, completed=done, best=self.best, left=left)
        if not self.live:
            self.print(self._plain_line(done, left))

    def _plain_line(self, done: int, left: str) -> str:
        elapsed = time.monotonic() - self.started
        line = f"progress: {done}/{self.n_trials} trials, {_clock(elapsed)} elapsed"
        return line + (f", {left}" if left else "") + (f"; {self.best}" if self.best else "")

    def _left(self, done: int) -> str:
        """The time left: the trials to go at the pace of this run's, capped by what is
        left of search.timeout_s (after which no trial starts)."""
        elapsed = time.monotonic() - self.started
        new = done - self.done_at_start
        estimate = None
        if new > 0 and done < self.n_trials:
            estimate = elapsed / new * (self.n_trials - done)
        if self.timeout_s is not None and done < self.n_trials:
            box = self.timeout_s - elapsed
            if box <= 0:
                return "search.timeout_s reached: no new trial starts"
            if estimate is None or box < estimate:
                return f"~{_clock(box)} left (search.timeout_s)"
        return f"~{_clock(estimate)} left" if estimate is not None else ""

    def epoch(self, number: int, metrics: Mapping[str, float], elapsed_s: float) -> None:
        """A trial validated: show its epoch once it has run EPOCH_LINES_AFTER_S."""
        if elapsed_s < EPOCH_LINES_AFTER_S:
            return
        epoch, total = metrics.get("epoch", 0.0), metrics.get("num_epochs")
        of = f"/{total:g}" if total else ""
        figures = ", ".join(
            f"{k} {_fmt(v)}" for k, v in metrics.items() if k.startswith(VAL_PREFIX)
        )
        text = f"#{number} epoch {epoch:.2f}{of}: {figures} ({elapsed_s:.0f} s)"
        if not self.live:
            self.print(f"  {text}")
        elif self._epochs is None:
            self._epochs = self._progress.add_task(
                escape(text), total=total or None, completed=epoch, best="", left=""
            )
        else:
            self._progress.update(self._epochs, description=escape(text), completed=epoch)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return (
        f"{minutes}:{secs:02d}"
        if minutes < 60
        else f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"
    )


def best_trials(study: optuna.Study, limit: int = 5) -> list[FrozenTrial]:
    """The Pareto front (several objectives) or the top trials (one), best first."""
    if len(study.directions) > 1:
        front = [t for t in study.best_trials if not TrialRecord.of(t).is_repeat]
    else:
        front = [
            t
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if not TrialRecord.of(t).is_repeat
        ]
    sign = 1 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else -1
    return sorted(front, key=lambda t: -sign * t.values[0])[:limit]


def rerun_overrides(
    trial: FrozenTrial, base: Sequence[str], fixed: Mapping[str, str] | None = None
) -> list[str]:
    """The command line's overrides plus the space's fixed values and the trial's sampled
    ones: what `python -m train` needs to train exactly this trial. Study settings are left
    out, except the memory budget, which `python -m train` honours."""
    values = {**(fixed or {}), **{k: override_value(v) for k, v in trial.params.items()}}
    if "trainer.effective_batch_size" in values:  # derived accumulation: what the trial used
        run = TrialRecord.of(trial).run
        for key in (BATCH_KEY, ACCUM_KEY):
            if key in run:
                values[key] = override_value(run[key])
    kept = []
    for override in base:
        key = override_key(override)
        if key not in values and (not key.startswith("search.") or key == "search.memory_budget"):
            kept.append(override)
    return kept + [f"{k}={v}" for k, v in values.items()]


def rerun_command(overrides: Sequence[str]) -> str:
    return shlex.join(["python", "-m", "train", *overrides])


def summary(
    console: Console,
    study: optuna.Study,
    metrics: list[str],
    rec: Recommendation | None,
    overrides: Sequence[str] = (),
    best_path: str | None = None,
) -> None:
    trials = study.get_trials(deepcopy=False)
    console.print(f"\n[bold]Study {study.study_name}[/bold]: {counts_line(trials)}", soft_wrap=True)
    best = best_trials(study)
    if not best:
        console.print(f"[yellow]{escape(none_completed(trials))}[/yellow]", soft_wrap=True)
        return
    title = "Pareto front" if len(metrics) > 1 else "Best trials"
    table = Table(title=title)
    table.add_column("trial", justify="right")
    for key in best[0].params:
        table.add_column(_short(key))
    for metric in metrics:
        table.add_column(metric, justify="right")
    table.add_column("peak memory", justify="right")
    energy = energy_to_target(trials)
    if energy:
        table.add_column(ENERGY_COLUMN, justify="right")
    for t in best:
        record = TrialRecord.of(t)
        cells = [str(t.number)]
        for key, value in t.params.items():
            lr = trained_lr(record, rule=False) if key == LR_KEY else None
            cells.append(lr if lr is not None else _fmt(value))
        cells += [_fmt(v) for v in t.values]
        cells.append(format_bytes(TrialRecord.of(t).outcome.peak_bytes))
        table.add_row(*cells, *([_to_target_j(t)] if energy else []))
    table.caption = lr_caption(best)
    console.print(table)
    header, cells = boundary.table(study)
    if cells:
        console.print(_right_aligned(boundary.title(study), header, cells))
    header, rows = speed_table(study)
    if rows:
        console.print(_right_aligned(SPEED_TITLE, header, rows))
    if rec is None:
        return
    # Not rich markup: hydra.searchpath=[...] would be read as a tag and dropped.
    plain = {"soft_wrap": True, "markup": False, "highlight": False}
    if rec.by_time is not None:
        title = f"Time to target, predicted: {rec.by_time.describe()}"
        console.print(_right_aligned(title, *time_to_target.table(rec.by_time)))
    elif rec.by_time_note:
        console.print(rec.by_time_note + "; recommended by search.recommend's rule", **plain)
    console.print(f"[bold]Recommended[/bold]: {rec.describe()}", soft_wrap=True)
    plan = lr_plan(rec.trial, rec.untrained.batch if rec.untrained else None)
    if plan:
        console.print(plan, **plain)
    console.print("Overrides: " + redact(" ".join(overrides)), **plain)
    console.print("Train it again: " + redact(rerun_command(overrides)), **plain)
    if best_path:
        console.print(f"or: python -m train +{BEST_KEY}={shlex.quote(best_path)}", **plain)


SPEED_TITLE = "Speed check (the candidates timed side by side)"


def _right_aligned(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    table = Table(title=title)
    for column in header:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def speed_table(study: optuna.Study) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the study's speed check, fastest first: each geometry's median
    throughput, its slowest and fastest round, and their spread."""
    speeds = speed_check.stored(study)
    if not speeds:
        return [], []
    unit = next(iter(speeds.values())).unit
    header = ["configuration", f"{unit}/s (median)", "slowest-fastest round", "spread"]
    rows = []
    for name, s in sorted(speeds.items(), key=lambda item: -item[1].median(unit)):
        rates = s.rates(unit)
        rows.append(
            [name, f"{s.median(unit):.0f}", f"{min(rates):.0f}-{max(rates):.0f}",
             f"{s.spread(unit):.0%}"]
        )  # fmt: skip
    return header, rows


def _round_up(seconds: float) -> int:
    """The next of 1, 2, 3, 4, 5, 6, 8 x a power of ten: a budget to suggest."""
    scale = 10 ** math.floor(math.log10(max(seconds, 1.0)))
    return next(m * scale for m in (1, 2, 3, 4, 5, 6, 8, 10) if m * scale >= seconds)


# What to change for the trials that ended for a reason (state label -> advice).
ADVICE = {
    "PRUNED (oom_predicted)": "predicted over search.memory_budget: the fit report above shows "
    "which batch sizes fit; search smaller ones or raise the budget",
    "PRUNED (oom)": "out of memory: search smaller batch sizes, or raise search.memory_budget",
    "PRUNED (diverged)": "the loss diverged or did not learn (its message says which): "
    "narrow the optimizer.lr range in search.params",
    "PRUNED (missed_target)": "ended short of search.target: raise trainer.max_epochs or lower "
    "the target",
    f"PRUNED ({PRUNER})": "stopped by search.pruner below the median of the completed trials",
    "FAIL": "an error in training: its line above says which, its MLflow run's error.txt "
    "has the traceback",
}


def none_completed(trials: Sequence[FrozenTrial]) -> str:
    """Why a study has no completed trial, with counts and what to change. When every trial
    it trained was pruned as slow, the machine or the budget is the problem, not the
    configurations: by how much."""
    counted = [t for t in records(trials) if t.is_trained]
    slow = [t for t in counted if t.outcome.projected_s is not None]
    if counted and len(slow) == len(counted):
        return _all_slow(slow)
    by_state = counts_by_state(trials)
    if not by_state:
        return "No trial completed: none has finished yet."
    reasons = "; ".join(
        f"{n} {label}" + (f" ({ADVICE[label]})" if label in ADVICE else "")
        for label, n in sorted(by_state.items(), key=lambda item: -item[1])
    )
    return f"No trial completed. The trials ended as: {reasons}."


def _load_words() -> str:
    """'; this machine's load is 5.3 on the 2 cores this process may use', where known."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if load is None:
        return ""
    return f"; this machine's load is {load:.1f} on the {usable_cores()} cores this process may use"


def _all_slow(slow: Sequence[TrialRecord]) -> str:
    projected = sorted(t.outcome.projected_s for t in slow)
    budget = slow[-1].time_budget_s
    low, high = projected[0], projected[-1]
    if len(slow) == 1:
        return (
            f"The only trial was pruned as slow: it projected {high:.0f} s "
            f"({high / budget:.1f}x) against search.trial_time_budget_s={budget:g}"
            f"{_load_words()}. Raise search.trial_time_budget_s to ~{_round_up(high)} or "
            "free the machine."
        )
    span = f"{low:.0f}-{high:.0f} s ({low / budget:.1f}-{high / budget:.1f}x)"
    return (
        f"All {len(slow)} trials were pruned as slow: they projected {span} against "
        f"search.trial_time_budget_s={budget:g}{_load_words()}. The machine or the budget is the "
        f"problem, not the configurations: raise search.trial_time_budget_s to "
        f"~{_round_up(high)} or free the machine."
    )


def counts_by_state(trials: Sequence[FrozenTrial]) -> dict[str, int]:
    """Finished trials per state label ('COMPLETE', 'PRUNED (oom_predicted)', ...)."""
    by_state: dict[str, int] = defaultdict(int)
    for t in records(trials):
        if t.is_finished:
            by_state[t.label] += 1
    return dict(by_state)


def counts_line(trials: Sequence[FrozenTrial]) -> str:
    """'12 finished trials: 11 COMPLETE, 1 PRUNED (slow); not counted: 5 PRUNED
    (oom_predicted), 1 REPEAT'."""
    unbilled = {t.number for t in records(trials) if t.is_unbilled}
    counted = counts_by_state([t for t in trials if t.number not in unbilled])
    line = f"{sum(counted.values())} finished trials: " + ", ".join(
        f"{n} {label}" for label, n in sorted(counted.items())
    )
    free = counts_by_state([t for t in trials if t.number in unbilled])
    if free:
        line += "; not counted, answered without training: " + ", ".join(
            f"{n} {label}" for label, n in sorted(free.items())
        )
    return line


def _md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


TRIAL_COLUMNS = (
    "trial", "batch", "accum", "effective batch", "precision", "lr (trained)", "val acc",
    "samples/s", "peak MiB", "predicted MiB",
)  # fmt: skip


ENERGY_COLUMN = "energy to target"  # where some trial measured the joules to search.target


def energy_to_target(trials: Sequence[FrozenTrial]) -> bool:
    """Whether some trial measured its joules to search.target: the tables then show them."""
    return any(t.outcome.figure(TO_TARGET_J) is not None for t in records(trials))


def _to_target_j(trial: FrozenTrial) -> str:
    joules = TrialRecord.of(trial).outcome.figure(TO_TARGET_J)
    return "-" if joules is None else time_to_target.format_joules(joules)


def trial_columns(trials: Sequence[FrozenTrial]) -> tuple[str, ...]:
    """TRIAL_COLUMNS, the throughput in the unit the trials counted (tokens for an LM); the
    energy to target last where some trial measured it (`energy_to_target`)."""
    units = (t.outcome.unit for t in records(trials))
    unit = next((u for u in units if u is not None), None)
    columns = tuple(f"{unit}/s" if c == "samples/s" and unit else c for c in TRIAL_COLUMNS)
    return (*columns, ENERGY_COLUMN) if energy_to_target(trials) else columns


def trial_row(trial: FrozenTrial, energy: bool = False) -> list[str]:
    """A trial's row under `trial_columns`; `energy`: with its joules to the target."""
    t = TrialRecord.of(trial)
    complete, o = t.state == "COMPLETE", t.outcome
    throughput = o.throughput if complete else None
    return [
        str(t.number), _fmt(t.batch_size), _fmt(t.accum_steps), _fmt(t.effective_batch_size),
        _fmt(t.precision), _fmt(t.lr), _fmt(o.val_acc) if complete else "-",
        f"{throughput:.0f}{spread_note(t)}" if throughput else "-", mib(o.peak_bytes),
        mib(o.predicted_bytes), *([_to_target_j(trial)] if energy else []),
    ]  # fmt: skip


def summary_markdown(
    study: optuna.Study,
    metrics: Sequence[str],
    rec: Recommendation | None,
    overrides: Sequence[str] = (),
) -> str:
    """summary.md of the parent run (and its description): the recommendation and the
    command that trains it, the best trials, the OOM boundary per precision."""
    trials = study.get_trials(deepcopy=False)
    energy = energy_to_target(trials)
    parts = [f"# Study {study.study_name}", counts_line(trials) + "."]
    if not best_trials(study, limit=1):
        parts.append(none_completed(trials))
    if rec is not None:
        if rec.by_time is not None:
            parts += [
                f"## Time to target, predicted\n\n{rec.by_time.describe()}",
                _md_table(*time_to_target.table(rec.by_time)),
            ]
        plan = lr_plan(rec.trial, rec.untrained.batch if rec.untrained else None)
        rule = f"Rule: {rec.rule.describe()} (`search.recommend`)"
        if rec.by_time_note:
            rule = f"{rec.by_time_note}. {rule}"
        parts += [
            "## Recommended configuration",
            f"{rec.describe()}. {rule}." + (f"\n\n{plan}" if plan else ""),
        ]
        if rec.untrained is not None:
            parts.append(f"Trial {rec.trial.number}, whose learning rate it takes:")
        parts += [
            _md_table(trial_columns(trials), [trial_row(rec.trial, energy)]),
            "Train it again (or `python -m train +best=best.yaml` with this run's `best.yaml`):",
            f"```\n{redact(rerun_command(overrides))}\n```",
        ]
    best = best_trials(study, limit=10)
    if best:
        title = "Pareto front" if len(metrics) > 1 else "Best trials"
        parts += [
            f"## {title} ({', '.join(metrics)})",
            _md_table(trial_columns(trials), [trial_row(t, energy) for t in best]),
        ]
    header, cells = boundary.table(study)
    if cells:
        parts += [f"## {boundary.title(study)}", _md_table(header, cells)]
    header, rows = speed_table(study)
    if rows:
        parts += [f"## {SPEED_TITLE}", _md_table(header, rows)]
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    if pruned:
        reasons = [TrialRecord.of(t).outcome.reason or PRUNER for t in pruned]
        rows = [(t.number, *trial_row(t)[1:5], r) for t, r in zip(pruned, reasons, strict=True)]
        parts += [
            "## Pruned trials",
            _md_table(("trial", "batch", "accum", "effective batch", "precision", "reason"), rows),
        ]
    parts.append("Plots: `plots/` (PNG; `plots/study.html` is interactive).")
    return "\n\n".join(parts) + "\n"
