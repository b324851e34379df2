"""The plots of search/results/plots.py, read back from the matplotlib figures: what each draws for
the trials a study records (user attrs as search/trial/ending.py writes them, params as Optuna
keeps them). Each study is made by hand; the figures each check expects are derived in
comments."""

from __future__ import annotations

import warnings

import optuna
import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from batchfit.search.results import batch_plots, plots, points
from batchfit.search.results.critical_batch import StepsModel
from batchfit.search.results.time_to_target import Plan, Point, Predicted
from batchfit.tracking.metrics import THROUGHPUT_SAMPLES, VAL_ACC

MIB = 2**20
BUDGET = 64 * MIB
METRICS = [VAL_ACC, THROUGHPUT_SAMPLES]
DISTRIBUTIONS = {
    "trainer.batch_size": CategoricalDistribution([8, 16, 32, 64, 128, 256, 512, 1024]),
    "trainer.accum_steps": CategoricalDistribution([1, 2, 4]),
    "trainer.precision": CategoricalDistribution(["fp32", "bf16", "fp16"]),
    "optimizer.lr": FloatDistribution(1e-4, 1.0, log=True),
    "data.seq_len": CategoricalDistribution([64, 256]),
}


def _trial(
    state: TrialState,
    batch: int,
    precision: str = "fp32",
    accum: int = 1,
    lr: float = 0.01,
    values: list[float] | None = None,
    seq_len: int | None = None,
    budget: int | None = BUDGET,
    **attrs: object,
) -> FrozenTrial:
    """A trial as search/trial/ending.py records it: the run's params (RunSpec.params), the
    budget, then what its outcome adds (`attrs`)."""
    params = {
        "trainer.batch_size": batch,
        "trainer.accum_steps": accum,
        "trainer.precision": precision,
        "optimizer.lr": lr,
    } | ({"data.seq_len": seq_len} if seq_len else {})
    recorded = {
        "state": state.name,
        "trainer.batch_size": batch,
        "trainer.accum_steps": accum,
        "trainer.precision": precision,
        "trainer.activation_checkpointing": "none",
        "optimizer.lr": lr,
        "effective_batch_size": batch * accum,
        "lr_scaled": lr,
        "device": "cpu",
    } | ({"budget_bytes": budget} if budget else {})
    return create_trial(
        state=state,
        values=values,
        params=params,
        distributions={k: DISTRIBUTIONS[k] for k in params},
        user_attrs=recorded | attrs,
    )


def _complete(
    batch: int, speed: float, acc: float = 0.9, unit: str = "samples", **kw: object
) -> FrozenTrial:
    peak = kw.pop("peak", 10 * MIB)
    return _trial(
        TrialState.COMPLETE,
        batch,
        values=[acc, speed],
        throughput=speed,
        unit=unit,
        val_acc=acc,
        peak_bytes=peak,
        predicted_bytes=peak,
        metrics={VAL_ACC: acc, f"throughput/{unit}_per_sec": speed},
        **kw,
    )


def _oom_predicted(batch: int, precision: str = "fp32", accum: int = 1, mib: float = 80):
    return _trial(
        TrialState.PRUNED,
        batch,
        precision,
        accum,
        reason="oom_predicted",
        message=f"its step is predicted to need {mib} MiB, over the budget",
        predicted_bytes=mib * MIB,
    )


def _slow(batch: int, precision: str = "fp16", probe_s: float = 0.02, **kw: object):
    """Pruned as slow by its probe (search/trial/ending.py records its probe)."""
    return _trial(
        TrialState.PRUNED,
        batch,
        precision,
        reason="slow",
        message="a probe step projects 900 s of training",
        probe_s_per_sample=probe_s,
        projected_s=900.0,
        time_budget_s=60.0,
        **kw,
    )


def _failed(batch: int, budget: int | None = BUDGET) -> FrozenTrial:
    return _trial(TrialState.FAIL, batch, budget=budget, reason="error", error="RuntimeError")


def _study(*trials: FrozenTrial, directions: tuple = ("maximize", "maximize")) -> optuna.Study:
    study = optuna.create_study(directions=list(directions))
    for trial in trials:
        study.add_trial(trial)
    return study


def _pts(study: optuna.Study) -> list[points.Point]:
    return points.points(study.get_trials())


def _lines(ax: Axes, marker: str, hollow: bool | None = None) -> list[tuple[list, list]]:
    return [
        (list(line.get_xdata()), list(line.get_ydata()))
        for line in ax.get_lines()
        if line.get_marker() == marker
        and (hollow is None or (line.get_markerfacecolor() == "none") == hollow)
    ]


def _legend_texts(ax: Axes) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


def _texts(ax: Axes) -> list[str]:
    return [t.get_text() for t in ax.texts]


