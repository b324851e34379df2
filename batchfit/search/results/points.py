"""What a study's plots draw, one point per trial, and the figure helpers they share.

The micro-batch is counted in samples, or in tokens (batch size x data.seq_len) when the study
searches data.seq_len: 64 sequences of 256 tokens are a bigger step than 128 of 64.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.figure import Figure  # without pyplot: no backend, no global figure state
from matplotlib.transforms import Bbox
from optuna.trial import FrozenTrial

from batchfit.search.core.record import OOM_REASONS, SLOW, TrialRecord
from batchfit.tracking.metrics import MEMORY_PREFIX, THROUGHPUT_PREFIX
from batchfit.train.params import (
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


def precision_color(precision: str) -> str:
    return PRECISION_COLORS.get(precision, "tab:gray")


def batch_unit(pts: Sequence[Point]) -> str:
    return next((p.unit for p in pts if p.throughput), "samples")


def log2_batch_axis(ax: Axes, batches: Sequence[int | None], label: str) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted({b for b in batches if b})
    if ticks:
        ax.set_xticks(ticks, [str(b) for b in ticks])
        ax.minorticks_off()
    ax.set_xlabel(label)


def new_figure(title: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    return fig, ax


def no_data(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def add_legend(ax: Axes, loc: str = "best") -> None:
    """A legend, when something is labelled (matplotlib warns of an empty one)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc=loc)


def listed(what: str, pts: Sequence[Point], describe: Callable[[Point], str]) -> str:
    """'what: #4 512x1 fp32, ...', the first MAX_LISTED trials named, the rest counted."""
    named = ", ".join(describe(p) for p in pts[:MAX_LISTED])
    more = f" and {len(pts) - MAX_LISTED} more" if len(pts) > MAX_LISTED else ""
    return f"{what}: {named}{more}"


def footnote(ax: Axes, text: str, color: str) -> None:
    """`text` below the axes and their x label, outside the plot area: the constrained
    layout makes room for it, so it covers no point."""

    def below_axes(renderer: object) -> Bbox:  # the axes with their tick and axis labels
        return ax.get_tightbbox(renderer, bbox_extra_artists=[])

    ax.annotate(
        textwrap.fill(text, FOOTNOTE_CHARS), xy=(0, 0), xycoords=("axes fraction", below_axes),
        xytext=(0, -4), textcoords="offset points", ha="left", va="top", fontsize=7,
        color=color, annotation_clip=False,
    )  # fmt: skip
