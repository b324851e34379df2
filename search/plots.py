"""Pictures of a study, drawn from its trials: static PNGs (matplotlib) and one interactive
HTML page (Optuna's plotly visualisations). The study's parent MLflow run carries them under
`plots/`, redrawn as trials finish.

- `front.png`: the Pareto front, objective 0 on x and objective 1 on y as in study.html (one
  objective: the optimisation history), the recommended trial starred, OOM trials listed
  below the axes (they have no values to place); with no completed trial, how the trials
  ended instead;
- `throughput_vs_batch.png`: throughput against the micro-batch, one series per precision,
  OOM trials as crosses on the axis (one per batch size and precision, with their count),
  trials pruned as slow as open markers at their probe's speed and listed below the axes;
- `memory_vs_batch.png`: measured and predicted peak memory (MiB) against the micro-batch
  per precision, the budget as a line and, given search.preflight_margin, the line above
  which a prediction is pruned as oom_predicted;
- `lr_vs_effective_batch.png`: the learning rate trained with against the effective batch,
  coloured by val accuracy, with the line of the linear scaling rule through the best trial;
- `energy_to_target.png`, where energy was measured: energy against time to the target
  per predicted configuration, the Pareto front of the two marked (filled, joined by its
  staircase; the configurations it dominates hollow) and the recommended one circled;
- `importances.png`: parameter importances per objective (Optuna's default evaluator,
  PED-ANOVA in Optuna 5), once MIN_IMPORTANCE_TRIALS trials have completed; throughput/*
  and memory/* over the batch geometry only (GEOMETRY_PARAMS);
- `study.html`: Optuna's Pareto front (or history), parallel coordinates and importances,
  with plotly.js embedded so the page works offline in MLflow's artifact viewer.

The micro-batch is counted in samples, or in tokens (batch size x data.seq_len) when the
study searches data.seq_len: 64 sequences of 256 tokens are a bigger step than 128 of 64.
"""

from __future__ import annotations

import io
import textwrap
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import optuna
from matplotlib.axes import Axes
from matplotlib.figure import Figure  # without pyplot: no backend, no global figure state
from matplotlib.transforms import Bbox
from optuna.trial import FrozenTrial, TrialState

from search import time_to_target
from search.recommend import metric_value
from search.record import OOM_REASONS, SLOW, TrialRecord
from tracking.metrics import MEMORY_PREFIX, THROUGHPUT_PREFIX
from train.params import (
    ACCUM_KEY,
    BATCH_KEY,
    CHECKPOINTING_KEY,
    EFFECTIVE_KEY,
    PRECISION_KEY,
)

MIN_IMPORTANCE_TRIALS = 5  # fewer completed trials say nothing about importance
MIB = 2**20
PRECISION_COLORS = {
    "fp32": "tab:blue", "tf32": "tab:purple", "bf16": "tab:green", "fp16": "tab:orange",
}  # fmt: skip
SEQ_LEN_KEY = "data.seq_len"  # a language model's sequence length, a trial param when searched
# What throughput and memory are properties of: the batch geometry, not the learning rate.
GEOMETRY_PARAMS = (
    BATCH_KEY, ACCUM_KEY, EFFECTIVE_KEY, PRECISION_KEY, SEQ_LEN_KEY, CHECKPOINTING_KEY,
)  # fmt: skip
GEOMETRY_METRICS = (THROUGHPUT_PREFIX, MEMORY_PREFIX)
# OOM crosses of several precisions at one batch size are pulled apart by this share of an
# octave each (the batch axis is log2): about a cross's width at 4 octaves across the plot.
DODGE_OCTAVES = 0.12
MAX_LISTED = 8  # trials named in a footnote; the rest are counted
FOOTNOTE_CHARS = 105  # a footnote's line at 7 pt, from the axes' left edge to the figure's


@dataclass(frozen=True)
class Point:
    """One trial, as the plots see it (from its user attrs and params)."""

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
    seq_len: int | None = None  # data.seq_len, where the study searches it
    probe_s_per_sample: float | None = None  # the slow-trial probe's measurement
    projected_s: float | None = None  # a `slow` trial's projected training ...
    time_budget_s: float | None = None  # ... and the budget it was held to

    @property
    def oom(self) -> bool:
        return self.reason in OOM_REASONS

    @property
    def slow(self) -> bool:
        return self.reason == SLOW

    @property
    def config(self) -> str:
        return f"#{self.number} {self.batch_size}x{self.accum_steps} {self.precision}"


