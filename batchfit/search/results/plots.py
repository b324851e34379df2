"""Pictures of a study, drawn from its trials: static PNGs (matplotlib) and one interactive
HTML page (Optuna's plotly visualisations). The study's parent MLflow run carries them under
`plots/`, redrawn as trials finish.

- `front.png`: the Pareto front, objective 0 on x and objective 1 on y as in study.html (one
  objective: the optimisation history), the recommended trial starred, OOM trials listed
  below the axes (they have no values to place); with no completed trial, how the trials
  ended instead;
- the plots against the batch (search/results/batch_plots.py);
- `energy_to_target.png`, where energy was measured: energy against time to the target
  per predicted configuration, the Pareto front of the two marked (filled, joined by its
  staircase; the configurations it dominates hollow) and the recommended one circled;
- `importances.png`: parameter importances per objective (Optuna's default evaluator,
  PED-ANOVA in Optuna 5), once MIN_IMPORTANCE_TRIALS trials have completed; throughput/*
  and memory/* over the batch geometry only (GEOMETRY_PARAMS);
- `study.html`: Optuna's Pareto front (or history), parallel coordinates and importances,
  with plotly.js embedded so the page works offline in MLflow's artifact viewer.
"""

from __future__ import annotations

import io
import textwrap
import warnings
from collections import Counter
from collections.abc import Sequence

import optuna
from matplotlib.axes import Axes
from matplotlib.figure import Figure  # without pyplot: no backend, no global figure state
from optuna.trial import TrialState

from batchfit.search.core.record import TrialRecord
from batchfit.search.results import time_to_target
from batchfit.search.results.batch_plots import (
    lr_vs_effective_batch,
    memory_vs_batch,
    throughput_vs_batch,
)
from batchfit.search.results.points import (
    GEOMETRY_METRICS,
    GEOMETRY_PARAMS,
    MIN_IMPORTANCE_TRIALS,
    Point,
    add_legend,
    footnote,
    listed,
    new_figure,
    no_data,
    points,
)
from batchfit.search.results.recommend import metric_value


def _none_completed(pts: Sequence[Point]) -> str:
    """What front.png says when no trial completed: how the trials ended."""
    if not pts:
        return "no trial has finished yet"
    pruned = Counter(p.reason or "pruner" for p in pts if p.state == "PRUNED")
    reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(pruned.items()))
    num_pruned = sum(pruned.values())
    if num_pruned == len(pts):
        return f"No trial completed: all {num_pruned} were pruned\n({reasons})"
    ended = f"{len(pts) - num_pruned} failed" + (f", {num_pruned} pruned" if pruned else "")
    return f"No trial completed: {ended}" + (f"\n({reasons})" if pruned else "")


def _pareto(ax: Axes, study: optuna.Study, metrics: Sequence[str], complete: list) -> None:
    """Objective 0 on x and objective 1 on y, as Optuna's plot_pareto_front in study.html."""
    x_name, y_name = metrics[0], metrics[1]
    on_front = {t.number for t in study.best_trials}  # Optuna's front, all objectives
    xs = [metric_value(t, x_name) for t in complete]
    ys = [metric_value(t, y_name) for t in complete]
    colors = ["tab:red" if t.number in on_front else "tab:blue" for t in complete]
    ax.scatter(xs, ys, c=colors, s=40)
    line = sorted((x, y) for t, x, y in zip(complete, xs, ys, strict=True) if t.number in on_front)
    # The front's points joined in order (a staircase would depend on the directions).
    ax.plot([x for x, _ in line], [y for _, y in line], "--", color="tab:red", alpha=0.6,
            label="Pareto front")  # fmt: skip
    for t, x, y in zip(complete, xs, ys, strict=True):
        ax.annotate(f"#{t.number}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(x_name)
    ax.set_ylabel(y_name)


def _history(ax: Axes, study: optuna.Study, metric: str, complete: list) -> None:
    maximize = study.directions[0] == optuna.study.StudyDirection.MAXIMIZE
    values = [t.values[0] for t in complete]
    ax.plot([t.number for t in complete], values, "o", color="tab:blue", label="trial")
    best, running = [], None
    for v in values:
        running = v if running is None else (max if maximize else min)(running, v)
        best.append(running)
    ax.step([t.number for t in complete], best, where="post", color="tab:red",
            label="best so far")  # fmt: skip
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)


