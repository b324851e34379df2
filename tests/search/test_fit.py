"""The fit report over the resnet experiments' real search spaces, with the small CNN in place
of ResNet-18 so that a report takes a second: every (precision, batch size, accumulation) of
the space is a row, tf32 is shown as not applicable on CPU with the reason, and each row
carries its effective batch size."""

from __future__ import annotations

import dataclasses
import io
import itertools
import time

import pytest
import torch
from optuna.distributions import CategoricalDistribution
from rich.console import Console

from batchfit.common.checks import ConfigError
from batchfit.search.fit.layouts import MAX_LAYOUTS, fit_reports, layouts, show_fit_reports
from batchfit.search.fit.render import notes, render
from batchfit.search.fit.report import Cell, FitReport
from batchfit.search.fit.tabulate import fit_report
from batchfit.search.study.driver import StudyDriver
from batchfit.search.study.validate import validate
from batchfit.train.device.gpus import GPUS, gpu
from batchfit.train.memory.preflight import Margin
from batchfit.train.memory.reserve import predict_reserved
from batchfit.train.plan import plan, with_gpu_budget
from batchfit.train.precision import unsupported_reason
from batchfit.train.workload import Workloads

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
KiB, MiB, GiB = 2**10, 2**20, 2**30


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
    """The table and the lines under it, as show_fit_reports prints them."""
    console = Console(record=True, width=200)
    console.print(render(report))
    for line in notes(report):
        console.print(line, soft_wrap=True)
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
    compose = lambda extra: hydra_conf(["+experiment=resnet", *SMALL, *extra])  # noqa: E731
    checked = validate(cfg, "fit", compose, open_store=False)
    dist = checked.space.distributions["trainer.precision"]
    assert isinstance(dist, CategoricalDistribution) and "tf32" not in dist.choices


def test_the_derived_report_shows_each_effective_batch_and_tf32(hydra_conf) -> None:
    report = _report(
        hydra_conf, ["+experiment=resnet_derived", *SMALL, "search.memory_budget=1MiB"]
    )
    rows = report.rows()
    keys = list(zip(rows["precision"], rows["effective_batch_size"], strict=True))
    # digits' 1438 training samples: 2048 and 4096 are dropped from the space before trial 0
    # (search/study/within_data.py), and the report is of the space as searched
    within = [e for e in EFFECTIVE if e <= 1438]
    assert sorted(keys) == sorted(itertools.product(PRECISIONS, within))
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
    # even the largest effective batch the data holds trains, accumulating micro-batches.
    assert report.largest("fp32") == 1024
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


def test_a_cuda_report_fits_without_cudnn_workspaces_and_says_what_they_count_at(
    hydra_conf, monkeypatch
) -> None:
    """The small CNN's convolutions on a card this machine lacks: what fits counts no
    workspace (PyTorch runs a cuDNN engine that needs less where one does not fit), so the
    cap changes no cell; the report says what a workspace is counted at: the cap
    (cudnn_workspace_mib, 64 MiB by default) with room, or, with no cap, none."""
    monkeypatch.delenv("CUDNN_CONV_WSCAP_DBG", raising=False)  # a shell's own cap would win
    capped = _report(hydra_conf, [*SMALL, "search.gpu=A100-40GB"])
    uncapped = _report(hydra_conf, [*SMALL, "search.gpu=A100-40GB", "cudnn_workspace_mib=null"])
    assert (capped.workspaces, capped.workspace_cap_bytes) == ("cap", 64 * MiB)
    assert (uncapped.workspaces, uncapped.workspace_cap_bytes) == ("none", None)
    assert {k: c.peak_bytes for k, c in capped.cells.items()} == {
        k: c.peak_bytes for k, c in uncapped.cells.items()
    }
    assert (
        "cuDNN convolutions: what fits counts no workspace (where one does not fit, PyTorch "
        "runs a cuDNN engine that needs less); with room, each call's workspace counted at "
        "the 64.0 MiB cap batchfit sets for cuDNN (cudnn_workspace_mib)"
    ) in " ".join(_text(capped).split())
    assert "with room, none counted (no cap: cudnn_workspace_mib=null)" in " ".join(
        _text(uncapped).split()
    )