# --- 1. memory: the budget and where the preflight starts pruning ------------------------


def test_memory_draws_where_the_preflight_prunes_below_the_budget() -> None:
    # Trial 1 is predicted at 62 MiB: under the 64 MiB budget, yet pruned, since
    # 62 x 1.05 = 65.1 > 64. Pruning starts at 64 / 1.05 = 60.95 MiB.
    study = _study(_complete(32, 900.0, peak=40 * MIB), _oom_predicted(64, mib=62))
    ax = batch_plots.memory_vs_batch(_pts(study), margin=0.05).axes[0]
    flat = sorted(ys[0] for _, ys in _lines(ax, "None") if len(set(ys)) == 1)
    assert flat == pytest.approx([64 / 1.05, 64.0])
    assert flat[0] < 62 < flat[1]  # the pruned prediction sits between the two lines
    legend = _legend_texts(ax)
    assert "budget 64.0 MiB" in legend
    assert (
        "predicted over 61.0 MiB: pruned as oom_predicted "
        "(budget / (1 + search.preflight_margin=0.05))"
    ) in legend


def test_render_passes_the_margin_to_the_memory_plot(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    draw = batch_plots.memory_vs_batch
    monkeypatch.setattr(plots, "memory_vs_batch", lambda pts, m: seen.append(m) or draw(pts, m))
    monkeypatch.setattr(plots, "html", lambda study, metrics: "")  # not what is tested here
    plots.render(_study(_complete(32, 900.0)), METRICS, None, margin=0.1)
    assert seen == [0.1]


# --- 2. OOM crosses at one batch size ----------------------------------------------------


def test_oom_crosses_at_one_batch_size_are_counted_and_dodged_per_precision() -> None:
    # fp32 ran out at 512 three times (accumulating 1, 2 and 4), bf16 once: one cross per
    # precision, pulled apart by DODGE_OCTAVES / 2 each way (sorted: bf16 left, fp32 right).
    study = _study(
        _complete(32, 900.0),
        *(_oom_predicted(512, "fp32", accum) for accum in (1, 2, 4)),
        _oom_predicted(512, "bf16"),
    )
    ax = batch_plots.throughput_vs_batch(_pts(study)).axes[0]
    half = 2 ** (points.DODGE_OCTAVES / 2)
    crosses = _lines(ax, "x")
    assert crosses == [([pytest.approx(512 / half)], [0.0]), ([pytest.approx(512 * half)], [0.0])]
    assert _texts(ax) == ["×3"]  # beside the fp32 cross; a single trial needs no count
    assert ax.texts[0].xy == (pytest.approx(512 * half), 0.0)


# --- 3. front.png: study.html's orientation, the footnote outside the plot -------------


def _front_study() -> optuna.Study:
    return _study(
        _complete(32, 300.0, acc=0.93),
        _complete(64, 900.0, acc=0.945),
        _complete(128, 600.0, acc=0.951),
        *(_oom_predicted(512, accum=a) for a in (1, 2, 4)),
    )


def test_front_puts_objective_0_on_x_as_optunas_pareto_plot_does() -> None:
    study = _front_study()
    ax = plots.front(study, METRICS, _pts(study), recommended=1).axes[0]
    html_front = optuna.visualization.plot_pareto_front(study, target_names=METRICS)
    assert (
        (ax.get_xlabel(), ax.get_ylabel())
        == (
            html_front.layout.xaxis.title.text,
            html_front.layout.yaxis.title.text,
        )
        == (VAL_ACC, THROUGHPUT_SAMPLES)
    )
    assert _lines(ax, "*") == [([0.945], [900.0])]  # trial 1: x its accuracy, y its speed


def test_front_footnote_lies_below_the_axes_and_inside_the_figure() -> None:
    study = _front_study()
    fig = plots.front(study, METRICS, _pts(study), recommended=1)
    fig.draw_without_rendering()  # lays the figure out
    ax = fig.axes[0]
    (note,) = [t for t in ax.texts if t.get_text().startswith("pruned as OOM")]
    assert (
        note.get_text() == "pruned as OOM (no values): #3 512x1 fp32, #4 512x2 fp32, #5 512x4 fp32"
    )
    box = note.get_window_extent()
    assert box.y1 <= ax.xaxis.label.get_window_extent().y0  # under the x label, off the plot
    assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)


# --- 4. trials pruned as slow ------------------------------------------------------------


def test_slow_trials_show_at_their_probes_speed_and_are_listed() -> None:
    # Their probes took 0.02 and 0.05 s a sample: 50 and 20 samples/s.
    study = _study(_complete(32, 900.0), _slow(64), _slow(128, probe_s=0.05))
    ax = batch_plots.throughput_vs_batch(_pts(study)).axes[0]
    assert _lines(ax, "o", hollow=True) == [([64, 128], [pytest.approx(50.0), 20.0])]
    assert "fp16 pruned as slow (probe's speed)" in _legend_texts(ax)
    assert (
        "pruned as slow: #1 64x1 fp16 (projected 900 s against 60 s), "
        "#2 128x1 fp16 (projected 900 s against 60 s)"
    ) in _texts(ax)