def _star(ax: Axes, complete: list, recommended: int | None, metrics: Sequence[str]) -> None:
    for t in (t for t in complete if t.number == recommended):
        xy = (t.number, t.values[0]) if len(metrics) < 2 else (
            metric_value(t, metrics[0]), metric_value(t, metrics[1]))  # fmt: skip
        ax.plot(*xy, "*", markersize=18, color="gold", markeredgecolor="black",
                label=f"recommended (trial {t.number})")  # fmt: skip


def front(
    study: optuna.Study, metrics: Sequence[str], pts: Sequence[Point], recommended: int | None
) -> Figure:
    """The Pareto front of the first two objectives, or the history of a single one."""
    complete = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not TrialRecord.of(t).is_repeat
    ]
    pareto = len(metrics) >= 2
    fig, ax = new_figure(
        f"Pareto front: {metrics[1]} against {metrics[0]}"
        if pareto
        else f"Optimisation history: {metrics[0]}"
    )
    if not complete:
        no_data(ax, _none_completed(pts))
        ax.set_xticks([])
        ax.set_yticks([])
    elif pareto:
        _pareto(ax, study, metrics, complete)
    else:
        _history(ax, study, metrics[0], complete)
    _star(ax, complete, recommended, metrics)
    oom = [p for p in pts if p.oom]
    if oom:
        footnote(ax, listed("pruned as OOM (no values)", oom, lambda p: p.config), "tab:red")
    add_legend(ax)
    return fig


def _geometry_only(metric: str) -> bool:
    return metric.startswith(GEOMETRY_METRICS)


def _importance_params(metric: str, searched: set[str]) -> list[str] | None:
    """The params whose importance for `metric` is computed: for throughput/* and memory/*
    the batch geometry that the study searches (a learning rate that merely varies with it
    would otherwise take its credit); None for all."""
    return [p for p in GEOMETRY_PARAMS if p in searched] if _geometry_only(metric) else None


def _searched(study: optuna.Study) -> set[str]:
    return {
        p for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) for p in t.params
    }


def _importances_of(study: optuna.Study, metrics: Sequence[str]) -> dict[str, dict[str, float]]:
    searched = _searched(study)
    per_metric = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, metric in enumerate(metrics):
            params = _importance_params(metric, searched)
            if params == []:
                continue  # a geometry metric in a study that searches no geometry
            try:
                per_metric[metric] = optuna.importance.get_param_importances(
                    study, target=lambda t, i=i: t.values[i], params=params
                )
            except (RuntimeError, ValueError):  # a single distinct value, or one param only
                continue
    return per_metric


def _importances_title(metrics: Sequence[str]) -> str:
    title = "Parameter importances per objective (Optuna's default evaluator)"
    geometric = [m for m in metrics if _geometry_only(m)]
    if geometric:
        title += f"\n{', '.join(geometric)}: over the batch geometry only, not the lr"
    return title