def test_each_cell_of_a_cuda_report_is_replayed_once_under_the_runs_limit(
    hydra_conf, monkeypatch
) -> None:
    """The allocator's replays are most of a CUDA report's time: each distinct step (micro-
    batches, precision) goes through them once, under the run's limit; the cells that share
    a step (accumulation 2 and 4: two micro-batches either way) share its prediction."""
    calls: list[int | None] = []

    def counted(events, settings, workspaces, limit_bytes):  # noqa: ANN001, ANN202
        calls.append(limit_bytes)
        return predict_reserved(events, settings, workspaces, limit_bytes)

    monkeypatch.setattr("batchfit.train.memory.predict.predict_reserved", counted)
    report = _report(hydra_conf, ["+experiment=resnet", *SMALL, "search.gpu=A100-40GB"])
    steps = {(p, b, min(a, 2)) for p, b, a in report.cells if p not in report.unsupported}
    assert set(report.accum_steps) > {1, 2}  # the premise: some cells share a step
    assert len(calls) == len(steps)
    assert set(calls) == {report.limit_bytes}


# An 8B model planned for an H100 from this CPU-only machine: bf16 weights, 1024 tokens,
# micro-batches 1 and 2, checkpointing off and on; the full report over the experiments'
# spaces is docs/language-models.md's (minutes: 6 layouts x 24 cells).
def _llama3_8b(experiment: str) -> list[str]:
    return [
        f"+experiment={experiment}", "model.config=llama3_8b", "model.dtype=bfloat16",
        "search.gpu=H100-80GB", "data.max_bytes=40000",
        '++search.params={trainer.batch_size:"choice(1,2)",trainer.accum_steps:"choice(1)",'
        'trainer.precision:"choice(bf16)",data.seq_len:"choice(1024)",'
        'trainer.activation_checkpointing:"choice(none,blocks)",model.lora.r:null}',
    ]  # fmt: skip


def _reports(hydra_conf, overrides: list[str]) -> list[FitReport]:
    cfg = hydra_conf(overrides)
    checked = validate(cfg, "fit", lambda extra: hydra_conf([*overrides, *extra]), False)
    return fit_reports(cfg, checked.space, checked.spec, checked.settings)


def test_8b_fit_reports_for_lora_and_full_fine_tuning(hydra_conf) -> None:
    """What fits an H100 for Llama-3-8B (8.03B parameters, bf16 weights). With LoRA: the
    frozen weights (2 bytes each) and the activations, which checkpointing cuts. Fully
    fine-tuned with AdamW: weights, gradients (2 bytes each), two moments (4) and, while the
    foreach step runs, a parameter-sized set of its intermediates (2): over 10 bytes per
    parameter, whatever the batch."""
    params = 8_030_261_248
    lora = {r.checkpointing: r for r in _reports(hydra_conf, _llama3_8b("llm_lora"))}
    full = {r.checkpointing: r for r in _reports(hydra_conf, _llama3_8b("llm_full"))}
    for reports in (lora, full):
        assert set(reports) == {"none", "blocks"}
        for report in reports.values():
            assert report.device.startswith("H100-80GB") and report.at == {"data.seq_len": 1024}
            assert list(report.cells) == [("bf16", 1, 1), ("bf16", 2, 1)]
    peak = {
        (name, mode, b): reports[mode].cells["bf16", b, 1].peak_bytes
        for name, reports in (("lora", lora), ("full", full))
        for mode in ("none", "blocks")
        for b in (1, 2)
    }
    for mode in ("none", "blocks"):
        assert 2 * params < peak["lora", mode, 1] < peak["lora", mode, 2] < 40 * GiB, peak
        assert 10 * params < peak["full", mode, 1] <= peak["full", mode, 2] < 80 * GiB, peak
        assert peak["full", mode, 2] - peak["full", mode, 1] < 2 * GiB, peak  # the optimizer's
    for b in (1, 2):  # one layer's activations kept instead of 32
        assert peak["lora", "blocks", b] < peak["lora", "none", b] - (b + 4) * GiB, peak
    assert all(cell.fits for report in lora.values() for cell in report.cells.values())