def test_a_slow_language_model_trial_shows_its_probe_in_tokens() -> None:
    # 0.01 s a sequence of 256 tokens: 25,600 tokens/s.
    study = _study(
        _complete(16, 9000.0, unit="tokens", seq_len=64),
        _slow(8, "fp32", probe_s=0.01, seq_len=256),
    )
    ax = batch_plots.throughput_vs_batch(_pts(study)).axes[0]
    assert _lines(ax, "o", hollow=True) == [([8 * 256], [pytest.approx(25_600.0)])]
    assert ax.get_ylabel() == "throughput (tokens/s)"


# --- 5. front.png of a study where nothing completed -----------------------------------


def test_front_without_a_completed_trial_says_how_the_trials_ended() -> None:
    study = _study(_oom_predicted(512), _oom_predicted(1024), _slow(64))
    ax = plots.front(study, METRICS, _pts(study), recommended=None).axes[0]
    assert "No trial completed: all 3 were pruned\n(2 oom_predicted, 1 slow)" in _texts(ax)
    study.add_trial(_failed(32))
    ax = plots.front(study, METRICS, _pts(study), recommended=None).axes[0]
    assert "No trial completed: 1 failed, 3 pruned\n(2 oom_predicted, 1 slow)" in _texts(ax)


# --- 6. no legend without labelled artists -----------------------------------------------


def test_a_study_without_a_completed_trial_draws_without_warnings() -> None:
    # A study without a budget (none set, CPU) whose trials failed or diverged: nothing any
    # plot draws carries a label.
    diverged = _trial(TrialState.PRUNED, 64, budget=None, reason="diverged", message="NaN")
    study = _study(_failed(32, budget=None), diverged)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        files = plots.render(study, METRICS, recommended=None)
    assert [str(w.message) for w in caught] == []
    assert "throughput_vs_batch.png" in files  # the control: it did draw


# --- 7. a language model's micro-batch in tokens -----------------------------------------


def _lm_study() -> optuna.Study:
    # batch 64 x 256 tokens = 16,384 tokens, 344 MiB; batch 128 x 64 = 8,192 tokens, 173 MiB.
    return _study(
        _complete(64, 30_000.0, unit="tokens", seq_len=256, peak=344 * MIB),
        _complete(128, 25_000.0, unit="tokens", seq_len=64, peak=173 * MIB),
    )


def test_a_language_models_memory_is_drawn_against_tokens_per_micro_batch() -> None:
    ax = batch_plots.memory_vs_batch(_pts(_lm_study())).axes[0]
    assert _lines(ax, "o", hollow=False) == [([16_384, 8_192], [344.0, 173.0])]
    assert ax.get_xlabel() == "tokens per micro-batch (batch size x data.seq_len)"


def test_a_language_models_throughput_is_drawn_against_tokens_per_micro_batch() -> None:
    ax = batch_plots.throughput_vs_batch(_pts(_lm_study())).axes[0]
    assert _lines(ax, "o") == [([8_192, 16_384], [25_000.0, 30_000.0])]
    assert ax.get_xlabel() == "tokens per micro-batch (batch size x data.seq_len)"


def test_one_sequence_length_keeps_the_batch_size_on_x() -> None:
    study = _study(_complete(64, 3.0, seq_len=256), _complete(128, 4.0, seq_len=256))
    ax = batch_plots.memory_vs_batch(_pts(study)).axes[0]
    assert ax.get_xlabel() == "batch size (micro-batch)"
    assert _lines(ax, "o", hollow=False)[0][0] == [64, 128]


# --- 8. importances of throughput over the batch geometry -------------------------------


def _bars(fig: Figure) -> dict[str, dict[str, float]]:
    """Each objective's bar widths by parameter name, as importances() draws them."""
    ax = fig.axes[0]
    names = [t.get_text() for t in ax.get_yticklabels()]
    return {
        bars.get_label(): {n: p.get_width() for n, p in zip(names, bars.patches, strict=True)}
        for bars in ax.containers
    }


def _lr_follows_the_batch() -> optuna.Study:
    # The lr doubles with the batch (as a user scaling it by hand would), throughput grows
    # with the batch and the accuracy with the lr: over all params, the lr takes half of
    # throughput's importance at least, being indistinguishable from the batch size.
    trials = []
    for k, batch in enumerate((8, 16, 32, 64, 128, 256)):
        lr = 0.001 * 2**k
        speed = 100.0 * batch / (batch + 32)
        trials.append(_complete(batch, speed, acc=0.8 + 0.02 * k + 0.01 * (k % 2), lr=lr))
    return _study(*trials)


