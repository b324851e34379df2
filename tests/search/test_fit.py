"""The fit report over the resnet experiments' real search spaces, with the small CNN in place
of ResNet-18 so that a report takes a second: every (precision, batch size, accumulation) of
the space is a row, tf32 is shown as not applicable on CPU with the reason, and each row
carries its effective batch size."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from optuna.distributions import CategoricalDistribution
from rich.console import Console

from search.fit import FitReport, fit_report, render
from search.validate import validate
from train.precision import unsupported_reason
from train.run import plan
from train.workload import Workloads

SMALL = [
    "model=small_cnn",
    "model.width=4",
    "data=digits",
    "trainer.device=cpu",
    "search.preflight_margin=0",  # the budget below is a predicted peak, exactly
]
# The spaces of conf/experiment/resnet.yaml and resnet_derived.yaml, as a user reads them.
BATCHES = [16, 32, 64, 128, 256, 512, 1024]
ACCUMS = [1, 2, 4]
EFFECTIVE = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
PRECISIONS = ["fp32", "tf32", "bf16", "fp16"]
TF32_ON_CPU = unsupported_reason("tf32", torch.device("cpu"))
KiB, MiB = 2**10, 2**20


def _peak(cfg, batch: int, accum: int, precision: str = "fp32") -> int:
    """The predictor's own answer for one geometry, asked directly."""
    spec = plan(cfg, cfg.search.memory_budget)
    trainer = dataclasses.replace(
        spec.trainer,
        batch_size=batch,
        accum_steps=accum,
        effective_batch_size=None,
        precision=precision,
    )
    workload = Workloads().of(cfg)
    predictor = workload.predictor(spec, cfg.optimizer)
    return predictor.predict(trainer, workload.num_train).peak_bytes


def _report(hydra_conf, overrides: list[str]) -> FitReport:
    cfg = hydra_conf(overrides)
    checked = validate(cfg, "fit", lambda extra: hydra_conf([*overrides, *extra]), False)
    return fit_report(cfg, checked.space, checked.spec, checked.settings)


def _text(report: FitReport) -> str:
    console = Console(record=True, width=200)
    console.print(render(report))
    return console.export_text()


@pytest.fixture
def searched(hydra_conf) -> tuple[FitReport, int]:
    """The resnet experiment's report under a budget of exactly the fp32 peak of batch 64
    without accumulation, and that budget."""
    base = hydra_conf(["+experiment=resnet", *SMALL])
    budget = _peak(base, 64, 1)
    # The premise: a second micro-batch runs over the first one's gradients, so batch 64
    # fits this budget without accumulation and does not fit with it.
    assert _peak(base, 64, 2) > budget
    report = _report(hydra_conf, ["+experiment=resnet", *SMALL, f"search.memory_budget={budget}"])
    return report, budget


def test_every_precision_batch_and_accumulation_is_a_row(searched) -> None:
    report, _ = searched
    rows = report.rows()
    keys = list(zip(rows["precision"], rows["batch_size"], rows["accum_steps"], strict=True))
    assert sorted(keys) == sorted(itertools.product(PRECISIONS, BATCHES, ACCUMS))
    assert len(set(len(column) for column in rows.values())) == 1


def test_every_row_carries_its_effective_batch_size(searched) -> None:
    rows = searched[0].rows()
    for batch, accum, effective in zip(
        rows["batch_size"], rows["accum_steps"], rows["effective_batch_size"], strict=True
    ):
        assert effective == batch * accum


def test_each_accumulation_is_predicted_for_itself(searched, hydra_conf) -> None:
    report, budget = searched
    cfg = hydra_conf(["+experiment=resnet", *SMALL])
    rows = report.rows()
    predicted = {
        (precision, batch, accum): (peak, fits)
        for precision, batch, accum, peak, fits in zip(
            rows["precision"],
            rows["batch_size"],
            rows["accum_steps"],
            rows["predicted_bytes"],
            rows["fits"],
            strict=True,
        )
    }
    for batch, accum in itertools.product((16, 64, 256), ACCUMS):
        peak = _peak(cfg, batch, accum)
        assert predicted["fp32", batch, accum] == (peak, peak <= budget)
    assert report.largest("fp32", 1) == 64
    assert report.largest("fp32", 2) == report.largest("fp32", 4) == 32


def test_the_table_shows_each_accumulation_and_its_largest_batch(searched) -> None:
    report, _ = searched
    lines = _text(report).splitlines()
    labels = [line.split("│")[1].strip() for line in lines if "│ accum_steps" in line]
    # accum 2 and 4 run the same first two micro-batches: one block of rows, said so
    assert labels == ["accum_steps 1", "accum_steps 2, 4: same peak"]
    largest = [
        [cell.strip() for cell in line.split("│")[2:-1]]
        for line in lines
        if "largest that fits" in line
    ]
    assert largest == [["64", "n/a", "64", "64"], ["32", "n/a", "64", "64"]]