def test_a_fit_report_per_rank_of_a_data_parallel_layout(hydra_conf) -> None:
    """Full fine-tuning of the tiny Llama on 8 H100s with FSDP, and the strategy searched:
    a report per strategy, each cell one rank's step as the trial's predictor predicts it,
    FSDP's below DDP's (its parameters, gradients and moments are sharded 8 ways)."""
    overrides = [
        "+experiment=llm_full", "data.max_bytes=40000", "search.gpu=H100-80GB",
        "trainer.devices=8", "trainer.strategy=fsdp",
        '++search.params={trainer.batch_size:"choice(1,4)",trainer.accum_steps:"choice(1)",'
        'trainer.precision:"choice(bf16)",data.seq_len:"choice(128)",'
        'trainer.activation_checkpointing:"choice(none)",trainer.strategy:"choice(ddp,fsdp)",'
        "model.lora.r:null}",
    ]  # fmt: skip
    reports = {r.strategy: r for r in _reports(hydra_conf, overrides)}
    assert set(reports) == {"ddp", "fsdp"}
    predictions = {}
    for strategy, report in reports.items():
        assert report.world_size == 8
        assert report.rows()["strategy"] == [strategy, strategy]
        title = str(render(report).title)
        assert f"one rank of {strategy} on 8 x H100-80GB" in title and "per rank" in title
        cfg = hydra_conf([*overrides, f"trainer.strategy={strategy}", "trainer.batch_size=4",
                          "data.seq_len=128", "trainer.precision=bf16"])  # fmt: skip
        spec = plan(cfg, None)
        predictions[strategy] = Workloads().of(cfg).predict(spec, cfg.optimizer)
        assert report.cells["bf16", 4, 1].peak_bytes == predictions[strategy].peak_bytes
    for b in (1, 4):  # the tiny model's reserve is mostly the allocator's fixed blocks
        fsdp, ddp = (reports[s].cells["bf16", b, 1].peak_bytes for s in ("fsdp", "ddp"))
        assert fsdp <= ddp
    assert predictions["fsdp"].tensor_bytes < predictions["ddp"].tensor_bytes


def test_layouts_beyond_the_limit_hold_the_space_last_keys(hydra_conf) -> None:
    """llm_lora searches checkpointing (2), seq_len (3) and the LoRA rank (3): 18
    combinations, over MAX_LAYOUTS; the rank, listed last, is held at its configured 8."""
    overrides = ["+experiment=llm_lora", "data.max_bytes=40000"]
    cfg = hydra_conf(overrides)
    checked = validate(cfg, "fit", lambda extra: hydra_conf([*overrides, *extra]), False)
    found = layouts(cfg, checked.space, checked.spec)
    assert len(found) == 6 <= MAX_LAYOUTS
    assert {(d["trainer.activation_checkpointing"], d["data.seq_len"]) for d in found} == set(
        itertools.product(["none", "blocks"], [128, 256, 512])
    )
    assert all("model.lora.r" not in d for d in found)


# ---- the budget of a named card -------------------------------------------------------------

GPT_SMALL = [
    "+experiment=gpt", "data.max_bytes=40000",
    '++search.params={trainer.batch_size:"choice(8,128)",trainer.accum_steps:"choice(1)",'
    'trainer.precision:"choice(fp32)",data.seq_len:"choice(64)"}',
]  # fmt: skip


def _planned(hydra_conf, overrides: list[str]) -> tuple[FitReport, list[str]]:
    """The report `python -m search.fit OVERRIDES` prints, with the overrides its study's
    trials compose from (the card's budget applied as the entry points apply it)."""
    cfg = hydra_conf(overrides)
    base = with_gpu_budget(cfg, overrides)
    checked = validate(cfg, "fit", lambda extra: hydra_conf([*base, *extra]), False)
    return fit_report(cfg, checked.space, checked.spec, checked.settings), base


def test_a_named_card_is_the_budget_whatever_the_experiment_says(hydra_conf) -> None:
    """gpt sets search.memory_budget=160MiB, a small simulated device; search.gpu=A100-40GB
    on the command line plans for what the card offers a process instead (conf/search/
    default.yaml search.gpu_budget=usable: its 42,298,834,944 bytes less the 512 MiB CUDA
    context, train/device/gpus.py), so the batch the 160 MiB refused fits the card. The
    GPT trains every weight, a kind of step no GPU has measured: the margin stays 5%."""
    a100 = gpu("A100-40GB")
    report, base = _planned(hydra_conf, [*GPT_SMALL, "search.gpu=A100-40GB"])
    usable = 42_298_834_944 - 512 * MiB
    assert report.budget_bytes == report.limit_bytes == a100.usable_bytes == usable
    assert report.budget_source == "A100-40GB's 39.4 GiB less 512.0 MiB CUDA context"
    title = " ".join(str(render(report).title).split())
    assert (
        "budget 38.9 GiB (A100-40GB's 39.4 GiB less 512.0 MiB CUDA context), margin 5% "
        "(full fine-tuning steps: not measured on a GPU)" in title
    ), title
    big = report.cells["fp32", 128, 1]
    assert 160 * MiB < big.peak_bytes * 1.05 and big.fits  # refused by the demo budget
    # A trial, and a rerun, compose the same budget from the command line's overrides.
    assert base[-1] == "search.memory_budget=usable"
    trial = hydra_conf([*base, "trainer.batch_size=128"])
    assert plan(trial, trial.search.memory_budget).budget_bytes == report.budget_bytes
    # Without the card, the experiment's own budget stands.
    demo, _ = _planned(hydra_conf, GPT_SMALL)
    assert demo.budget_bytes == 160 * MiB and demo.budget_source == "search.memory_budget"
    assert "budget 160.0 MiB (search.memory_budget)" in " ".join(str(render(demo).title).split())