def _point(t: TrialRecord) -> Point:
    complete, outcome = t.state == "COMPLETE", t.outcome
    return Point(
        number=t.number,
        state=t.state,
        reason=outcome.reason,
        precision=str(t.precision),
        batch_size=t.batch_size,
        accum_steps=t.accum_steps,
        effective_batch_size=t.effective_batch_size,
        lr=t.lr,
        throughput=outcome.throughput if complete else None,
        unit=outcome.unit or "samples",
        val_acc=outcome.val_acc if complete else None,
        peak_bytes=outcome.peak_bytes,
        predicted_bytes=outcome.predicted_bytes,
        budget_bytes=t.budget_bytes,
        seq_len=t.params.get(SEQ_LEN_KEY),
        probe_s_per_sample=outcome.probe_s_per_sample,
        projected_s=outcome.projected_s,
        time_budget_s=t.time_budget_s,
    )


def points(trials: Sequence[FrozenTrial]) -> list[Point]:
    kept = (TrialRecord.of(t) for t in trials)
    return [
        _point(t)
        for t in kept
        if t.state in ("COMPLETE", "PRUNED", "FAIL")
        # never configured: a surplus trial, a repeat, or one killed before its config
        and t.configured
        and not t.surplus
    ]


@dataclass(frozen=True)
class BatchAxis:
    """What the batch plots put on x: the micro-batch in samples, or in tokens when the
    study's trials differ in data.seq_len."""

    tokens: bool

    @classmethod
    def of(cls, pts: Sequence[Point]) -> BatchAxis:
        return cls(tokens=len({p.seq_len for p in pts if p.seq_len}) > 1)

    def x(self, p: Point) -> int | None:
        if not self.tokens:
            return p.batch_size
        return p.batch_size * p.seq_len if p.batch_size and p.seq_len else None

    @property
    def name(self) -> str:
        return "tokens per micro-batch" if self.tokens else "batch size"

    @property
    def label(self) -> str:
        if self.tokens:
            return "tokens per micro-batch (batch size x data.seq_len)"
        return "batch size (micro-batch)"


def _color(precision: str) -> str:
    return PRECISION_COLORS.get(precision, "tab:gray")


def _unit(pts: Sequence[Point]) -> str:
    return next((p.unit for p in pts if p.throughput), "samples")


def _log2_batch_axis(ax: Axes, batches: Sequence[int | None], label: str) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted({b for b in batches if b})
    if ticks:
        ax.set_xticks(ticks, [str(b) for b in ticks])
        ax.minorticks_off()
    ax.set_xlabel(label)


