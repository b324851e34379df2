"""Every unit conversion a user reads, against exact values: MiB and GiB are powers of 2
(2**20, 2**30 bytes), so that a conversion by 10**6 or 10**9 (5% and 7% off) fails here;
seconds as a clock, per-second rates, shares and errors as percentages.

Each expected string is worked out by hand from the bytes or seconds given, not computed
with the code under test. A value such as 512 MiB = 536870912 bytes reads "512.0" in MiB
and "536.9" if divided by 10**6: the two never round to the same text.
"""

from __future__ import annotations

import math

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from batchfit.search.core.record import TrialRecord, mib
from batchfit.search.results.summary import _clock, spread_note, trial_line, trial_row
from batchfit.tracking.metrics import (
    DATA_WAIT_SHARE,
    PEAK_BYTES,
    PEAK_MIB,
    PREDICTED_BYTES,
    PREDICTED_MIB,
    THROUGHPUT_SAMPLES,
    THROUGHPUT_SPREAD,
    THROUGHPUT_TOKENS,
    TO_TARGET_S,
    VAL_ACC,
)
from batchfit.tracking.runs import mib_metrics
from batchfit.train.device.sizes import format_bytes, parse_budget
from batchfit.train.params import ACCUM_KEY, BATCH_KEY, PRECISION_KEY

MiB, GiB = 2**20, 2**30


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (512 * MiB, "512.0"),  # 536870912 bytes: "536.9" by 10**6
        (3 * MiB + MiB // 2, "3.5"),
        (MiB // 10 * 3, "0.3"),  # 314571 bytes: "0.3" by 10**6 too; the other cases tell
        (40 * GiB, "40960.0"),  # 42949672960 bytes: "42949.7" by 10**6
        (0, "0.0"),
        (None, "-"),
    ],
)
def test_mib_is_bytes_over_2_to_the_20(num_bytes, text):
    assert mib(num_bytes) == text


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (700 * MiB, "700.0 MiB"),  # 734003200 bytes: "734.0 MB" by 10**6
        (1023 * MiB, "1023.0 MiB"),
        (GiB, "1.0 GiB"),
        (3 * GiB + GiB // 2, "3.5 GiB"),  # 3758096384 bytes: "3.8 GB" by 10**9
        (141 * GiB, "141.0 GiB"),
        (2 * 2**40, "2.0 TiB"),
        (None, "-"),
    ],
)
def test_format_bytes_counts_in_powers_of_1024(num_bytes, text):
    assert format_bytes(num_bytes) == text


@pytest.mark.parametrize(
    ("given", "num_bytes"),
    [
        ("512MiB", 512 * 2**20),
        ("8GiB", 8 * 2**30),
        ("1.5 gib", 3 * 2**29),
        ("16GB", 16 * 10**9),  # decimal units stay decimal
        ("500MB", 500 * 10**6),
        ("25%", 1000),
        (4096, 4096),
    ],
)
def test_parse_budget_reads_binary_and_decimal_units(given, num_bytes):
    assert parse_budget(given, total_bytes=4000) == num_bytes


def test_mlflow_mib_metrics_are_bytes_over_2_to_the_20_to_a_tenth():
    figures = {
        PEAK_BYTES: 512 * MiB + 5 * MiB // 100,  # 512.05 MiB: 512.0 or 512.1 to a tenth
        PREDICTED_BYTES: 3 * GiB,
        THROUGHPUT_SAMPLES: 1e6,  # not memory: not converted
        "memory/reserved_bytes": math.nan,  # unknown: left out
    }
    shown = mib_metrics(figures)
    assert shown.keys() == {PEAK_MIB, PREDICTED_MIB}
    assert shown[PEAK_MIB] in (512.0, 512.1)  # round-half-even of 512.05
    assert shown[PREDICTED_MIB] == 3072.0  # 3221225472 bytes: 3221.2 by 10**6


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0:00"), (59.9, "0:59"), (61, "1:01"), (3599, "59:59"), (3600, "1:00:00"),
     (3600 + 62, "1:01:02"), (10 * 3600 + 5, "10:00:05")],
)  # fmt: skip
def test_clock_is_minutes_and_seconds_then_hours(seconds, text):
    assert _clock(seconds) == text


def _trial(**attrs) -> optuna.trial.FrozenTrial:
    run = {BATCH_KEY: 64, ACCUM_KEY: 2, PRECISION_KEY: "bf16", "device": "cpu"}
    return create_trial(
        state=TrialState.COMPLETE,
        values=[0.9],
        params={BATCH_KEY: 64},
        distributions={BATCH_KEY: IntDistribution(1, 1024)},
        user_attrs={**run, "state": "COMPLETE", **attrs},
    )


def _complete(**figures) -> optuna.trial.FrozenTrial:
    metrics = {THROUGHPUT_SAMPLES: 412.4, VAL_ACC: 0.9512, **figures}
    return _trial(
        peak_bytes=1536 * MiB,  # 1.5 GiB
        predicted_bytes=1500 * MiB,  # 1.46 GiB
        prediction_error=-0.0234,
        throughput=metrics.get(THROUGHPUT_TOKENS, metrics[THROUGHPUT_SAMPLES]),
        unit="tokens" if THROUGHPUT_TOKENS in metrics else "samples",
        val_acc=metrics[VAL_ACC],
        metrics=metrics,
        seconds=83.26,
    )


def test_a_trial_line_in_gib_samples_per_second_and_percentages():
    line = trial_line(_complete(**{THROUGHPUT_SPREAD: 0.12, TO_TARGET_S: 41.04}))
    parts = line.split(" | ")
    assert parts[1:] == [
        "412 samples/s (±6%)",  # half the spread, as a percentage
        "peak 1.5 GiB",
        "predicted 1.5 GiB (-2.3%)",  # 1500 MiB = 1.46 GiB; the error as a percentage
        "val acc 0.951",
        "target in 41.0 s",
        "83.3 s",
    ]


def test_a_starved_trial_says_its_data_wait_as_a_percentage():
    line = trial_line(_complete(**{DATA_WAIT_SHARE: 0.254}))
    assert "waiting for data 25% of the time" in line.split(" | ")


def test_a_trial_row_in_mib():
    row = trial_row(_complete())
    assert row[-3:] == ["412", "1536.0", "1500.0"]  # samples/s, peak MiB, predicted MiB


def test_spread_note_is_half_the_spread():
    record = TrialRecord.of(_complete(**{THROUGHPUT_SPREAD: 0.25}))
    assert spread_note(record) == " (±12%)"  # 12.5% to a whole percent, half to even
    assert spread_note(TrialRecord.of(_complete())) == ""


def test_a_run_name_in_mib_and_per_second():
    name = TrialRecord.of(_complete()).run_name([VAL_ACC])
    assert name.split(" · ", 1)[1] == "64x2 bf16 · acc 0.951 · 412/s · 1536.0 MiB"
    tokens = TrialRecord.of(_complete(**{THROUGHPUT_TOKENS: 9120.4}))
    assert tokens.run_name([VAL_ACC]).endswith("acc 0.951 · 9120 tokens/s · 1536.0 MiB")