@pytest.mark.parametrize(
    ("budget", "expected", "source"),
    [
        ("20GiB", 20 * GiB, "search.memory_budget"),
        ("50%", int(gpu("A100-40GB").total_bytes * 0.5), "50% of A100-40GB"),
        ("null", None, "all of A100-40GB"),
        ("usable", 42_298_834_944 - 512 * MiB, "A100-40GB's 39.4 GiB less 512.0 MiB CUDA context"),
    ],
)
def test_a_budget_on_the_command_line_wins(hydra_conf, budget, expected, source) -> None:
    report, base = _planned(
        hydra_conf, [*GPT_SMALL, "search.gpu=A100-40GB", f"search.memory_budget={budget}"]
    )
    assert report.budget_bytes == expected and report.budget_source == source
    assert report.limit_bytes == (expected or gpu("A100-40GB").total_bytes)
    assert base == [*GPT_SMALL, "search.gpu=A100-40GB", f"search.memory_budget={budget}"]


def test_the_share_of_a_named_card_is_a_setting(hydra_conf) -> None:
    """search.gpu_budget=90% is what the default meant before it became `usable`."""
    report, _ = _planned(hydra_conf, [*GPT_SMALL, "search.gpu=A100-40GB", "search.gpu_budget=80%"])
    assert report.budget_bytes == int(gpu("A100-40GB").total_bytes * 0.8)
    assert report.budget_source == "80% of A100-40GB"
    cfg = hydra_conf([*GPT_SMALL, "search.gpu=A100-40GB", "search.gpu_budget=20GiB"])
    with pytest.raises(ConfigError, match=r"search.gpu_budget must be usable \(the card less "
                       r"its CUDA context\) or a share of the card .*got '20GiB'; override with "
                       r"search.gpu_budget=usable or search.gpu_budget=90%"):  # fmt: skip
        with_gpu_budget(cfg, [*GPT_SMALL, "search.gpu=A100-40GB", "search.gpu_budget=20GiB"])


def test_a_card_named_by_the_experiment_keeps_its_budget(hydra_conf) -> None:
    """The 90% applies to a card named on the command line: an experiment that names its
    card (here, as if search.gpu came from its YAML) sets the budget it means for it."""
    cfg = hydra_conf([*GPT_SMALL, "search.gpu=A100-40GB"])
    assert with_gpu_budget(cfg, GPT_SMALL) == GPT_SMALL
    assert cfg.search.memory_budget == "160MiB"


def test_a_study_planned_for_a_card_reports_its_budget(hydra_conf, stores) -> None:
    """python -m search ... search.gpu=A100-40GB on this CPU-only machine: the fit report
    against the card's budget, then the stop before anything is recorded."""
    overrides = [*GPT_SMALL, *stores["overrides"], "search.gpu=A100-40GB"]
    console = Console(record=True, width=200)
    with pytest.raises(ConfigError, match="search.gpu=A100-40GB plans for a GPU this machine"):
        StudyDriver.prepare(hydra_conf(overrides), overrides, {}, console)
    text = " ".join(console.export_text().split())
    budget = "38.9 GiB (A100-40GB's 39.4 GiB less 512.0 MiB CUDA context)"
    assert f"budget {budget}, margin 5% (full fine-tuning steps: not measured" in text
    assert "(OOM)" not in text


def test_what_a_card_offers_a_process_is_its_memory_less_the_cuda_context() -> None:
    """usable_bytes: what torch.cuda.mem_get_info() reports free in a fresh process. The
    A100-40GB's total is CUDA's (deviceQuery), less the 512 MiB context; the H100-80GB's is
    nvidia-smi's 81,559 MiB, and CUDA reports 79.22 GiB of it (vLLM's log), less the same
    context; the L4's vendor 24 GiB is 23,034 MiB in NVML."""
    assert gpu("A100-40GB").usable_bytes == 42_298_834_944 - 512 * MiB
    assert gpu("H100-80GB").usable_bytes == 81_121 * MiB - 512 * MiB  # 79.22 GiB = 81,121 MiB
    assert gpu("L4").usable_bytes == 23_034 * MiB - 512 * MiB
    assert all(0 < card.context_bytes < 4 * GiB for card in GPUS)


