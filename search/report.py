"""What the user sees: a progress bar over trials, a line per finished trial, and the final
summary (best trials, the OOM boundary per precision, the winner as overrides and as a
`python -m train` command). Everything is read back from the study, so a resumed study
reports all its trials, not only this process's."""

from __future__ import annotations

import shlex
from collections import defaultdict
from collections.abc import Mapping, Sequence

import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from search.redact import redact
from search.space import override_value
from search.study import counts_as_finished
from train.memory import format_bytes

PRECISION_KEY = "trainer.precision"
BATCH_KEY = "trainer.batch_size"


def state_label(trial: FrozenTrial) -> str:
    if trial.state == TrialState.PRUNED:
        return f"PRUNED ({trial.user_attrs.get('reason', 'pruner')})"
    return trial.state.name


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _fmt(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def trial_line(trial: FrozenTrial) -> str:
    attrs = trial.user_attrs
    params = " ".join(f"{_short(k)}={_fmt(v)}" for k, v in trial.params.items())
    parts = [f"#{trial.number:<3} {state_label(trial):<18} {params}"]
    if "throughput" in attrs:
        parts.append(f"{attrs['throughput']:.0f} samples/s")
    if "peak_bytes" in attrs:
        parts.append(f"peak {format_bytes(attrs['peak_bytes'])}")
    if "predicted_bytes" in attrs:
        error = attrs.get("prediction_error")
        parts.append(
            f"predicted {format_bytes(attrs['predicted_bytes'])}"
            + (f" ({error:+.1%})" if error is not None else "")
        )
    if "val_acc" in attrs:
        parts.append(f"val acc {attrs['val_acc']:.3f}")
    if "seconds" in attrs:
        parts.append(f"{attrs['seconds']:.1f} s")
    if trial.state != TrialState.COMPLETE and "message" in attrs:
        parts.append(f"[dim]{attrs['message'][:120]}[/dim]")
    return " | ".join(parts)


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]trials"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def best_trials(study: optuna.Study, limit: int = 5) -> list[FrozenTrial]:
    """The Pareto front (several objectives) or the top trials (one), best first."""
    if len(study.directions) > 1:
        front = study.best_trials
    else:
        front = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    sign = 1 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else -1
    return sorted(front, key=lambda t: -sign * t.values[0])[:limit]


def oom_boundary(trials: Sequence[FrozenTrial]) -> dict[str, tuple[int | None, int | None]]:
    """Per precision: (largest batch size that fitted, smallest that was pruned as OOM)."""
    fitted: dict[str, int] = {}
    failed: dict[str, int] = {}
    for t in trials:
        precision, batch = t.user_attrs.get(PRECISION_KEY), t.user_attrs.get(BATCH_KEY)
        if precision is None or batch is None:
            continue
        if t.user_attrs.get("reason") in ("oom", "oom_predicted"):
            failed[precision] = min(batch, failed.get(precision, batch))
        elif "peak_bytes" in t.user_attrs:  # it trained past the memory check
            fitted[precision] = max(batch, fitted.get(precision, batch))
    return {p: (fitted.get(p), failed.get(p)) for p in sorted(set(fitted) | set(failed))}


def rerun_overrides(
    trial: FrozenTrial, base: Sequence[str], fixed: Mapping[str, str] | None = None
) -> list[str]:
    """The command line's overrides plus the space's fixed values and the trial's sampled
    ones: what `python -m train` needs to train exactly this trial. Study settings are left
    out, except the memory budget, which `python -m train` honours."""
    values = {**(fixed or {}), **{k: override_value(v) for k, v in trial.params.items()}}
    if "trainer.effective_batch_size" in values:  # derived accumulation: what the trial used
        for key in (BATCH_KEY, "trainer.accum_steps"):
            if key in trial.user_attrs:
                values[key] = override_value(trial.user_attrs[key])
    kept = []
    for override in base:
        key = override.split("=", 1)[0].lstrip("+~")
        if key not in values and (not key.startswith("search.") or key == "search.memory_budget"):
            kept.append(override)
    return kept + [f"{k}={v}" for k, v in values.items()]


def summary(
    console: Console,
    study: optuna.Study,
    metrics: list[str],
    base_overrides: Sequence[str],
    fixed: Mapping[str, str] | None = None,
) -> None:
    trials = study.get_trials(deepcopy=False)
    by_state: dict[str, int] = defaultdict(int)
    for t in trials:
        if counts_as_finished(t):
            by_state[state_label(t)] += 1
    console.print(
        f"\n[bold]Study {study.study_name}[/bold]: {sum(by_state.values())} finished trials — "
        + ", ".join(f"{n} {label}" for label, n in sorted(by_state.items())),
        soft_wrap=True,
    )
    best = best_trials(study)
    if not best:
        console.print("[yellow]No trial completed; see the reasons above.[/yellow]")
        return
    title = "Pareto front" if len(metrics) > 1 else "Best trials"
    table = Table(title=title)
    table.add_column("trial", justify="right")
    for key in best[0].params:
        table.add_column(_short(key))
    for metric in metrics:
        table.add_column(metric, justify="right")
    table.add_column("peak memory", justify="right")
    for t in best:
        cells = [str(t.number), *(_fmt(v) for v in t.params.values())]
        cells += [_fmt(v) for v in t.values]
        table.add_row(*cells, format_bytes(t.user_attrs.get("peak_bytes")))
    console.print(table)
    boundary = Table(title="Memory boundary (batch size per precision)")
    for column in ("precision", "largest that fitted", "smallest OOM"):
        boundary.add_column(column, justify="right")
    for precision, (fit, oom) in oom_boundary(trials).items():
        boundary.add_row(precision, str(fit or "-"), str(oom or "-"))
    console.print(boundary)
    winner = best[0]
    overrides = rerun_overrides(winner, base_overrides, fixed)
    console.print(
        f"Best configuration (trial {winner.number}): " + redact(" ".join(overrides)),
        soft_wrap=True,
    )
    command = shlex.join(["python", "-m", "train", *overrides])
    console.print("Rerun it: " + redact(command), soft_wrap=True)