def _figure(title: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    return fig, ax


def _no_data(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _legend(ax: Axes, loc: str = "best") -> None:
    """A legend, when something is labelled (matplotlib warns of an empty one)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc=loc)


def _listed(what: str, pts: Sequence[Point], describe: Callable[[Point], str]) -> str:
    """'what: #4 512x1 fp32, ...', the first MAX_LISTED trials named, the rest counted."""
    named = ", ".join(describe(p) for p in pts[:MAX_LISTED])
    more = f" and {len(pts) - MAX_LISTED} more" if len(pts) > MAX_LISTED else ""
    return f"{what}: {named}{more}"


def _footnote(ax: Axes, text: str, color: str) -> None:
    """`text` below the axes and their x label, outside the plot area: the constrained
    layout makes room for it, so it covers no point."""

    def below_axes(renderer: object) -> Bbox:  # the axes with their tick and axis labels
        return ax.get_tightbbox(renderer, bbox_extra_artists=[])

    ax.annotate(
        textwrap.fill(text, FOOTNOTE_CHARS), xy=(0, 0), xycoords=("axes fraction", below_axes),
        xytext=(0, -4), textcoords="offset points", ha="left", va="top", fontsize=7,
        color=color, annotation_clip=False,
    )  # fmt: skip


def _completed_speeds(ax: Axes, axis: BatchAxis, mine: Sequence[Point], precision: str) -> None:
    done = sorted((p for p in mine if p.throughput), key=axis.x)
    if done:
        ax.plot(
            [axis.x(p) for p in done], [p.throughput for p in done], "o",
            color=_color(precision), label=precision, alpha=0.85,
        )  # fmt: skip


def _probe_speed(p: Point, unit: str) -> float | None:
    """A slow trial's throughput in `unit`/s as its probe measured it: a lower bound, the
    probe's few samples running less efficiently than the micro-batch (train/loop.py)."""
    if not p.slow or not p.probe_s_per_sample:
        return None
    per_sample = {"samples": 1, "tokens": p.seq_len}.get(unit)  # no padding: tokens = seq_len
    return per_sample / p.probe_s_per_sample if per_sample else None


def _slow_speeds(
    ax: Axes, axis: BatchAxis, mine: Sequence[Point], precision: str, unit: str
) -> None:
    probed = [p for p in mine if _probe_speed(p, unit)]
    if probed:
        ax.plot(
            [axis.x(p) for p in probed], [_probe_speed(p, unit) for p in probed], "o",
            markerfacecolor="none", markersize=9, color=_color(precision),
            label=f"{precision} pruned as slow (probe's speed)",
        )  # fmt: skip


def _dodged(x: int, precision: str, cells: Sequence[tuple[int, str]]) -> float:
    """x moved aside when crosses of other precisions share it (log2 axis: a factor)."""
    sharing = sorted({pr for bx, pr in cells if bx == x})
    shift = sharing.index(precision) - (len(sharing) - 1) / 2
    return x * 2 ** (DODGE_OCTAVES * shift)


def _oom_crosses(ax: Axes, axis: BatchAxis, oom: Sequence[Point]) -> None:
    """One cross per (micro-batch, precision) that ran out of memory, at the axis, with
    the count of its trials beside it when several did."""
    counts = Counter((axis.x(p), p.precision) for p in oom if axis.x(p))
    for precision in sorted({pr for _, pr in counts}):
        cells = sorted((x, n) for (x, pr), n in counts.items() if pr == precision)
        xs = [_dodged(x, precision, list(counts)) for x, _ in cells]
        ax.plot(
            xs, [0.0] * len(xs), "x", color=_color(precision), markersize=11,
            markeredgewidth=2.5, clip_on=False, label=f"{precision} OOM",
        )  # fmt: skip
        for x, (_, n) in zip(xs, cells, strict=True):
            if n > 1:
                ax.annotate(
                    f"×{n}", (x, 0.0), xytext=(5, 5), textcoords="offset points",
                    fontsize=8, color=_color(precision), annotation_clip=False,
                )  # fmt: skip


def _slow_note(ax: Axes, pts: Sequence[Point]) -> None:
    slow = [p for p in pts if p.slow]
    if slow:
        _footnote(ax, _listed("pruned as slow", slow, _slow_words), "tab:brown")


def _slow_words(p: Point) -> str:
    return f"{p.config} (projected {p.projected_s:.0f} s against {p.time_budget_s:g} s)"


def throughput_vs_batch(pts: Sequence[Point]) -> Figure:
    axis, unit = BatchAxis.of(pts), _unit(pts)
    fig, ax = _figure(f"Throughput against {axis.name} (x: OOM, open: pruned as slow)")
    for precision in sorted({p.precision for p in pts}):
        mine = [p for p in pts if p.precision == precision and axis.x(p)]
        _completed_speeds(ax, axis, mine, precision)
        _slow_speeds(ax, axis, mine, precision, unit)
    _oom_crosses(ax, axis, [p for p in pts if p.oom])
    _slow_note(ax, pts)
    if not pts:
        _no_data(ax, "no trial yet")
    _log2_batch_axis(ax, [axis.x(p) for p in pts], axis.label)
    speeds = [p.throughput or _probe_speed(p, unit) or 0.0 for p in pts]
    ax.set_ylim(bottom=0, top=max(speeds, default=0.0) * 1.1 or 1.1)
    ax.set_ylabel(f"throughput ({unit}/s)")
    _legend(ax)
    return fig


def _budget_lines(ax: Axes, budget_bytes: float, margin: float | None) -> None:
    """The budget and, with search.preflight_margin, where pruning starts below it: a step
    predicted at over budget / (1 + margin) is pruned as oom_predicted (train/memory/fitting.py)."""
    budget = budget_bytes / MIB
    ax.axhline(budget, color="tab:red", linestyle="--", label=f"budget {budget:,.1f} MiB")
    if margin:
        start = budget / (1 + margin)
        ax.axhline(
            start, color="tab:red", linestyle=":",
            label=f"predicted over {start:,.1f} MiB: pruned as oom_predicted "
            f"(budget / (1 + search.preflight_margin={margin:g}))",
        )  # fmt: skip


def memory_vs_batch(pts: Sequence[Point], margin: float | None = None) -> Figure:
    """`margin`: search.preflight_margin (None: the budget line alone)."""
    axis = BatchAxis.of(pts)
    fig, ax = _figure(f"Peak memory against {axis.name}: measured (filled), predicted (open)")
    for precision in sorted({p.precision for p in pts}):
        mine = [p for p in pts if p.precision == precision and axis.x(p)]
        measured = [p for p in mine if p.peak_bytes is not None]
        predicted = [p for p in mine if p.predicted_bytes is not None]
        if measured:
            ax.plot(
                [axis.x(p) for p in measured], [p.peak_bytes / MIB for p in measured], "o",
                color=_color(precision), label=f"{precision} measured",
            )  # fmt: skip
        if predicted:
            ax.plot(
                [axis.x(p) for p in predicted], [p.predicted_bytes / MIB for p in predicted],
                "o", markerfacecolor="none", markersize=10, color=_color(precision),
                label=f"{precision} predicted",
            )  # fmt: skip
    for budget in sorted({p.budget_bytes for p in pts if p.budget_bytes}):
        _budget_lines(ax, budget, margin)
    if not pts:
        _no_data(ax, "no trial yet")
    _log2_batch_axis(ax, [axis.x(p) for p in pts], axis.label)
    ax.set_ylabel("peak memory (MiB)")
    ax.set_ylim(bottom=0)
    _legend(ax, loc="upper left")
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
        _legend(ax)
    else:
        _no_data(ax, "no completed trial yet")
    _log2_batch_axis(
        ax, [p.effective_batch_size for p in pts], "effective batch size (batch x accumulation)"
    )
    ax.set_yscale("log")
    ax.set_ylabel("learning rate trained with")
    return fig


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
    fig, ax = _figure(
        f"Pareto front: {metrics[1]} against {metrics[0]}"
        if pareto
        else f"Optimisation history: {metrics[0]}"
    )
    if not complete:
        _no_data(ax, _none_completed(pts))
        ax.set_xticks([])
        ax.set_yticks([])
    elif pareto:
        _pareto(ax, study, metrics, complete)
    else:
        _history(ax, study, metrics[0], complete)
    _star(ax, complete, recommended, metrics)
    oom = [p for p in pts if p.oom]
    if oom:
        _footnote(ax, _listed("pruned as OOM (no values)", oom, lambda p: p.config), "tab:red")
    _legend(ax)
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
    fig, ax = _figure(_importances_title(metrics))
    params = sorted({p for values in per_metric.values() for p in values})
    height = 0.8 / len(per_metric)
    for j, (metric, values) in enumerate(per_metric.items()):
        ys = [k + j * height for k in range(len(params))]
        label = f"{metric} (geometry only)" if _geometry_only(metric) else metric
        ax.barh(ys, [values.get(p, 0.0) for p in params], height=height, label=label)
    ax.set_yticks([k + 0.4 - height / 2 for k in range(len(params))], params)
    ax.set_xlabel("importance (normalised: the parameters' importances sum to 1)")
    _legend(ax)
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
        _legend(ax)
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
    fig, ax = _figure("Energy and time to the target per configuration (filled: Pareto front)")
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
        _no_data(ax, "no configuration has its energy measured")
    ax.set_xlabel("seconds to target (predicted)")
    ax.set_ylabel("joules to target (predicted)")
    _legend(ax)
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