def test_the_margin_follows_the_measured_error_of_the_kind_of_step(hydra_conf) -> None:
    """search.preflight_margin=null (the default): 1% for a language-model LoRA step on a
    CUDA card (measured within 0.71% on an H200); 5% for a step with convolutions, for
    kinds no GPU measured (full fine-tuning), for a space whose trials are of several
    kinds (model.quantization searched), and on CPU; a margin given wins."""
    one = '++search.params={trainer.batch_size:"choice(1)",data.seq_len:"choice(64)"}'
    lora = ["+experiment=llm_lora", "data.max_bytes=40000", one]
    cases = [
        ([*lora, "search.gpu=A100-40GB"], 0.01,
         "language-model LoRA steps measured within 0.71% on an H200"),
        ([*lora, "trainer.device=cpu"], 0.05, ""),
        ([*lora, "search.gpu=A100-40GB", "search.preflight_margin=0.02"], 0.02,
         "search.preflight_margin"),
        (["+experiment=llm_full", "data.max_bytes=40000", one, "search.gpu=A100-40GB"], 0.05,
         "full fine-tuning steps: not measured on a GPU"),
        (["+experiment=llm_lora", "data.max_bytes=40000", "search.gpu=A100-40GB",
          '++search.params={trainer.batch_size:"choice(1)",model.quantization:"choice(none,nf4)"}'],
         0.05, "the space searches model.quantization: not all its steps were measured"),
        (["+experiment=resnet", "model=small_cnn", "model.width=4", "data=digits",
          "search.gpu=A100-40GB"], 0.05,
         "steps with convolutions: not measured within it on a GPU"),
    ]  # fmt: skip
    for overrides, value, why in cases:
        cfg = hydra_conf(overrides)
        checked = validate(cfg, "fit", lambda extra, o=overrides: hydra_conf([*o, *extra]), False)
        assert (checked.settings.preflight_margin, checked.settings.margin_why) == (value, why)
        assert checked.settings.margin == Margin(value, why)


# Llama 2 13B with LoRA over bf16 weights at 1024 tokens on an A100-40GB, without
# checkpointing, accumulating 8 micro-batches: what a team trains at batch 1 and runs out of
# memory at batch 4. 90% of the card with a 5% margin refused batch 1.
LLAMA2_13B = [
    "+experiment=llm_lora", "model.config=llama2_13b", "model.dtype=bfloat16",
    "search.gpu=A100-40GB", "data.max_bytes=40000", "data.seq_len=1024",
    '++search.params={trainer.batch_size:"choice(1,4)",trainer.accum_steps:"choice(8)",'
    'trainer.precision:"choice(bf16)",data.seq_len:"choice(1024)",'
    'trainer.activation_checkpointing:"choice(none)",model.lora.r:null}',
]  # fmt: skip


def test_13b_lora_fits_an_a100_at_batch_1_and_not_at_4(hydra_conf) -> None:
    """The budget is what the A100-40GB offers a process (39.4 GiB less its 512 MiB CUDA
    context) and the margin the measured error of a language-model LoRA step (1%); the
    title says both and why."""
    report, _ = _planned(hydra_conf, LLAMA2_13B)
    assert list(report.cells) == [("bf16", 1, 8), ("bf16", 4, 8)]
    assert report.held == {"data.seq_len": 1024}
    one, four = (report.cells["bf16", b, 8] for b in (1, 4))
    weights = 2 * 13_015_864_320  # bf16, frozen: LoRA's base
    usable = 42_298_834_944 - 512 * MiB
    assert weights < one.peak_bytes and one.peak_bytes * 1.01 <= usable and one.fits
    assert four.peak_bytes * 1.01 > usable and not four.fits
    assert report.largest("bf16", 8) == 1
    # What refused batch 1 before: 90% of the card with 5% to spare
    assert one.peak_bytes * 1.05 > int(42_298_834_944 * 0.9)
    title = " ".join(str(render(report).title).split())
    assert (
        "budget 38.9 GiB (A100-40GB's 39.4 GiB less 512.0 MiB CUDA context), margin 1% "
        "(language-model LoRA steps measured within 0.71% on an H200)" in title
    ), title


# ---- each table as soon as it is done -------------------------------------------------------

GPT_TABLES = [
    "+experiment=gpt", "data.max_bytes=40000",
    '++search.params={trainer.batch_size:"choice(8,16)",trainer.accum_steps:"choice(1)",'
    'trainer.precision:"choice(fp32)",data.seq_len:"choice(64,128,256)"}',
]  # fmt: skip


def test_each_table_is_handed_over_before_the_next_is_predicted(hydra_conf) -> None:
    """on_report(report, number, total) runs as each report is done: between two calls
    lies the next table's prediction (its own `seconds`), not nothing."""
    cfg = hydra_conf(GPT_TABLES)
    checked = validate(cfg, "fit", lambda extra: hydra_conf([*GPT_TABLES, *extra]), False)
    calls = []
    reports = fit_reports(
        cfg,
        checked.space,
        checked.spec,
        checked.settings,
        on_report=lambda report, number, total: calls.append(
            (report, number, total, time.perf_counter())
        ),
    )
    assert [(r, n, t) for r, n, t, _ in calls] == [(r, i, 3) for i, r in enumerate(reports, 1)]
    assert [r.at for r in reports] == [{"data.seq_len": n} for n in (64, 128, 256)]
    for (_, _, _, before), (report, _, _, after) in itertools.pairwise(calls):
        assert after - before >= report.seconds > 0


