"""search/results/boundary.py: the summary's memory boundary is the fit report's, cell by cell
(precision x accumulation x sequence length), with the trials' evidence beside it."""

from __future__ import annotations

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from batchfit.search.fit.layouts import fit_reports
from batchfit.search.results import boundary
from batchfit.search.study.validate import validate

# small_cnn(width=4) peaks at ~0.33 MiB per 32 samples in fp32 and about half in bf16: a
# 1 MiB budget puts the fp32 limit at 64 and the bf16 one at 128.
SPACE = (
    '++search.params={trainer.batch_size:"choice(32,64,128,256)",'
    'trainer.accum_steps:"choice(1,2)",trainer.precision:"choice(fp32,bf16)"}'
)
SMALL = ["model=small_cnn", "model.width=4", "data=digits", "trainer.device=cpu"]


def _reports(hydra_conf, overrides: list[str]) -> list:
    cfg = hydra_conf(overrides)
    checked = validate(
        cfg, "boundary", lambda trial: hydra_conf([*overrides, *trial]), open_store=False
    )
    return fit_reports(cfg, checked.space, checked.spec, checked.settings)


def _trial(batch: int, accum: int, precision: str, reason: str | None = None, **params):
    state = TrialState.PRUNED if reason else TrialState.COMPLETE
    attrs = {
        "trainer.batch_size": batch, "trainer.accum_steps": accum,
        "trainer.precision": precision, "trainer.activation_checkpointing": "none",
    }  # fmt: skip
    if reason:
        attrs["reason"] = reason
    if reason != "oom_predicted":
        attrs["peak_bytes"] = 1
    return create_trial(
        state=state,
        value=0.5 if state == TrialState.COMPLETE else None,
        params=params,
        distributions={k: CategoricalDistribution([v]) for k, v in params.items()},
        user_attrs=attrs,
    )


def _study(cells: list, trials: list) -> optuna.Study:
    study = optuna.create_study()
    if cells:
        study.set_user_attr(boundary.FIT_ATTR, cells)
    for trial in trials:
        study.add_trial(trial)
    return study


def test_the_boundary_is_the_fit_reports_per_precision_and_accumulation(hydra_conf) -> None:
    (report,) = _reports(hydra_conf, [*SMALL, "search.memory_budget=1MiB", SPACE])
    # The trials saw an OOM at bf16 x accumulation 2 and batch 256: a boundary per precision
    # alone would read it as bf16's limit everywhere.
    trials = [_trial(64, 1, "fp32"), _trial(256, 2, "bf16", "oom_predicted")]
    keys, rows = boundary.rows(_study(boundary.fit_cells([report]), trials))
    assert keys == ["trainer.precision", "trainer.accum_steps"]
    assert len(rows) == 4
    for row in rows:
        precision, accum = row.key["trainer.precision"], row.key["trainer.accum_steps"]
        fitting = [b for b in report.batch_sizes if report.cells[precision, b, accum].fits]
        oom = [b for b in report.batch_sizes if not report.cells[precision, b, accum].fits]
        assert row.largest == report.largest(precision, accum) == max(fitting)
        assert row.smallest_oom == min(oom, default=None)
    by_cell = {(r.key["trainer.precision"], r.key["trainer.accum_steps"]): r for r in rows}
    assert by_cell["fp32", 1].largest == 64 and by_cell["fp32", 1].smallest_oom == 128
    assert by_cell["bf16", 1].largest == 128 and by_cell["bf16", 1].smallest_oom == 256
    assert by_cell["fp32", 1].trained == {(64, 1)} and not by_cell["bf16", 2].trained


def test_sequence_length_is_a_cell_of_the_boundary(hydra_conf) -> None:
    # The gpt experiment searches data.seq_len: one fit report per length, and the boundary
    # per length equals each report's.
    overrides = [
        "+experiment=gpt", "data.max_bytes=20000",
        '++search.params={data.seq_len:"choice(64,256)",trainer.precision:"choice(fp32)"}',
    ]  # fmt: skip
    reports = _reports(hydra_conf, overrides)
    assert [r.at for r in reports] == [{"data.seq_len": 64}, {"data.seq_len": 256}]
    keys, rows = boundary.rows(_study(boundary.fit_cells(reports), []))
    assert keys[-1] == "data.seq_len"
    for report in reports:
        (row,) = (
            r for r in rows if r.key["data.seq_len"] == report.at["data.seq_len"]
            and r.key["trainer.accum_steps"] == 1
        )  # fmt: skip
        assert row.largest == report.largest("fp32", 1)
    limits = {r.key["data.seq_len"]: r.largest for r in rows if r.key["trainer.accum_steps"] == 1}
    assert limits[256] < limits[64]  # 4x the tokens per sample: a smaller batch fits


def test_a_real_oom_where_the_report_said_it_fits_is_shown() -> None:
    cells = [
        {"trainer.precision": "fp32", "trainer.accum_steps": 1,
         "trainer.activation_checkpointing": "none", "trainer.batch_size": b, "fits": b <= 64,
         "peak_bytes": b}
        for b in (32, 64, 128)
    ]  # fmt: skip
    header, lines = boundary.table(_study(cells, [_trial(64, 1, "fp32", "oom")]))
    assert header == ["precision", "accum_steps", "largest that fits", "smallest OOM", "trained"]
    assert lines == [["fp32", "1", "64", "128 (real OOM at 64)", "-"]]


def test_without_a_fit_report_the_trials_give_the_boundary_per_cell() -> None:
    trials = [
        _trial(16, 1, "fp32"), _trial(64, 1, "fp32"), _trial(256, 1, "fp32", "oom"),
        _trial(64, 2, "fp32", "oom_predicted"), _trial(512, 1, "bf16", "slow"),
    ]  # fmt: skip
    study = _study([], trials)
    assert "the trials" in boundary.title(study)
    _, lines = boundary.table(study)
    # bf16 was slow, not OOM: trained past the memory check (a peak), so it fitted.
    assert lines == [
        ["bf16", "1", "512", "-", "512"],
        ["fp32", "1", "64", "256", "16, 64"],
        ["fp32", "2", "-", "64", "-"],
    ]