def importances(study: optuna.Study, metrics: Sequence[str]) -> Figure | None:
    """Parameter importances per objective; None before MIN_IMPORTANCE_TRIALS completed."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < MIN_IMPORTANCE_TRIALS:
        return None
    per_metric = _importances_of(study, metrics)
    if not per_metric:
        return None
    fig, ax = new_figure(_importances_title(metrics))
    params = sorted({p for values in per_metric.values() for p in values})
    height = 0.8 / len(per_metric)
    for j, (metric, values) in enumerate(per_metric.items()):
        ys = [k + j * height for k in range(len(params))]
        label = f"{metric} (geometry only)" if _geometry_only(metric) else metric
        ax.barh(ys, [values.get(p, 0.0) for p in params], height=height, label=label)
    ax.set_yticks([k + 0.4 - height / 2 for k in range(len(params))], params)
    ax.set_xlabel("importance (normalised: the parameters' importances sum to 1)")
    add_legend(ax)
    return fig


def png(fig: Figure) -> bytes:
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110)
    return out.getvalue()


def _importance_figures(study: optuna.Study, names: Sequence[str]) -> list:
    from optuna import visualization as vis

    searched = _searched(study)
    figures = []
    for i, name in enumerate(names):
        params = _importance_params(name, searched)
        if params == []:
            continue
        try:
            figures.append(
                vis.plot_param_importances(
                    study,
                    params=params,
                    target=lambda t, i=i: t.values[i],
                    target_name=f"{name} (geometry only)" if params else name,
                )  # fmt: skip
            )
        except (RuntimeError, ValueError):
            continue
    return figures


def html(study: optuna.Study, metrics: Sequence[str]) -> str:
    """Optuna's own interactive plots of the study, on one self-contained page."""
    from optuna import visualization as vis

    names = list(metrics)
    figures = []
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if len(names) in (2, 3):  # Optuna draws a front of two or three objectives
            figures.append(vis.plot_pareto_front(study, target_names=names))
        else:
            figures.append(
                vis.plot_optimization_history(
                    study, target=lambda t: t.values[0], target_name=names[0]
                )
            )
        if complete:
            figures.append(
                vis.plot_parallel_coordinate(
                    study, target=lambda t: t.values[0], target_name=names[0]
                )
            )
        if len(complete) >= MIN_IMPORTANCE_TRIALS:
            figures.extend(_importance_figures(study, names))
    parts = [
        fig.to_html(full_html=False, include_plotlyjs=(k == 0)) for k, fig in enumerate(figures)
    ]
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{study.study_name}</title></head><body>"
        f"<h2>Study {study.study_name}</h2>{''.join(parts)}</body></html>"
    )


def time_to_target_plot(
    plan: time_to_target.Plan, recommended: time_to_target.Predicted | None = None
) -> Figure:
    """McCandlish et al. 2018's model fitted to the study, against the global batch: samples
    to the target (the curve E(B) = E_min (1 + B/B_crit), the trials that crossed it on it),
    and the time to it (each trained geometry's predicted steps x its seconds per step, the
    trials' measured times beside them, and the fit report's cells no trial trained).
    `recommended`: the configuration recommended (None: the plan's soonest)."""
    chosen = recommended or plan.best
    fig = Figure(figsize=(10, 4.8), layout="constrained")
    fig.suptitle("\n".join(textwrap.wrap(f"Time to target: {plan.describe()}", 110)), fontsize=10)
    samples, seconds = fig.subplots(1, 2)
    batches = [p.batch for p in plan.points]
    lo, hi = min(batches) / 2, max(batches) * (1 if plan.model.unbounded else 2)
    xs = [lo * (hi / lo) ** (i / 99) for i in range(100)]
    samples.plot(xs, [plan.model.samples(x) for x in xs], color="tab:orange", label="predicted")
    samples.scatter(
        batches, [p.steps * p.batch for p in plan.points], color="black", marker="x",
        label="trials, measured", zorder=3,
    )  # fmt: skip
    if not plan.model.unbounded:  # else above every batch measured, by how much unknown
        samples.axvline(plan.model.b_crit, color="gray", linestyle=":", label="B_crit")
    samples.set_ylabel("samples to target")
    trained = [p for p in plan.predicted if p.trials]
    seconds.scatter(
        [p.batch for p in trained], [p.seconds for p in trained], color="tab:blue",
        marker="D", label="predicted: steps x the geometry's measured s/step", zorder=2,
    )  # fmt: skip
    cells = [p for p in plan.predicted if not p.trials]
    if cells:
        seconds.scatter(
            [p.batch for p in cells], [p.seconds for p in cells], color="tab:green",
            marker="+", label="fit report cells no trial trained (s/step interpolated)",
        )  # fmt: skip
    for p in {*trained, chosen}:
        seconds.annotate(p.geometry, (p.batch, p.seconds), fontsize=7, xytext=(4, 4),
                         textcoords="offset points")  # fmt: skip
    seconds.scatter(
        batches, [p.steps * p.step_s for p in plan.points], facecolors="none",
        edgecolors="black", label="trials, measured", zorder=3,
    )  # fmt: skip
    seconds.scatter(
        [chosen.batch], [chosen.seconds], s=160, facecolors="none", edgecolors="tab:red",
        label="recommended", zorder=4,
    )  # fmt: skip
    seconds.set_ylabel("seconds to target")
    for ax in (samples, seconds):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("global batch size (samples per optimizer step)")
        ax.grid(True, which="both", alpha=0.3)
        add_legend(ax)
    return fig


