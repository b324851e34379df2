"""Pictures of a study, drawn from its trials: static PNGs (matplotlib) and one interactive
HTML page (Optuna's plotly visualisations). The study's parent MLflow run carries them under
`plots/`, redrawn as trials finish.

- `front.png`: the Pareto front of the first two objectives (one objective: the optimisation
  history), the recommended trial starred, OOM trials listed (they have no values to place);
- `throughput_vs_batch.png`: throughput against batch size, one series per precision, OOM
  trials as crosses on the axis at the batch size where they failed;
- `memory_vs_batch.png`: measured and predicted peak memory (MiB) against batch size per
  precision, the budget as a line;
- `lr_vs_effective_batch.png`: the learning rate trained with against the effective batch,
  coloured by val accuracy, with the line of the linear scaling rule through the best trial;
- `importances.png`: parameter importances per objective (Optuna's default evaluator,
  PED-ANOVA in Optuna 5), once
  MIN_IMPORTANCE_TRIALS trials have completed;
- `study.html`: Optuna's Pareto front (or history), parallel coordinates and importances,
  with plotly.js embedded so the page works offline in MLflow's artifact viewer.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import optuna
from matplotlib.axes import Axes
from matplotlib.figure import Figure  # without pyplot: no backend, no global figure state
from optuna.trial import FrozenTrial, TrialState

from search import record
from search.recommend import metric_value
from search.study import SURPLUS_ATTR, is_repeat
from train.run import ACCUM_KEY, BATCH_KEY, EFFECTIVE_PARAM, LR_PARAM, PRECISION_KEY

MIN_IMPORTANCE_TRIALS = 5  # fewer completed trials say nothing about importance
MIB = 2**20
PRECISION_COLORS = {
    "fp32": "tab:blue", "tf32": "tab:purple", "bf16": "tab:green", "fp16": "tab:orange",
}  # fmt: skip


@dataclass(frozen=True)
class Point:
    """One trial, as the plots see it (from its user attrs)."""

    number: int
    state: str  # COMPLETE, PRUNED, FAIL
    reason: str | None
    precision: str
    batch_size: int | None
    accum_steps: int | None
    effective_batch_size: int | None
    lr: float | None  # the rate trained with (scaled to the effective batch)
    throughput: float | None  # in `unit`/s
    unit: str
    val_acc: float | None
    peak_bytes: float | None
    predicted_bytes: float | None
    budget_bytes: float | None

    @property
    def oom(self) -> bool:
        return self.reason in record.OOM_REASONS


def points(trials: Sequence[FrozenTrial]) -> list[Point]:
    found = []
    for t in trials:
        a = t.user_attrs
        if t.state not in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
            continue
        if BATCH_KEY not in a or SURPLUS_ATTR in a:
            continue  # never configured (a surplus trial, a repeat, or killed before its config)
        complete = t.state == TrialState.COMPLETE
        found.append(
            Point(
                number=t.number,
                state=t.state.name,
                reason=a.get(record.REASON),
                precision=str(a.get(PRECISION_KEY)),
                batch_size=a.get(BATCH_KEY),
                accum_steps=a.get(ACCUM_KEY),
                effective_batch_size=a.get(EFFECTIVE_PARAM),
                lr=a.get(LR_PARAM),
                throughput=a.get(record.THROUGHPUT) if complete else None,
                unit=a.get(record.UNIT, "samples"),
                val_acc=a.get(record.VAL_ACC) if complete else None,
                peak_bytes=a.get(record.PEAK),
                predicted_bytes=a.get(record.PREDICTED),
                budget_bytes=a.get(record.BUDGET),
            )
        )
    return found


def _color(precision: str) -> str:
    return PRECISION_COLORS.get(precision, "tab:gray")


def _log2_batch_axis(ax: Axes, batches: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted({b for b in batches if b})
    if ticks:
        ax.set_xticks(ticks, [str(b) for b in ticks])
        ax.minorticks_off()
    ax.set_xlabel("batch size (micro-batch)")


def _figure(title: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    return fig, ax


def _no_data(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def throughput_vs_batch(pts: Sequence[Point]) -> Figure:
    fig, ax = _figure("Throughput against batch size, per precision (x: pruned as OOM)")
    precisions = sorted({p.precision for p in pts})
    top = max((p.throughput for p in pts if p.throughput), default=1.0)
    for precision in precisions:
        done = sorted(
            (p for p in pts if p.precision == precision and p.throughput),
            key=lambda p: p.batch_size,
        )
        if done:
            ax.plot(
                [p.batch_size for p in done], [p.throughput for p in done], "o",
                color=_color(precision), label=precision, alpha=0.85,
            )  # fmt: skip
        oom = [p for p in pts if p.precision == precision and p.oom]
        if oom:
            ax.plot(
                [p.batch_size for p in oom], [0.0] * len(oom), "x", color=_color(precision),
                markersize=11, markeredgewidth=2.5, clip_on=False, label=f"{precision} OOM",
            )  # fmt: skip
    if not pts:
        _no_data(ax, "no trial yet")
    _log2_batch_axis(ax, [p.batch_size for p in pts])
    ax.set_ylim(bottom=0, top=top * 1.1)
    ax.set_ylabel(f"throughput ({next((p.unit for p in pts if p.throughput), 'samples')}/s)")
    if pts:
        ax.legend(fontsize=8, loc="best")
    return fig


def memory_vs_batch(pts: Sequence[Point]) -> Figure:
    fig, ax = _figure("Peak memory against batch size: measured (filled), predicted (open)")
    for precision in sorted({p.precision for p in pts}):
        mine = [p for p in pts if p.precision == precision]
        measured = [p for p in mine if p.peak_bytes is not None]
        predicted = [p for p in mine if p.predicted_bytes is not None]
        if measured:
            ax.plot(
                [p.batch_size for p in measured], [p.peak_bytes / MIB for p in measured], "o",
                color=_color(precision), label=f"{precision} measured",
            )  # fmt: skip
        if predicted:
            ax.plot(
                [p.batch_size for p in predicted], [p.predicted_bytes / MIB for p in predicted],
                "o", markerfacecolor="none", markersize=10, color=_color(precision),
                label=f"{precision} predicted",
            )  # fmt: skip
    budgets = {p.budget_bytes for p in pts if p.budget_bytes}
    for budget in budgets:
        ax.axhline(budget / MIB, color="tab:red", linestyle="--", label="budget")
    if not pts:
        _no_data(ax, "no trial yet")
    _log2_batch_axis(ax, [p.batch_size for p in pts])
    ax.set_ylabel("peak memory (MiB)")
    ax.set_ylim(bottom=0)
    if pts:
        ax.legend(fontsize=8, loc="upper left")
    return fig


def lr_vs_effective_batch(pts: Sequence[Point]) -> Figure:
    fig, ax = _figure("Learning rate against effective batch, coloured by val accuracy")
    done = [p for p in pts if p.val_acc is not None and p.lr and p.effective_batch_size]
    other = [p for p in pts if p.val_acc is None and p.lr and p.effective_batch_size]
    if other:
        ax.scatter(
            [p.effective_batch_size for p in other], [p.lr for p in other],
            facecolors="none", edgecolors="gray", label="pruned / failed",
        )  # fmt: skip
    if done:
        shown = ax.scatter(
            [p.effective_batch_size for p in done], [p.lr for p in done],
            c=[p.val_acc for p in done], cmap="viridis", s=60, edgecolors="black",
        )  # fmt: skip
        fig.colorbar(shown, ax=ax, label="val accuracy")
        best = max(done, key=lambda p: p.val_acc)
        batches = sorted({p.effective_batch_size for p in pts if p.effective_batch_size})
        span = [batches[0], batches[-1]]
        ax.plot(
            span, [best.lr * b / best.effective_batch_size for b in span], "--", color="gray",
            label=f"linear scaling through the best (trial {best.number})",
        )  # fmt: skip
        ax.legend(fontsize=8, loc="best")
    else:
        _no_data(ax, "no completed trial yet")
    _log2_batch_axis(ax, [p.effective_batch_size for p in pts])
    ax.set_yscale("log")
    ax.set_xlabel("effective batch size (batch x accumulation)")
    ax.set_ylabel("learning rate trained with")
    return fig


def front(
    study: optuna.Study, metrics: Sequence[str], pts: Sequence[Point], recommended: int | None
) -> Figure:
    """The Pareto front of the first two objectives, or the history of a single one."""
    complete = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not is_repeat(t)
    ]
    oom = [p for p in pts if p.oom]
    if len(metrics) >= 2:
        fig, ax = _figure(f"Pareto front: {metrics[1]} against {metrics[0]}")
        x_name, y_name = metrics[1], metrics[0]
        on_front = {t.number for t in study.best_trials}  # Optuna's front, all objectives
        xs = [metric_value(t, x_name, metrics) for t in complete]
        ys = [metric_value(t, y_name, metrics) for t in complete]
        colors = ["tab:red" if t.number in on_front else "tab:blue" for t in complete]
        ax.scatter(xs, ys, c=colors, s=40)
        line = sorted(
            (x, y) for t, x, y in zip(complete, xs, ys, strict=True) if t.number in on_front
        )
        # The front's points joined in order (a staircase would depend on the directions).
        ax.plot([x for x, _ in line], [y for _, y in line], "--", color="tab:red", alpha=0.6,
                label="Pareto front")  # fmt: skip
        for t, x, y in zip(complete, xs, ys, strict=True):
            ax.annotate(
                f"#{t.number}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
        ax.set_xlabel(x_name)
        ax.set_ylabel(y_name)
    else:
        fig, ax = _figure(f"Optimisation history: {metrics[0]}")
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
        ax.set_ylabel(metrics[0])
    star = [t for t in complete if t.number == recommended]
    if star:
        t = star[0]
        xy = (t.number, t.values[0]) if len(metrics) < 2 else (
            metric_value(t, metrics[1], metrics), metric_value(t, metrics[0], metrics))  # fmt: skip
        ax.plot(*xy, "*", markersize=18, color="gold", markeredgecolor="black",
                label=f"recommended (trial {t.number})")  # fmt: skip
    if oom:
        listed = ", ".join(
            f"#{p.number} {p.batch_size}x{p.accum_steps} {p.precision}" for p in oom[:8]
        )
        more = f" and {len(oom) - 8} more" if len(oom) > 8 else ""
        ax.text(0.01, 0.01, f"pruned as OOM (no values): {listed}{more}", transform=ax.transAxes,
                fontsize=7, color="tab:red", va="bottom", wrap=True)  # fmt: skip
    if not complete:
        _no_data(ax, "no completed trial yet")
    else:
        ax.legend(fontsize=8, loc="best")
    return fig


def importances(study: optuna.Study, metrics: Sequence[str]) -> Figure | None:
    """Parameter importances per objective; None before MIN_IMPORTANCE_TRIALS completed."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < MIN_IMPORTANCE_TRIALS:
        return None
    fig, ax = _figure("Parameter importances per objective (Optuna's default evaluator)")
    per_metric = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, metric in enumerate(metrics):
            try:
                per_metric[metric] = optuna.importance.get_param_importances(
                    study, target=lambda t, i=i: t.values[i]
                )
            except (RuntimeError, ValueError):  # a single distinct value, or one param only
                continue
    if not per_metric:
        return None
    params = sorted({p for values in per_metric.values() for p in values})
    height = 0.8 / len(per_metric)
    for j, (metric, values) in enumerate(per_metric.items()):
        ys = [k + j * height for k in range(len(params))]
        ax.barh(ys, [values.get(p, 0.0) for p in params], height=height, label=metric)
    ax.set_yticks([k + 0.4 - height / 2 for k in range(len(params))], params)
    ax.set_xlabel("importance (normalised: the parameters' importances sum to 1)")
    ax.legend(fontsize=8)
    return fig


