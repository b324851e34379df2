"""Model FLOPs utilisation: FLOPs per sample counted on the predictor's fake model, the peak
from the GPU table or the cached CPU probe, and perf/* on a study's trials."""

from __future__ import annotations

import json
import re

import pytest
import torch
from mlflow.tracking import MlflowClient
from torch import nn

from batchfit.search.core.record import Attr, TrialRecord
from batchfit.tracking.metrics import (
    ACHIEVED_FLOPS,
    FLOPS_PER_SAMPLE,
    MFU,
    PEAK_FLOPS,
    THROUGHPUT_SAMPLES,
)
from batchfit.train.measure import flops as flops_module
from batchfit.train.measure.flops import (
    PROBE_BURSTS,
    _cache_path,
    _machine_key,
    best_rate,
    cpu_peak,
    cuda_peak,
    mfu_metrics,
    perf_metrics,
)
from batchfit.train.memory.predict import MemoryPredictor
from tests.conftest import FAST

CPU = torch.device("cpu")


def _predictor(model: nn.Module, d: int) -> MemoryPredictor:
    example = (torch.randn(2, d), torch.zeros(2, dtype=torch.int64))
    return MemoryPredictor(model, lambda p: torch.optim.SGD(p, lr=0.1), example, CPU)


def test_flops_per_sample_are_the_matmuls_of_forward_and_backward() -> None:
    d, h, c = 12, 20, 5
    model = nn.Sequential(nn.Linear(d, h, bias=False), nn.ReLU(), nn.Linear(h, c, bias=False))
    predictor = _predictor(model, d)
    # forward 2dh + 2hc; backward: both weight gradients (2dh + 2hc) and the input gradient
    # of the second layer (2hc); the data needs none.
    expected = 4 * d * h + 6 * h * c
    for batch_size in (1, 8, 64):
        assert predictor.flops_per_sample(batch_size) == expected


def test_flops_grow_with_the_sequence_for_attention() -> None:
    from batchfit.train.language.text import GPT
    from batchfit.train.tasks import LanguageModel

    def per_token(seq_len: int) -> float:
        ids = torch.zeros(2, seq_len, dtype=torch.int64)
        model = GPT(256, seq_len, n_layer=1, n_head=2, n_embd=32)
        predictor = MemoryPredictor(
            model,
            lambda p: torch.optim.SGD(p, lr=0.1),
            {"input_ids": ids, "labels": ids},
            CPU,
            LanguageModel(),
        )
        return predictor.flops_per_sample(4) / seq_len

    # Per token, the dense layers cost the same at any length; attention grows with it.
    assert per_token(64) > per_token(16) > 0


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5e12),
        ("NVIDIA H200", "fp32", 67e12),
        ("NVIDIA A100-SXM4-40GB", "tf32", 156e12),
        ("NVIDIA L40S", "bf16", 362e12),  # not the L4's
        ("NVIDIA L4", "bf16", 121e12),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 on Volta
        ("NVIDIA GeForce GTX 1080", "fp32", None),  # not in the table
    ],
)
def test_cuda_peaks_come_from_the_table(name: str, precision: str, peak: float | None) -> None:
    assert cuda_peak(name, precision) == peak


def test_the_cpu_peak_is_probed_once_and_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = _cache_path()
    assert not path.exists()
    measured = cpu_peak("fp32")
    assert measured > 1e8  # any CPU does 0.1 GFLOP/s in fp32
    cached = json.loads(path.read_text())
    assert cached == {_machine_key("fp32"): measured}
    # Read back, not probed again: a value written there is what comes out.
    path.write_text(json.dumps({_machine_key("fp32"): 123.0}))
    assert cpu_peak("fp32") == 123.0


def test_the_probe_is_the_best_of_rounds_spread_in_time() -> None:
    # A busy spell through the whole first round (as long as the old single 0.3 s probe)
    # reads 3x low; the later rounds, after a pause each, see the machine free again.
    rates = iter([1e9] * PROBE_BURSTS + [3e9] * 100)
    pauses: list[float] = []
    best = best_rate(lambda: next(rates), rounds=3, seconds=0.0, pause_s=0.1, sleep=pauses.append)
    assert best == 3e9
    assert pauses == [0.1, 0.1]