def energy_to_target_plot(
    plan: time_to_target.Plan, recommended: time_to_target.Predicted | None = None
) -> Figure:
    """Each predicted configuration with its energy measured at its time (x) and energy
    (y) to the target, labelled with its geometry: those on the Pareto front of the two
    (`time_to_target.energy_front`) filled and joined by the front's staircase (what lies
    above and right of it is dominated), the others hollow; `recommended` (None: the
    plan's soonest) circled. Which configuration is worth its seconds in joules is the
    reader's choice; search.recommend.prefer=energy/... makes the front's frugal end it."""
    chosen = recommended or plan.best
    fig, ax = new_figure("Energy and time to the target per configuration (filled: Pareto front)")
    measured = plan.by_energy
    front = time_to_target.energy_front(measured)
    others = [p for p in measured if p not in front]
    if front:
        xs, ys = [p.seconds for p in front], [p.joules for p in front]
        ax.step(xs, ys, where="post", color="tab:green", alpha=0.6)  # dominated: above, right
        ax.plot(
            xs, ys, "o", color="tab:green",
            label="Pareto front: no configuration both faster and lower-energy",
        )  # fmt: skip
    if others:
        ax.plot(
            [p.seconds for p in others], [p.joules for p in others], "o", color="tab:gray",
            markerfacecolor="none", label="dominated: another is faster and lower-energy",
        )  # fmt: skip
    for p in measured:
        ax.annotate(p.geometry, (p.seconds, p.joules), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")  # fmt: skip
    if chosen.joules is not None:
        ax.scatter(
            [chosen.seconds], [chosen.joules], s=200, facecolors="none", edgecolors="tab:red",
            linewidths=1.5, label=f"recommended ({chosen.geometry})", zorder=4,
        )  # fmt: skip
    if not measured:
        no_data(ax, "no configuration has its energy measured")
    ax.set_xlabel("seconds to target (predicted)")
    ax.set_ylabel("joules to target (predicted)")
    add_legend(ax)
    return fig


def render(
    study: optuna.Study,
    metrics: Sequence[str],
    recommended: int | None,
    margin: float | None = None,
    plan: time_to_target.Plan | None = None,
    planned: time_to_target.Predicted | None = None,
) -> dict[str, bytes]:
    """Every plot of the study: file name -> content. `margin`: search.preflight_margin, for
    the memory plot's line where pruning starts (None: the budget line alone); `planned`:
    the configuration of `plan` recommended (None: its soonest)."""
    pts = points(study.get_trials(deepcopy=False))
    files = {
        "front.png": png(front(study, metrics, pts, recommended)),
        "throughput_vs_batch.png": png(throughput_vs_batch(pts)),
        "memory_vs_batch.png": png(memory_vs_batch(pts, margin)),
        "lr_vs_effective_batch.png": png(lr_vs_effective_batch(pts)),
    }
    importance = importances(study, metrics)
    if importance is not None:
        files["importances.png"] = png(importance)
    if plan is not None:
        files["time_to_target.png"] = png(time_to_target_plot(plan, planned))
        if plan.least_energy is not None:
            files["energy_to_target.png"] = png(energy_to_target_plot(plan, planned))
    files["study.html"] = html(study, metrics).encode()
    return files