def png(fig: Figure) -> bytes:
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110)
    return out.getvalue()


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
            for i, name in enumerate(names):
                try:
                    figures.append(
                        vis.plot_param_importances(
                            study, target=lambda t, i=i: t.values[i], target_name=name
                        )
                    )
                except (RuntimeError, ValueError):
                    continue
    parts = [
        fig.to_html(full_html=False, include_plotlyjs=(k == 0)) for k, fig in enumerate(figures)
    ]
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{study.study_name}</title></head><body>"
        f"<h2>Study {study.study_name}</h2>{''.join(parts)}</body></html>"
    )


def render(
    study: optuna.Study, metrics: Sequence[str], recommended: int | None
) -> dict[str, bytes]:
    """Every plot of the study: file name -> content."""
    pts = points(study.get_trials(deepcopy=False))
    files = {
        "front.png": png(front(study, metrics, pts, recommended)),
        "throughput_vs_batch.png": png(throughput_vs_batch(pts)),
        "memory_vs_batch.png": png(memory_vs_batch(pts)),
        "lr_vs_effective_batch.png": png(lr_vs_effective_batch(pts)),
    }
    importance = importances(study, metrics)
    if importance is not None:
        files["importances.png"] = png(importance)
    files["study.html"] = html(study, metrics).encode()
    return files