def test_tf32_is_shown_not_applicable_on_cpu_with_its_reason(searched, hydra_conf) -> None:
    report, _ = searched
    assert TF32_ON_CPU is not None and "the device is cpu" in TF32_ON_CPU
    assert report.precisions == PRECISIONS
    assert report.unsupported == {"tf32": TF32_ON_CPU}
    rows = report.rows()
    tf32 = [i for i, precision in enumerate(rows["precision"]) if precision == "tf32"]
    assert len(tf32) == len(BATCHES) * len(ACCUMS)
    for i in tf32:
        assert rows["predicted_bytes"][i] is None and rows["fits"][i] is None
        assert rows["reason"][i] == TF32_ON_CPU
    text = _text(report)
    header = next(line for line in text.splitlines() if line.startswith("┃"))
    assert [cell.strip() for cell in header.split("┃")[2:-1]] == PRECISIONS
    assert f"n/a: {TF32_ON_CPU}" in " ".join(text.split())
    # Validation is unchanged: trials still never sample tf32 on this device.
    cfg = hydra_conf(["+experiment=resnet", *SMALL])
    checked = validate(cfg, "fit", lambda overrides: None, open_store=False)
    dist = checked.space.distributions["trainer.precision"]
    assert isinstance(dist, CategoricalDistribution) and "tf32" not in dist.choices


def test_the_derived_report_shows_each_effective_batch_and_tf32(hydra_conf) -> None:
    report = _report(
        hydra_conf, ["+experiment=resnet_derived", *SMALL, "search.memory_budget=1MiB"]
    )
    rows = report.rows()
    keys = list(zip(rows["precision"], rows["effective_batch_size"], strict=True))
    assert sorted(keys) == sorted(itertools.product(PRECISIONS, EFFECTIVE))
    for precision, batch, accum, effective, fits in zip(
        rows["precision"],
        rows["batch_size"],
        rows["accum_steps"],
        rows["effective_batch_size"],
        rows["fits"],
        strict=True,
    ):
        if precision == "tf32":
            assert fits is None and batch is None and accum is None
        elif fits:
            assert batch * accum == effective
    # small_cnn(width=4) peaks at ~0.66 MB at batch 64 (test_preflight): within 1 MiB, so
    # even 4096 trains, accumulating micro-batches of 64 or more.
    assert report.largest("fp32") == 4096
    text = _text(report)
    assert "accum_steps" not in text and f"n/a: {TF32_ON_CPU}" in " ".join(text.split())


def test_other_searched_keys_are_named_at_the_value_the_report_holds(hydra_conf) -> None:
    # The gpt experiment also searches data.seq_len, which the memory follows: the report is
    # for the configured sequence length, and says so; the lr (no memory) is not named.
    overrides = ["+experiment=gpt", "data.max_bytes=20000", "data.seq_len=64"]
    report = _report(hydra_conf, overrides)
    assert report.held == {"data.seq_len": 64}
    assert "at data.seq_len=64, as configured" in _text(report)
    assert _report(hydra_conf, ["+experiment=resnet", *SMALL]).held == {}


def test_a_report_for_a_gpu_this_machine_lacks_is_in_cuda_reserved_bytes(hydra_conf) -> None:
    """search.gpu on this CPU-only machine: every cell is the smallest per-process limit the
    caching-allocator model runs the step in (2 MiB segments, two cuBLAS workspaces of
    8.1 MiB on an A100), above the CPU's live-tensor peak of the same step."""
    a100 = _report(hydra_conf, [*SMALL, "search.gpu=A100-40GB"])
    cpu = _report(hydra_conf, SMALL)
    assert a100.device == "A100-40GB (39.4 GiB, CUDA reserve, planned: not on this machine)"
    assert cpu.device == "cpu"
    assert "tf32" not in a100.unsupported  # an Ampere card runs it
    for key, cell in a100.cells.items():
        assert cell.peak_bytes % (2 * MiB) == 0, key
        if cpu.cells[key].peak_bytes is not None:  # tf32: not on a CPU
            assert cell.peak_bytes >= cpu.cells[key].peak_bytes + 2 * 8320 * KiB, key
    precisions = '++search.params={trainer.precision:"choice(fp32,tf32,bf16)"}'
    v100 = _report(hydra_conf, [*SMALL, "search.gpu=V100-16GB", precisions])
    assert set(v100.unsupported) == {"tf32", "bf16"}
    assert "compute capability >= 8.0, V100-16GB has 7.x" in v100.unsupported["bf16"]
