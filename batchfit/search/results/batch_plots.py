"""The plots against the batch:
- `throughput_vs_batch.png`: throughput against the micro-batch, one series per precision, OOM
  trials as crosses on the axis (one per batch size and precision, with their count), trials pruned
  as slow as open markers at their probe's speed and listed below the axes;
- `memory_vs_batch.png`: measured and predicted peak memory (MiB) against the micro-batch per
  precision, the budget as a line and, given search.preflight_margin, the line above which a
  prediction is pruned as oom_predicted;
- `lr_vs_effective_batch.png`: the learning rate trained with against the effective batch, coloured
  by val accuracy, with the line of the linear scaling rule through the best trial.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure  # without pyplot: no backend, no global figure state

from batchfit.search.results.points import (
    DODGE_OCTAVES,
    MIB,
    BatchAxis,
    Point,
    add_legend,
    batch_unit,
    footnote,
    listed,
    log2_batch_axis,
    new_figure,
    no_data,
    precision_color,
)


def _completed_speeds(ax: Axes, axis: BatchAxis, mine: Sequence[Point], precision: str) -> None:
    done = sorted((p for p in mine if p.throughput), key=axis.x)
    if done:
        ax.plot(
            [axis.x(p) for p in done], [p.throughput for p in done], "o",
            color=precision_color(precision), label=precision, alpha=0.85,
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
            markerfacecolor="none", markersize=9, color=precision_color(precision),
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
            xs, [0.0] * len(xs), "x", color=precision_color(precision), markersize=11,
            markeredgewidth=2.5, clip_on=False, label=f"{precision} OOM",
        )  # fmt: skip
        for x, (_, n) in zip(xs, cells, strict=True):
            if n > 1:
                ax.annotate(
                    f"×{n}", (x, 0.0), xytext=(5, 5), textcoords="offset points",
                    fontsize=8, color=precision_color(precision), annotation_clip=False,
                )  # fmt: skip


def _slow_note(ax: Axes, pts: Sequence[Point]) -> None:
    slow = [p for p in pts if p.slow]
    if slow:
        footnote(ax, listed("pruned as slow", slow, _slow_words), "tab:brown")


def _slow_words(p: Point) -> str:
    return f"{p.config} (projected {p.projected_s:.0f} s against {p.time_budget_s:g} s)"


def throughput_vs_batch(pts: Sequence[Point]) -> Figure:
    axis, unit = BatchAxis.of(pts), batch_unit(pts)
    fig, ax = new_figure(f"Throughput against {axis.name} (x: OOM, open: pruned as slow)")
    for precision in sorted({p.precision for p in pts}):
        mine = [p for p in pts if p.precision == precision and axis.x(p)]
        _completed_speeds(ax, axis, mine, precision)
        _slow_speeds(ax, axis, mine, precision, unit)
    _oom_crosses(ax, axis, [p for p in pts if p.oom])
    _slow_note(ax, pts)
    if not pts:
        no_data(ax, "no trial yet")
    log2_batch_axis(ax, [axis.x(p) for p in pts], axis.label)
    speeds = [p.throughput or _probe_speed(p, unit) or 0.0 for p in pts]
    ax.set_ylim(bottom=0, top=max(speeds, default=0.0) * 1.1 or 1.1)
    ax.set_ylabel(f"throughput ({unit}/s)")
    add_legend(ax)
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
    fig, ax = new_figure(f"Peak memory against {axis.name}: measured (filled), predicted (open)")
    for precision in sorted({p.precision for p in pts}):
        mine = [p for p in pts if p.precision == precision and axis.x(p)]
        measured = [p for p in mine if p.peak_bytes is not None]
        predicted = [p for p in mine if p.predicted_bytes is not None]
        if measured:
            ax.plot(
                [axis.x(p) for p in measured], [p.peak_bytes / MIB for p in measured], "o",
                color=precision_color(precision), label=f"{precision} measured",
            )  # fmt: skip
        if predicted:
            ax.plot(
                [axis.x(p) for p in predicted], [p.predicted_bytes / MIB for p in predicted],
                "o", markerfacecolor="none", markersize=10, color=precision_color(precision),
                label=f"{precision} predicted",
            )  # fmt: skip
    for budget in sorted({p.budget_bytes for p in pts if p.budget_bytes}):
        _budget_lines(ax, budget, margin)
    if not pts:
        no_data(ax, "no trial yet")
    log2_batch_axis(ax, [axis.x(p) for p in pts], axis.label)
    ax.set_ylabel("peak memory (MiB)")
    ax.set_ylim(bottom=0)
    add_legend(ax, loc="upper left")
    return fig


def lr_vs_effective_batch(pts: Sequence[Point]) -> Figure:
    fig, ax = new_figure("Learning rate against effective batch, coloured by val accuracy")
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
        add_legend(ax)
    else:
        no_data(ax, "no completed trial yet")
    log2_batch_axis(
        ax, [p.effective_batch_size for p in pts], "effective batch size (batch x accumulation)"
    )
    ax.set_yscale("log")
    ax.set_ylabel("learning rate trained with")
    return fig
