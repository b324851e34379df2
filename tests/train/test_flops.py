"""Model FLOPs utilisation: FLOPs per sample counted on the predictor's fake model, the peak
from the GPU table or the cached CPU probe, and perf/* on a study's trials."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console
from torch import nn

from search.driver import StudyDriver
from train.flops import _cache_path, _machine_key, cpu_peak, cuda_peak, mfu_metrics
from train.predict import MemoryPredictor

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
    from train.tasks import LanguageModel
    from train.text import GPT

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


def test_mfu_is_achieved_over_peak() -> None:
    figures = mfu_metrics(2e6, 500.0, 4e9)
    assert figures == {
        "perf/flops_per_sample": 2e6,
        "perf/achieved_flops": 1e9,
        "perf/peak_flops": 4e9,
        "perf/mfu": 0.25,
    }
    assert "perf/mfu" not in mfu_metrics(2e6, 500.0, None)  # an unknown GPU: no MFU


def test_trials_log_mfu_and_it_can_be_an_objective(hydra_conf, stores) -> None:
    overrides = [
        "model=small_cnn",
        "model.width=4",
        "data=digits",
        "trainer.max_epochs=1",
        "trainer.device=cpu",
        "trainer.peak_flops=2e11",  # a fixed peak: MFU = achieved / 2e11 exactly
        "search.trial_time_budget_s=null",
        "search.objectives=[perf/mfu,val/acc]",
        "search.n_trials=2",
        "search.study_name=mfu",
        "mlflow.system_metrics=false",
        "+search.params={trainer.batch_size:'choice(16,64)'}",
        *stores["overrides"],
    ]
    cfg = hydra_conf(overrides)
    console = Console(record=True, width=200)
    driver = StudyDriver.prepare(cfg, overrides, {"model": "small_cnn", "data": "digits"}, console)
    driver.run()
    for t in driver.study.get_trials():
        figures = t.user_attrs["metrics"]
        achieved = figures["perf/flops_per_sample"] * figures["throughput/samples_per_sec"]
        assert figures["perf/achieved_flops"] == pytest.approx(achieved)
        assert figures["perf/mfu"] == pytest.approx(achieved / 2e11)
        assert t.values[0] == figures["perf/mfu"] > 0
