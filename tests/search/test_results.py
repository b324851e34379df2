"""What a study shows and publishes: the plots (search/results/plots.py), summary.md and run names
(search/results/summary.py), progress lines, and Results.publish onto a real MLflow store.

One hand-made study serves all: the figures each check expects are derived in comments."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from matplotlib.figure import Figure
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial
from PIL import Image
from rich.console import Console

from batchfit.common.overrides import load_overrides
from batchfit.search.core.record import TrialRecord
from batchfit.search.core.study_config import RecommendRule
from batchfit.search.results import batch_plots, plots, points, summary
from batchfit.search.results.points import MIN_IMPORTANCE_TRIALS
from batchfit.search.results.recommend import recommend
from batchfit.search.results.summary import EPOCH_LINES_AFTER_S, StudyProgress, summary_markdown
from batchfit.search.study.publish import PLOTS_EVERY_S, PUBLISH_EVERY_S, RECOMMENDED_TAG, Results
from batchfit.tracking.metrics import PEAK_BYTES, THROUGHPUT_SAMPLES, TRAIN_LOSS, VAL_ACC, VAL_LOSS
from batchfit.tracking.runs import Tracker
from batchfit.tracking.tags import NOTE_TAG

METRICS = [VAL_ACC, THROUGHPUT_SAMPLES]
MIB = 2**20
BUDGET = 64 * MIB
DISTRIBUTIONS = {
    "trainer.batch_size": CategoricalDistribution([32, 64, 128, 256, 512]),
    "trainer.precision": CategoricalDistribution(["fp32", "bf16"]),
    "optimizer.lr": FloatDistribution(1e-3, 1.0, log=True),
}


def _attrs(batch: int, accum: int, precision: str, lr: float) -> dict:
    return {
        "trainer.batch_size": batch,
        "trainer.accum_steps": accum,
        "trainer.precision": precision,
        "effective_batch_size": batch * accum,
        "lr_scaled": lr,
        "optimizer.lr": lr,
        "budget_bytes": BUDGET,
    }


def _params(batch: int, precision: str, lr: float) -> dict:
    return {"trainer.batch_size": batch, "trainer.precision": precision, "optimizer.lr": lr}


def _complete(
    batch: int, accum: int, precision: str, lr: float, acc: float, speed: float, peak: int
) -> optuna.trial.FrozenTrial:
    attrs = _attrs(batch, accum, precision, lr) | {
        "throughput": speed,
        "val_acc": acc,
        "peak_bytes": peak,
        "predicted_bytes": round(peak * 1.081),
        "state": "COMPLETE",
        "metrics": {
            VAL_ACC: acc,
            VAL_LOSS: 1 - acc,
            THROUGHPUT_SAMPLES: speed,
            PEAK_BYTES: float(peak),
        },
    }
    return create_trial(
        state=TrialState.COMPLETE,
        values=[acc, speed],
        params=_params(batch, precision, lr),
        distributions=DISTRIBUTIONS,
        user_attrs=attrs,
    )


# trial  batch x accum  precision  eff.  lr     val acc  samples/s  peak bytes
#   0     32 x 1         fp32        32   0.005  0.930      300      400_000
#   1     64 x 2         bf16       128   0.02   0.945      900      678_996   <- recommended
#   2    128 x 1         fp32       128   0.01   0.951      600    2_000_000   <- best acc
#   3    256 x 1         bf16       256   0.04   0.920     2000    3_000_000
#   4    512 x 1         fp32       512   0.08   PRUNED oom_predicted (predicted 80 MiB)
#   5     32 x 32        fp32      1024   0.16   FAIL
# Recommended (default rule): best acc 0.951, within 1% is >= 0.94149: trials 1 and 2; of
# those the faster is 1 (900/s).
def _trials() -> list[optuna.trial.FrozenTrial]:
    oom = _attrs(512, 1, "fp32", 0.08) | {
        "predicted_bytes": 80 * MIB,
        "state": "PRUNED",
        "reason": "oom_predicted",
        "message": "its step is predicted to need 80.0 MiB, over the budget",
    }
    failed = _attrs(32, 32, "fp32", 0.16) | {"state": "FAIL", "error": "RuntimeError: boom"}
    return [
        _complete(32, 1, "fp32", 0.005, 0.930, 300.0, 400_000),
        _complete(64, 2, "bf16", 0.02, 0.945, 900.0, 678_996),
        _complete(128, 1, "fp32", 0.01, 0.951, 600.0, 2_000_000),
        _complete(256, 1, "bf16", 0.04, 0.920, 2000.0, 3_000_000),
        create_trial(
            state=TrialState.PRUNED,
            params=_params(512, "fp32", 0.08),
            distributions=DISTRIBUTIONS,
            user_attrs=oom,
        ),
        create_trial(
            state=TrialState.FAIL,
            params=_params(32, "fp32", 0.16),
            distributions=DISTRIBUTIONS,
            user_attrs=failed,
        ),
    ]


def _study(name: str = "s") -> optuna.Study:
    study = optuna.create_study(study_name=name, directions=["maximize", "maximize"])
    for trial in _trials():
        study.add_trial(trial)
    return study


def _lines(fig: Figure, marker: str) -> list[tuple[list, list]]:
    return [
        (list(line.get_xdata()), list(line.get_ydata()))
        for line in fig.axes[0].get_lines()
        if line.get_marker() == marker
    ]


# --- plots -------------------------------------------------------------------------------


def _check_png(content: bytes) -> None:
    assert content.startswith(b"\x89PNG\r\n\x1a\n")
    # figsize 7.5 x 4.8 in at 110 dpi (plots.png): 825 x 528 pixels
    assert Image.open(io.BytesIO(content)).size == (825, 528)


def test_render_draws_every_plot_and_importances_from_enough_trials() -> None:
    study = _study()
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == MIN_IMPORTANCE_TRIALS - 1
    files = plots.render(study, METRICS, recommended=1)
    pngs = ["front.png", "throughput_vs_batch.png", "memory_vs_batch.png"]
    pngs.append("lr_vs_effective_batch.png")
    assert sorted(files) == sorted([*pngs, "study.html"])  # no importances.png yet
    for name in pngs:
        _check_png(files[name])
    page = files["study.html"].decode()
    assert page.startswith("<!DOCTYPE html>") and "plotly" in page
    assert "plotly.js v" in page  # the library itself is embedded: the page works offline

    study.add_trial(_complete(128, 2, "bf16", 0.02, 0.940, 1200.0, 1_500_000))
    files = plots.render(study, METRICS, recommended=1)
    _check_png(files["importances.png"])
    assert len(files) == len(pngs) + 2


def test_throughput_marks_the_oom_trial_as_a_cross_on_the_axis() -> None:
    fig = batch_plots.throughput_vs_batch(points.points(_study().get_trials()))
    assert _lines(fig, "x") == [([512], [0.0])]  # the OOM-pruned trial, fp32
    # Completed trials per precision (bf16 sorts first); the failed one is not drawn.
    assert _lines(fig, "o") == [([64, 256], [900.0, 2000.0]), ([32, 128], [300.0, 600.0])]


def test_memory_draws_the_budget_line_in_mib() -> None:
    fig = batch_plots.memory_vs_batch(points.points(_study().get_trials()))
    flat = [ys for _, ys in _lines(fig, "None") if len(set(ys)) == 1]
    assert flat == [[64.0, 64.0]]  # BUDGET / MiB
    measured = [
        (list(line.get_xdata()), list(line.get_ydata()))
        for line in fig.axes[0].get_lines()
        if line.get_marker() == "o" and line.get_markerfacecolor() != "none"
    ]
    # bf16 then fp32; the failed trial measured nothing
    assert measured == [
        ([64, 256], [678_996 / MIB, 3e6 / MIB]),
        ([32, 128], [4e5 / MIB, 2e6 / MIB]),
    ]


def test_lr_reference_line_is_linear_scaling_through_the_best_accuracy() -> None:
    fig = batch_plots.lr_vs_effective_batch(points.points(_study().get_trials()))
    ((xs, ys),) = [
        (list(line.get_xdata()), list(line.get_ydata()))
        for line in fig.axes[0].get_lines()
        if line.get_linestyle() == "--"
    ]
    # Through trial 2 (eff. 128, lr 0.01) with slope 1 in log-log, over the effective
    # batches of all trials (32 .. 1024): lr 0.01 * 32/128 and 0.01 * 1024/128.
    assert xs == [32, 1024]
    assert ys == pytest.approx([0.0025, 0.08])


def test_front_stars_the_recommended_trial() -> None:
    study = _study()
    trials = study.get_trials()
    fig = plots.front(study, METRICS, points.points(trials), recommended=1)
    assert _lines(fig, "*") == [([0.945], [900.0])]  # x: accuracy (objective 0), as study.html
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "pruned as OOM (no values): #4 512x1 fp32" in texts


# --- summary.md, run names ---------------------------------------------------------------

OVERRIDES = [
    "data=digits",
    "trainer.batch_size=64",
    "trainer.accum_steps=2",
    "trainer.precision=bf16",
    "mlflow.tracking_uri=http://me:secret@host:5000",
]


def test_summary_markdown() -> None:
    study = _study()
    rec = recommend(study.get_trials(), RecommendRule())
    text = summary_markdown(study, METRICS, rec, OVERRIDES)
    assert (
        "5 finished trials: 4 COMPLETE, 1 FAIL; not counted, answered without training: "
        "1 PRUNED (oom_predicted)."
    ) in text
    assert "trial 1, the best throughput/samples_per_sec (900) among the 2 trials" in text
    # peak 678996 B = 0.648 MiB -> 0.6; predicted round(678996 * 1.081) = 734,005 B -> 0.7
    row = "| 1 | 64 | 2 | 128 | bf16 | 0.02 | 0.945 | 900 | 0.6 | 0.7 |"
    assert text.count(row) == 2  # the recommendation and the Pareto front
    assert (
        "```\npython -m train data=digits trainer.batch_size=64 trainer.accum_steps=2 "
        "trainer.precision=bf16 mlflow.tracking_uri=http://me:***@host:5000\n```"
    ) in text
    assert "secret" not in text
    # OOM boundary per precision x accumulation (no fit report here: the trials'): fp32 x 1
    # fitted 32 and 128, OOM at 512; bf16 fitted 256 at x 1 and 64 at x 2, no OOM.
    assert (
        "| bf16 | 1 | 256 | - | 256 |\n| bf16 | 2 | 64 | - | 64 |\n"
        "| fp32 | 1 | 128 | 512 | 32, 128 |\n\n"
    ) in text
    assert "## Pruned trials" in text
    assert "| 4 | 512 | 1 | 512 | fp32 | oom_predicted |" in text


def test_summary_markdown_without_a_completed_trial() -> None:
    study = optuna.create_study(study_name="s", directions=["maximize", "maximize"])
    study.add_trial(_trials()[4])
    text = summary_markdown(study, METRICS, None)
    assert "Recommended" not in text and "python -m train" not in text
    assert "| fp32 | 1 | - | 512 | - |" in text and "oom_predicted |" in text


CONFIG = {"trainer.batch_size": 64, "trainer.accum_steps": 2, "trainer.precision": "bf16"}


@pytest.mark.parametrize(
    ("attrs", "name"),
    [
        ({}, "trial-3 · 64x2 bf16"),  # before the end: the configuration only
        (
            {
                "state": "COMPLETE",
                "peak_bytes": 678996,
                "metrics": {VAL_ACC: 0.9456, THROUGHPUT_SAMPLES: 912.4},
            },
            "trial-3 · 64x2 bf16 · acc 0.946 · 912/s · 0.6 MiB",
        ),
        (
            {"state": "PRUNED", "reason": "oom_predicted", "predicted_bytes": 9e9},
            "trial-3 · 64x2 bf16 · PRUNED oom_predicted",
        ),
        ({"state": "PRUNED"}, "trial-3 · 64x2 bf16 · PRUNED pruner"),
        ({"state": "FAIL", "error": "boom"}, "trial-3 · 64x2 bf16 · FAILED"),
    ],
)
def test_run_name(attrs: dict, name: str) -> None:
    assert TrialRecord.from_attrs(3, CONFIG | attrs).run_name() == name


# --- progress lines ----------------------------------------------------------------------


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """batchfit.search.results.summary's monotonic clock, set by the test."""
    now = [1000.0]
    monkeypatch.setattr(summary, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def _plain() -> Console:
    console = Console(file=io.StringIO(), width=200)
    assert not console.is_terminal
    return console


def _progress_lines(console: Console) -> list[str]:
    return [line for line in console.file.getvalue().splitlines() if line.startswith("progress")]


def test_progress_in_plain_lines(clock: list[float]) -> None:
    trials = _trials()
    study = optuna.create_study(directions=["maximize", "maximize"])
    console = _plain()
    progress = StudyProgress(console, n_trials=4, done=0, metric=VAL_ACC)
    # finished at (s):  60      90      120 (oom_predicted: not counted)  200
    for trial, at in zip(
        [trials[0], trials[1], trials[4], trials[2]], [60, 90, 120, 200], strict=True
    ):
        study.add_trial(trial)
        clock[0] = 1000.0 + at
        progress.trial_finished(study, study.get_trials()[-1])
    # left = elapsed / trials done here x trials to go: 60/1*3, 90/2*2, 120/2*2, 200/3*1
    assert _progress_lines(console) == [
        "progress: 1/4 trials, 1:00 elapsed, ~3:00 left; best val/acc 0.93 (#0)",
        "progress: 2/4 trials, 1:30 elapsed, ~1:30 left; best val/acc 0.945 (#1)",
        "progress: 2/4 trials, 2:00 elapsed, ~2:00 left; best val/acc 0.945 (#1)",
        "progress: 3/4 trials, 3:20 elapsed, ~1:06 left; best val/acc 0.951 (#3)",
    ]
    # the trial's own line says it does not count
    assert "#2   PRUNED (oom_predicted)" in console.file.getvalue()
    assert "not counted in search.n_trials" in console.file.getvalue()


def test_progress_of_a_resumed_study_counts_only_new_trials_for_time_left(
    clock: list[float],
) -> None:
    trials = _trials()
    study = optuna.create_study(directions=["maximize", "maximize"])
    study.add_trial(trials[0])
    study.add_trial(trials[1])
    console = _plain()
    progress = StudyProgress(console, n_trials=4, done=2, metric=VAL_ACC)
    study.add_trial(trials[2])
    clock[0] += 30
    progress.trial_finished(study, study.get_trials()[-1])
    # One new trial in 30 s, one to go: ~30 s (not 30 s / 3 done).
    assert _progress_lines(console) == [
        "progress: 3/4 trials, 0:30 elapsed, ~0:30 left; best val/acc 0.951 (#2)"
    ]


def test_time_left_is_capped_by_the_time_box(clock: list[float]) -> None:
    """Under search.timeout_s=20 the bar showed '~1620:40:57 left' (the pace of the trials
    times the many still to go): what is left is the time box's at most."""
    trials = _trials()
    study = optuna.create_study(directions=["maximize", "maximize"])
    console = _plain()
    progress = StudyProgress(console, n_trials=1000, done=0, metric=VAL_ACC, timeout_s=20)
    for trial, at in zip([trials[0], trials[1]], [8, 25], strict=True):
        study.add_trial(trial)
        clock[0] = 1000.0 + at
        progress.trial_finished(study, study.get_trials()[-1])
    assert _progress_lines(console) == [
        "progress: 1/1000 trials, 0:08 elapsed, ~0:12 left (search.timeout_s); best val/acc "
        "0.93 (#0)",
        "progress: 2/1000 trials, 0:25 elapsed, search.timeout_s reached: no new trial starts; "
        "best val/acc 0.945 (#1)",
    ]
    live = Console(file=io.StringIO(), force_terminal=True, width=200)
    with StudyProgress(live, n_trials=1000, done=0, metric=VAL_ACC, timeout_s=20) as bar:
        clock[0] += 5
        study.add_trial(trials[2])
        bar.trial_finished(study, study.get_trials()[-1])
        text = Console(file=io.StringIO(), width=200, record=True)
        text.print(bar._progress.get_renderable())
        assert "~0:15 left (search.timeout_s)" in text.export_text()


def test_epoch_lines_only_for_a_trial_running_long(clock: list[float]) -> None:
    console = _plain()
    progress = StudyProgress(console, n_trials=4, done=0, metric=VAL_ACC)
    metrics = {"epoch": 1.0, "num_epochs": 3, VAL_ACC: 0.9, VAL_LOSS: 0.25, TRAIN_LOSS: 1.0}
    progress.epoch(3, metrics, elapsed_s=EPOCH_LINES_AFTER_S - 0.1)
    assert console.file.getvalue() == ""
    assert EPOCH_LINES_AFTER_S < 6.0
    progress.epoch(3, metrics, elapsed_s=6.0)
    assert console.file.getvalue() == "  #3 epoch 1.00/3: val/acc 0.9, val/loss 0.25 (6 s)\n"


def test_live_progress_in_a_terminal_shows_the_trial_and_its_epochs() -> None:
    """The rich display as a terminal shows it: the trials bar with the best so far, and a
    long trial's epoch line, which is gone when the trial ends."""
    console = Console(file=io.StringIO(), force_terminal=True, width=200)
    study = optuna.create_study(directions=["maximize", "maximize"])
    metrics = {"epoch": 1.0, "num_epochs": 3, VAL_ACC: 0.9, VAL_LOSS: 0.25}
    with StudyProgress(console, n_trials=4, done=0, metric=VAL_ACC) as progress:
        progress.epoch(0, metrics, elapsed_s=6.0)
        shown = progress._progress.get_renderable()
        text = Console(file=io.StringIO(), width=200, record=True)
        text.print(shown)
        screen = text.export_text()
        assert "trials" in screen and "#0 epoch 1.00/3: val/acc 0.9" in screen, screen
        study.add_trial(_trials()[0])
        progress.trial_finished(study, study.get_trials()[-1])
        text = Console(file=io.StringIO(), width=200, record=True)
        text.print(progress._progress.get_renderable())
        screen = text.export_text()
        assert "1/4" in screen and "best val/acc 0.93 (#0)" in screen, screen
        assert "epoch" not in screen


# --- Results.publish on a real MLflow store ----------------------------------------------


@pytest.fixture(scope="module")
def tracker(tmp_path_factory: pytest.TempPathFactory) -> Tracker:
    root = tmp_path_factory.mktemp("mlflow")
    return Tracker(f"sqlite:///{root}/mlflow.db", "s", str(root / "art"))


def _overrides_of(trial: optuna.trial.FrozenTrial) -> list[str]:
    a = trial.user_attrs
    return [
        "data=digits",
        f"trainer.batch_size={a['trainer.batch_size']}",
        f"trainer.accum_steps={a['trainer.accum_steps']}",
        f"trainer.precision={a['trainer.precision']}",
    ]


def _artifacts(tracker: Tracker, run_id: str) -> set[str]:
    top = tracker.client.list_artifacts(run_id)
    return {f.path for f in top} | {f.path for f in tracker.client.list_artifacts(run_id, "plots")}


def test_publish_to_mlflow_and_output_dir(
    tracker: Tracker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    study = _study("published")
    parent, _ = tracker.study_run("published", None)
    out = tmp_path / "out"
    results = Results(parent, METRICS, RecommendRule(), _overrides_of, out)
    rec = results.publish(study)
    assert tracker.close(30) and tracker.outbox.failed == []
    assert rec.trial.number == 1

    run = tracker.client.get_run(parent.run_id)
    assert {
        "summary.md",
        "best.yaml",
        "plots/front.png",
        "plots/throughput_vs_batch.png",
        "plots/memory_vs_batch.png",
        "plots/lr_vs_effective_batch.png",
        "plots/study.html",
    } <= _artifacts(tracker, parent.run_id)
    folder = Path(tracker.client.download_artifacts(parent.run_id, "", str(tmp_path / "dl")))
    summary = (folder / "summary.md").read_text()
    assert "trial 1, the best throughput" in summary
    assert run.data.tags[NOTE_TAG] == summary
    assert run.data.tags[RECOMMENDED_TAG] == "1"
    rerun = ["data=digits", "trainer.batch_size=64", "trainer.accum_steps=2"]
    rerun.append("trainer.precision=bf16")
    assert load_overrides(out / "best.yaml") == rerun
    assert load_overrides(folder / "best.yaml") == rerun

    # Called back right after publishing: nothing is written until PUBLISH_EVERY_S passed.
    writes: list[object] = []
    put = tracker.outbox.put
    monkeypatch.setattr(tracker.outbox, "put", lambda write: (writes.append(write), put(write)))
    drawn: list[object] = []
    render = plots.render
    monkeypatch.setattr(plots, "render", lambda *a, **k: (drawn.append(a), render(*a, **k))[1])
    results(study, study.trials[-1])
    assert writes == []
    results._published_at -= PUBLISH_EVERY_S  # as if that long ago
    results(study, study.trials[-1])
    assert writes  # the control: a due call does write
    # ... the summary, not the plots: those were drawn less than PLOTS_EVERY_S ago
    assert drawn == []
    results._published_at -= PUBLISH_EVERY_S
    results._plotted_at -= PLOTS_EVERY_S
    results(study, study.trials[-1])
    assert len(drawn) == 1
    assert tracker.close(30)


def test_publish_without_a_completed_trial(tracker: Tracker, tmp_path: Path) -> None:
    study = optuna.create_study(study_name="none", directions=["maximize", "maximize"])
    study.add_trial(_trials()[4])
    parent, _ = tracker.study_run("none", None)
    out = tmp_path / "out"
    assert Results(parent, METRICS, RecommendRule(), _overrides_of, out).publish(study) is None
    assert tracker.close(30) and tracker.outbox.failed == []
    assert not (out / "best.yaml").exists()
    artifacts = _artifacts(tracker, parent.run_id)
    assert "summary.md" in artifacts and "plots/front.png" in artifacts
    assert "best.yaml" not in artifacts
    assert RECOMMENDED_TAG not in tracker.client.get_run(parent.run_id).data.tags


def test_a_long_summary_becomes_a_description_cut_at_a_whole_line() -> None:
    from batchfit.search.study.publish import CUT_NOTE, DESCRIPTION_CHARS, description

    rows = "\n".join(f"| {n} | 256 | 1 | 256 | fp32 | oom_predicted |" for n in range(400))
    summary = "# Study s\n\n" + rows + "\n"
    assert len(summary) > DESCRIPTION_CHARS  # ~16,000 characters: 400 pruned trials
    text = description(summary)
    assert len(text) <= DESCRIPTION_CHARS and text.endswith(CUT_NOTE)
    kept = text.removesuffix(CUT_NOTE)
    assert summary.startswith(kept) and kept.endswith("oom_predicted |")  # a whole row
    assert description("# short\n") == "# short\n"


@pytest.mark.parametrize(
    ("experiment", "words"),
    [
        ("llm_lora", " · seq 256 · LoRA r8"),
        ("llm_qlora", " · seq 256 · LoRA r8 · nf4"),
        ("llm_full", " · seq 256 · full"),
        ("resnet", ""),  # a model and data without these levers: the geometry alone
    ],
)
def test_a_run_name_and_params_tell_lora_qlora_and_full_fine_tuning_apart(
    hydra_conf, experiment: str, words: str
) -> None:
    """A QLoRA run was named '4x1 fp32', its params without the quantization, sequence
    length and LoRA rank: LoRA and QLoRA runs looked alike in MLflow's table."""
    from batchfit.train.__main__ import _geometry
    from batchfit.train.params import lever_params
    from batchfit.train.plan import plan

    cfg = hydra_conf([f"+experiment={experiment}", "trainer.batch_size=4"])
    levers = lever_params(cfg)
    record = TrialRecord.from_attrs(3, {**CONFIG, **levers})
    assert record.run_name() == f"trial-3 · 64x2 bf16{words}"
    assert _geometry(plan(cfg, None), cfg).endswith(f"4x1 {cfg.trainer.precision}{words}")
    if experiment != "resnet":
        assert set(levers) == {"data.seq_len", "model.lora.r", "model.quantization"}