def test_off_a_terminal_each_table_is_followed_by_a_line(hydra_conf) -> None:
    cfg = hydra_conf(GPT_TABLES)
    checked = validate(cfg, "fit", lambda extra: hydra_conf([*GPT_TABLES, *extra]), False)
    console = Console(record=True, width=200, file=io.StringIO())
    assert not console.is_terminal
    reports = show_fit_reports(console, cfg, checked.space, checked.spec, checked.settings)
    lines = console.export_text().splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("fit report: table")]
    assert [lines[i] for i in said] == [
        f"fit report: table {n}/3 (data.seq_len={r.at['data.seq_len']}) in {r.seconds:.1f} s"
        for n, r in enumerate(reports, 1)
    ]
    titles = [i for i, line in enumerate(lines) if "Fit report for cpu" in line]
    assert len(titles) == 3 and titles[0] < said[0] < titles[1] < said[1] < titles[2] < said[2]


def test_on_a_terminal_the_tables_print_above_a_progress_bar(hydra_conf) -> None:
    cfg = hydra_conf(GPT_TABLES)
    checked = validate(cfg, "fit", lambda extra: hydra_conf([*GPT_TABLES, *extra]), False)
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    reports = show_fit_reports(console, cfg, checked.space, checked.spec, checked.settings)
    text = out.getvalue()
    assert len(reports) == 3 and text.count("Fit report for cpu") == 3
    assert "fit report: table" not in text  # the bar says it: "fit report ━━ 1/3 tables"
    assert "1/3" in text and "3/3" in text and "tables" in text


# ---- cells a user can act on ----------------------------------------------------------------


def _hand_built(peaks: dict[int, int | None], budget: int) -> FitReport:
    """A one-column report over `peaks` (batch -> peak; None: cannot train)."""
    report = FitReport(budget, 0.0, False, ["fp32"], {}, sorted(peaks), [1], cuda=True)
    report.limit_bytes, report.budget_source = budget, "search.memory_budget"
    for batch, peak in peaks.items():
        reason = None if peak is not None else "BatchNorm cannot train on one sample"
        fits = peak is not None and peak <= budget
        report.cells["fp32", batch, 1] = Cell(batch, batch, 1, peak, fits, reason)
    return report


def test_largest_that_fits_has_every_smaller_batch_fitting() -> None:
    report = _hand_built({1: None, 2: 50, 4: 99, 8: 120, 16: 90, 32: 200}, budget=100)
    assert report.largest("fp32", 1) == 4  # not 16: 8 does not fit
    assert report.placement_only("fp32", 1) == (16, 8)
    assert [b for b in report.batch_sizes if report.marked("fp32", b, 1)] == [16]
    text = " ".join(_text(report).split())
    assert "90 B†" in text
    assert (
        "†: fits only through the caching allocator's block placement; a smaller batch does "
        "not fit (fp32, accum_steps 1: 16 fits, 8 needs 120 B), so 'largest that fits' stops "
        "below it" in text
    )
    monotonic = _hand_built({1: None, 2: 50, 4: 99, 8: 120, 16: 130, 32: 200}, budget=100)
    assert monotonic.largest("fp32", 1) == 4 and monotonic.placement_only("fp32", 1) is None
    assert "†" not in _text(monotonic)


# A GPT 1024 wide planned for an A100 at 64 tokens: its steps are a few hundred MiB, mostly
# weights and AdamW's state, and the caching allocator's blocks decide the last MiBs: a
# larger batch can need less, bf16 more than fp32, checkpointing more than none.
GPT_WIDE = [
    "+experiment=gpt", "data.max_bytes=40000", "model.n_embd=1024", "search.gpu=A100-40GB",
    "search.preflight_margin=0",
    '++search.params={trainer.batch_size:"choice(1,2,4,8,16,32)",trainer.accum_steps:"choice(1)",'
    'trainer.precision:"choice(fp32,bf16)",data.seq_len:"choice(64)",'
    'trainer.activation_checkpointing:"choice(none,blocks)"}',
]  # fmt: skip
WIDE_BATCHES = [1, 2, 4, 8, 16, 32]