def test_throughput_importances_are_over_the_batch_geometry_only() -> None:
    study = _lr_follows_the_batch()
    fig = plots.importances(study, METRICS)
    bars = _bars(fig)
    geometry = bars["throughput/samples_per_sec (geometry only)"]
    assert geometry["optimizer.lr"] == 0.0 and geometry["trainer.batch_size"] > 0
    assert bars[VAL_ACC]["optimizer.lr"] > 0  # other objectives: every param, as before
    assert fig.axes[0].get_title() == (
        "Parameter importances per objective (Optuna's default evaluator)\n"
        "throughput/samples_per_sec: over the batch geometry only, not the lr"
    )
    # study.html's importances too (plotly writes "/" as "\u002f")
    assert "samples_per_sec (geometry only)" in plots.html(study, METRICS)


# --- energy_to_target.png: energy against time to the target -----------------------------


def _predicted(geometry: str, seconds: float, joules: float | None) -> Predicted:
    """100 steps of seconds / 100 and joules / 100 each."""
    step_j = None if joules is None else joules / 100
    return Predicted(geometry, 64, 100.0, seconds / 100, (1,), step_j=step_j)


def _energy_plan(*predicted: Predicted) -> Plan:
    """A plan made by hand (its model's points for time_to_target.png only)."""
    points = (Point(1, "64x1 fp32", 64, 200.0, 0.05), Point(2, "128x1 fp32", 128, 150.0, 0.08))
    return Plan(1.0, "search.target", StepsModel(100.0, 64.0), "fitted", None, points, predicted)


# (seconds, joules) to the target: A is the fastest, B slower and lower, C dominated by B,
# D the lowest; E has no energy figure (hardware without a counter): not drawn.
FRUGAL = (
    _predicted("64x1 fp32", 10, 3000), _predicted("128x1 fp32", 12, 2000),
    _predicted("32x1 fp32", 15, 2500), _predicted("256x1 fp32", 20, 1500),
    _predicted("16x1 fp32", 30, None),
)  # fmt: skip


def test_energy_plot_fills_the_front_and_hollows_what_it_dominates() -> None:
    # The front (time_to_target.energy_front): 10 s 3000 J, 12 s 2000 J, 20 s 1500 J, joined
    # by a staircase (after each point, its energy holds until the next one's time); 32x1
    # (15 s, 2500 J) is above and right of 128x1: hollow. The fastest is circled by default.
    ax = plots.energy_to_target_plot(_energy_plan(*FRUGAL)).axes[0]
    assert _lines(ax, "o", hollow=False) == [([10, 12, 20], [3000, 2000, 1500])]
    assert _lines(ax, "o", hollow=True) == [([15], [2500])]
    (staircase,) = [line for line in ax.get_lines() if line.get_drawstyle() == "steps-post"]
    assert list(staircase.get_xdata()) == [10, 12, 20]
    assert sorted(_texts(ax)) == ["128x1 fp32", "256x1 fp32", "32x1 fp32", "64x1 fp32"]
    (circle,) = ax.collections
    assert [tuple(xy) for xy in circle.get_offsets()] == [(10, 3000)]
    assert "recommended (64x1 fp32)" in _legend_texts(ax)


def test_energy_plot_circles_the_configuration_recommended_by_energy() -> None:
    ax = plots.energy_to_target_plot(_energy_plan(*FRUGAL), FRUGAL[3]).axes[0]
    assert [tuple(xy) for xy in ax.collections[0].get_offsets()] == [(20, 1500)]
    assert "recommended (256x1 fp32)" in _legend_texts(ax)
    # and time_to_target.png circles the same one (batch 64 here, 20 s), not the soonest
    seconds = plots.time_to_target_plot(_energy_plan(*FRUGAL), FRUGAL[3]).axes[1]
    (circle,) = [c for c in seconds.collections if c.get_label() == "recommended"]
    assert [tuple(xy) for xy in circle.get_offsets()] == [(64, 20)]


def test_render_draws_the_energy_plot_only_where_energy_was_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(plots, "html", lambda study, metrics: "")  # not what is tested here
    study = _study(_complete(32, 900.0))
    files = plots.render(study, METRICS, None, plan=_energy_plan(*FRUGAL), planned=FRUGAL[3])
    assert files["energy_to_target.png"].startswith(b"\x89PNG")
    assert "time_to_target.png" in files
    unmeasured = _energy_plan(_predicted("64x1 fp32", 10, None))
    files = plots.render(study, METRICS, None, plan=unmeasured)
    assert "time_to_target.png" in files and "energy_to_target.png" not in files