def _cache(tmp_path, monkeypatch, value: float) -> None:
    """A cached fp32 peak of `value`, as an earlier probe on a busy machine left it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _cache_path().parent.mkdir(parents=True)
    _cache_path().write_text(json.dumps({_machine_key("fp32"): value}))


def _cached() -> float:
    return json.loads(_cache_path().read_text())[_machine_key("fp32")]


def test_a_contradicted_cpu_peak_is_measured_again_and_cached(tmp_path, monkeypatch) -> None:
    # 1e6 FLOPs per sample at 1000 samples/s achieve 1e9 FLOP/s, over the cached 4e8: the
    # peak is probed again (here a fake probe: 4e9), and the cache keeps the new one.
    _cache(tmp_path, monkeypatch, 4e8)
    figures, note = perf_metrics(1e6, 1000.0, CPU, "fp32", probe=lambda precision: 4e9)
    assert figures[PEAK_FLOPS] == 4e9 and figures[MFU] == 0.25
    assert note is None
    assert _cached() == 4e9
    # Not contradicted: not probed again.
    figures, note = perf_metrics(1e6, 1000.0, CPU, "fp32", probe=pytest.fail)
    assert figures[MFU] == 0.25 and note is None


def test_an_mfu_still_above_one_is_logged_with_why(tmp_path, monkeypatch) -> None:
    # The new probe reads low again (2e8, the machine still busy): the cache keeps the
    # higher 4e8, and MFU 2.5 is logged as measured, with a note, not clamped to 1.
    _cache(tmp_path, monkeypatch, 4e8)
    figures, note = perf_metrics(1e6, 1000.0, CPU, "fp32", probe=lambda precision: 2e8)
    assert figures[MFU] == 2.5
    assert note is not None
    assert re.search(r"perf/mfu=2.50 is above 1.*underestimate.*set trainer.peak_flops", note)
    assert _cached() == 4e8
    # A peak the user set is not probed: the note says to raise it.
    figures, note = perf_metrics(1e6, 1000.0, CPU, "fp32", override=5e8, probe=pytest.fail)
    assert figures[MFU] == 2.0
    assert note is not None and "over trainer.peak_flops=5e+08; raise trainer.peak_flops" in note


def test_mfu_is_achieved_over_peak() -> None:
    figures = mfu_metrics(2e6, 500.0, 4e9)
    assert figures == {
        FLOPS_PER_SAMPLE: 2e6,
        ACHIEVED_FLOPS: 1e9,
        PEAK_FLOPS: 4e9,
        MFU: 0.25,
    }
    assert MFU not in mfu_metrics(2e6, 500.0, None)  # an unknown GPU: no MFU


@pytest.mark.study
def test_trials_log_mfu_and_it_can_be_an_objective(prepare_study, stores) -> None:
    overrides = [
        *FAST,  # small_cnn(4) on digits, one epoch, on the CPU
        "trainer.peak_flops=2e11",  # a fixed peak: MFU = achieved / 2e11 exactly
        "search.trial_time_budget_s=null",
        "search.objectives=[perf/mfu,val/acc]",
        "search.n_trials=2",
        "search.study_name=mfu",
        "mlflow.system_metrics=false",
        "+search.params={trainer.batch_size:'choice(16,64)'}",
        *stores["overrides"],
    ]
    driver = prepare_study(overrides)
    driver.run()
    # The trials that trained (a proposal of a batch already trained is answered from its
    # record, a REPEAT, with the values of the trial it repeats).
    trained = [t for t in driver.study.get_trials() if not TrialRecord.of(t).is_repeat]
    assert len(trained) == 2
    for t in driver.study.get_trials():
        repeat_of = TrialRecord.of(t).repeat_of
        if repeat_of is not None:
            assert t.values == driver.study.trials[repeat_of].values
    for t in trained:
        figures = t.user_attrs[Attr.METRICS]
        achieved = figures[FLOPS_PER_SAMPLE] * figures[THROUGHPUT_SAMPLES]
        assert figures[ACHIEVED_FLOPS] == pytest.approx(achieved)
        assert figures[MFU] == pytest.approx(achieved / 2e11)
        assert t.values[0] == figures[MFU] > 0


@pytest.mark.study
def test_a_trial_whose_mfu_stays_above_one_says_why_in_mlflow(
    prepare_study, stores, tmp_path, monkeypatch
) -> None:
    # The cached peak is 1 FLOP/s and the probe, measured again, says 2: any real run
    # achieves more, so perf/mfu stays above 1, and the trial's run says why.
    _cache(tmp_path, monkeypatch, 1.0)
    monkeypatch.setattr(flops_module, "gemm_probe", lambda precision: 2.0)
    overrides = [
        *FAST,  # small_cnn(4) on digits, one epoch, on the CPU
        "search.trial_time_budget_s=null",
        "search.objectives=[val/acc]",
        "search.n_trials=1",
        "search.study_name=mfu-note",
        "mlflow.system_metrics=false",
        *stores["overrides"],
    ]
    driver = prepare_study(overrides, width=300)
    driver.run()
    (trial,) = driver.study.get_trials()
    run = MlflowClient(stores["mlflow"]).get_run(trial.user_attrs[Attr.RUN_ID])
    assert run.data.metrics[PEAK_FLOPS] == 2.0 == _cached()
    assert run.data.metrics[MFU] > 1
    note = run.data.tags["batchfit.mfu_note"]
    assert "is above 1" in note and "underestimate" in note
    assert trial.user_attrs[Attr.MFU_NOTE] == note
    assert "is above 1" in driver.console.export_text()