def test_marks_and_notes_of_a_real_report(hydra_conf) -> None:
    """Every mark and note is checked against the predictor asked directly, cell by cell."""
    peak = {}
    for mode in ("none", "blocks"):
        cfg = hydra_conf([*GPT_WIDE, "data.seq_len=64", f"trainer.activation_checkpointing={mode}"])
        spec = plan(cfg, None)
        workload = Workloads().of(cfg)
        predictor = workload.predictor(spec, cfg.optimizer)
        for p, b in itertools.product(("fp32", "bf16"), WIDE_BATCHES):
            trainer = dataclasses.replace(
                spec.trainer, batch_size=b, accum_steps=1, effective_batch_size=None, precision=p
            )
            peak[mode, p, b] = predictor.predict(trainer, workload.num_train).peak_bytes
    # The budget: a batch's peak below a smaller batch's (the premise: one exists)
    dips = [
        (p, small, b)
        for p in ("fp32", "bf16")
        for i, b in enumerate(WIDE_BATCHES)
        for small in WIDE_BATCHES[:i]
        if peak["none", p, b] < peak["none", p, small]
    ]
    assert dips, peak
    precision, _, batch = dips[0]
    budget = peak["none", precision, batch]
    overrides = [*GPT_WIDE, f"search.memory_budget={budget}"]
    reports = {r.checkpointing: r for r in _reports(hydra_conf, overrides)}
    none, blocks = reports["none"], reports["blocks"]
    for mode, report in reports.items():
        for p in ("fp32", "bf16"):
            fits = [peak[mode, p, b] <= budget for b in WIDE_BATCHES]
            prefix = list(itertools.takewhile(bool, fits))
            assert report.largest(p, 1) == (WIDE_BATCHES[len(prefix) - 1] if prefix else None)
            first_miss = fits.index(False) if False in fits else len(fits)
            daggers = [b for b, f in zip(WIDE_BATCHES, fits, strict=True) if f][len(prefix) :]
            assert [b for b in WIDE_BATCHES if "†" in report.marked(p, b, 1)] == daggers
            assert all(WIDE_BATCHES.index(b) > first_miss for b in daggers)
    assert "†" in none.marked(precision, batch, 1)
    text = " ".join(_text(none).split())
    assert "†: fits only through the caching allocator's block placement" in text
    # ‡: checkpointing above no checkpointing, cell by cell
    for p in ("fp32", "bf16"):
        for b in WIDE_BATCHES:
            more = peak["blocks", p, b] > peak["none", p, b]
            assert ("‡" in blocks.marked(p, b, 1)) == more, (p, b)
            assert "‡" not in none.marked(p, b, 1)
    assert any("‡" in blocks.marked(p, b, 1) for p in ("fp32", "bf16") for b in WIDE_BATCHES)
    assert "‡: needs more with activation checkpointing than without" in " ".join(
        _text(blocks).split()
    )
    # bf16 over fp32: the batches where the predictor says so, and why
    over = [b for b in WIDE_BATCHES if peak["none", "bf16", b] > peak["none", "fp32", b]]
    assert over and [b for b, _ in none.bf16_over_fp32()] == over
    assert (
        f"bf16 needs more than fp32 at batch {', '.join(map(str, over))} (accum_steps 1): "
        "autocast keeps the fp32 weights and adds bf16 copies of the weights each layer uses "
        "(kept for the backward pass), so bf16 autocast over fp32 weights needs more; this "
        "model has no model.dtype" in text
    )


# A Llama 1024 wide, 4 layers (56M parameters), LoRA over float32 weights on an A100: the
# bf16 copies of its frozen weights are ~105 MiB, more than bf16 saves of its activations.
LLAMA_MID = [
    "+experiment=llm_lora", "data.max_bytes=40000", "search.gpu=A100-40GB",
    "model.config={model_type:llama,hidden_size:1024,num_hidden_layers:4,num_attention_heads:8,"
    "num_key_value_heads:2,intermediate_size:3584,vocab_size:null,max_position_embeddings:2048}",
    '++search.params={trainer.batch_size:"choice(1)",trainer.accum_steps:"choice(1)",'
    'trainer.precision:"choice(fp32,bf16)",data.seq_len:"choice(128)",'
    'trainer.activation_checkpointing:"choice(none)",model.lora.r:null}',
]  # fmt: skip


def test_bf16_over_float32_weights_is_explained_and_the_fix_holds(hydra_conf) -> None:
    (fp32_weights,) = _reports(hydra_conf, LLAMA_MID)
    fp32, bf16 = (fp32_weights.cells[p, 1, 1].peak_bytes for p in ("fp32", "bf16"))
    assert bf16 > fp32 and fp32_weights.bf16_over_fp32() == [(1, 1)]
    text = " ".join(_text(fp32_weights).split())
    assert (
        "bf16 needs more than fp32 at batch 1 (accum_steps 1): autocast keeps the fp32 weights"
        in text
        and "load the base in bfloat16 (model.dtype=bfloat16) to halve the weights" in text
    )
    # Following it: bf16 weights need less than fp32 autocast over fp32 weights did.
    (bf16_weights,) = _reports(hydra_conf, [*LLAMA_MID, "model.dtype=bfloat16"])
    assert bf16_weights.cells["bf16", 1, 1].peak_bytes < fp32
    assert "bf16 needs more than fp32" not in _text(bf16_weights)


def test_8b_qlora_fits_a_24gb_card_at_2048_tokens(hydra_conf) -> None:
    """ "Does Llama-3-8B QLoRA at 2048 tokens fit my 24 GB card, and at what batch?" Its
    linear layers (6.98B parameters) in NF4 with double quantization take 0.516 bytes a
    parameter; the embeddings and head (2 x 525M) stay in 16 bits, cast to fp32 by peft's
    preparation. With checkpointing batch 1 and 2 fit an RTX 4090; the same LoRA over bf16
    weights (14 GB of linear layers alone) needs over 5 GiB more at each batch, and batch
    2 does not fit."""
    overrides = [
        "+experiment=llm_qlora", "model.config=llama3_8b", "model.dtype=bfloat16",
        "search.gpu=RTX-4090", "data.max_bytes=40000",
        '++search.params={trainer.batch_size:"choice(1,2)",trainer.accum_steps:"choice(1)",'
        'trainer.precision:"choice(bf16)",data.seq_len:"choice(2048)",'
        'trainer.activation_checkpointing:"choice(blocks)",model.lora.r:null,'
        'model.quantization:"choice(none,nf4)"}',
    ]  # fmt: skip
    reports = {r.at["model.quantization"]: r for r in _reports(hydra_conf, overrides)}
    assert set(reports) == {"none", "nf4"}
    qlora, lora = reports["nf4"], reports["none"]
    assert qlora.device.startswith("RTX-4090")
    peak = {(q, b): reports[q].cells["bf16", b, 1].peak_bytes for q in reports for b in (1, 2)}
    assert qlora.cells["bf16", 1, 1].fits and qlora.cells["bf16", 2, 1].fits, peak
    assert lora.cells["bf16", 1, 1].fits and not lora.cells["bf16", 2, 1].fits, peak
    for b in (1, 2):
        assert peak["nf4", b] < peak["none", b] - 5 * GiB, peak
    assert peak["nf4", 1] < peak["nf4", 2] < 0.9 * 24 * GiB, peak
    cfg = hydra_conf([*overrides, "model.quantization=nf4", "trainer.batch_size=1"])
    state = Workloads().of(cfg).predictor(plan(cfg, None), cfg.optimizer).state_bytes
    linears, embeddings = 6_979_321_856, 2 * 128_256 * 4096
    four_bit = linears // 2 + linears // 64  # packed values, uint8 scales
    # rank-8 adapters on the 7 projections of 32 layers, fp32 (peft's), with their
    # gradients and AdamW's two moments: 16 bytes each
    adapters = 32 * 8 * (9 * 4096 + 2 * 1024 + 3 * 14336)  # r x (in + out) per projection
    expected = four_bit + 4 * embeddings + 16 * adapters
    # the rest: fp32 norms (1 MiB), second-level scales (1.7 MB) and codes, rotary buffer
    assert expected < state < expected + 4 * MiB, (state, expected)


@pytest.mark.parametrize(("budget", "share"), [("null", 1.0), ("50%", 0.5)])
def test_ranks_on_this_machine_share_its_memory(hydra_conf, budget: str, share: float) -> None:
    """Two data-parallel ranks on one machine's CPU were each given '23.5 GiB (all of this
    machine's memory) per rank': they share it, each with its part."""
    from batchfit.train.plan import budget_source

    cfg = hydra_conf(
        ["model=small_cnn", "data=digits", "trainer.device=cpu", "trainer.strategy=ddp",
         "trainer.devices=2", f"search.memory_budget={budget}"]
    )  # fmt: skip
    spec = plan(cfg, cfg.search.memory_budget)
    whole = spec.target.total_bytes
    assert spec.budget_bytes == int(whole * share) // 2
    assert budget_source(cfg.search.memory_budget, spec) == (
        f"{'all' if budget == 'null' else budget} of this machine's memory, shared by its 2 ranks"
    )
    alone = hydra_conf(
        ["model=small_cnn", "data=digits", "trainer.device=cpu", "search.memory_budget=null"]
    )
    assert plan(alone, None).budget_bytes is None  # one process: all of it, as before
