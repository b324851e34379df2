"""What would fit when nothing does (search/fit/advice.py): each lever predicted for batch 1,
cheapest first, every figure checked against the predictor asked directly for the same
command, and the printed command followed to see batch 1 fit."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys

import pytest
from rich.console import Console

from batchfit.common.checks import ConfigError
from batchfit.search.fit.advice import LORA, advise
from batchfit.search.fit.layouts import fit_reports
from batchfit.search.study.driver import StudyDriver
from batchfit.search.study.validate import validate
from batchfit.train.device.gpus import gpu
from batchfit.train.device.sizes import format_bytes
from batchfit.train.plan import plan, with_gpu_budget
from batchfit.train.run import OverBudget
from batchfit.train.workload import Workloads
from tests.conftest import REPO

# Full fine-tuning of the tiny Llama on this CPU, its batch 1 at the space's shortest
# sequence (128); the budget is set below from predictions, with no margin.
LLM_FULL = [
    "+experiment=llm_full", "data.max_bytes=40000", "trainer.device=cpu",
    "search.preflight_margin=0",
]  # fmt: skip


def _batch1(hydra_conf, overrides: list[str], seq_len: int) -> tuple[int, int]:
    """(peak, state) of batch 1 at `seq_len` for `overrides`, from the predictor directly."""
    cfg = hydra_conf([*overrides, f"data.seq_len={seq_len}"])
    with_gpu_budget(cfg, overrides)
    spec = plan(cfg, cfg.search.memory_budget)
    trainer = dataclasses.replace(
        spec.trainer, batch_size=1, accum_steps=1, effective_batch_size=None
    )
    workload = Workloads().of(cfg)
    predictor = workload.predictor(spec, cfg.optimizer)
    return predictor.predict(trainer, workload.num_train).peak_bytes, predictor.state_bytes


def test_the_cheapest_levers_that_fit_are_given_as_commands(hydra_conf) -> None:
    """A budget that holds batch 1 with bf16 weights but not the fp32 state: the study and
    the fit report stop before any table (OverBudget), and the advice finds the weights in
    bf16 first (model.dtype=bfloat16), then tries LoRA, QLoRA (LoRA with 4-bit base
    weights: no combination with LoRA alone, which it holds), FSDP over 2-8 ranks, then
    LoRA with FSDP (checkpointing is searched by the experiment: the report's tables have
    it)."""
    budget, _ = _batch1(hydra_conf, [*LLM_FULL, "model.dtype=bfloat16"], 128)
    overrides = [*LLM_FULL, f"search.memory_budget={budget}"]
    given, state = _batch1(hydra_conf, overrides, 128)
    assert budget < state < given  # the premise: fp32's state alone is over the budget
    cfg = hydra_conf(overrides)
    with pytest.raises(OverBudget) as error:
        validate(cfg, "advice", lambda extra: hydra_conf([*overrides, *extra]), False)
    assert error.value.needed_bytes == state

    advice = advise(cfg, overrides, hydra_conf, state_bytes=state)
    assert advice.given.peak_bytes == given and not advice.given.fits
    assert advice.geometry == "accum_steps 1, fp32, data.seq_len=128"
    words = [t.words for t in advice.tried]
    assert words[:3] == ["bf16 weights", "LoRA adapters", "4-bit base weights (QLoRA)"], words
    assert advice.tried[2].overrides[-2:] == (f"model.lora={LORA}", "model.quantization=nf4")
    assert words[3:6] == [f"FSDP over {n} devices" for n in (2, 4, 8)], words
    # FSDP does not shard 4-bit weights: QLoRA is not combined with it
    assert all(w.startswith("LoRA adapters + FSDP over") for w in words[6:]), words
    assert advice.fitting and advice.fitting[0].words == "bf16 weights"
    assert len(advice.fitting) <= 2 and (len(advice.fitting) < 2 or advice.tried[-1].fits)
    for tried in advice.tried:
        assert tried.fits == (tried.peak_bytes <= budget), tried
    for tried in {*advice.tried[:3], advice.tried[-1]}:  # the predictor's, for that command
        assert tried.peak_bytes == _batch1(hydra_conf, list(tried.overrides), 128)[0], tried
    assert any("activation checkpointing (the report's tables search" in n
               for n in advice.not_applicable)  # fmt: skip

    lines = advice.lines("python -m search.fit")
    command = f"python -m search.fit {shlex.join(overrides)} model.dtype=bfloat16"
    assert lines[lines.index(f"      {command}") - 1].startswith(
        f"  - bf16 weights: {format_bytes(budget)} on this machine, fits the budget of "
        f"{format_bytes(budget)} (search.memory_budget):"
    )
    # Following it: the fit report of that command (its batch-1 cells) has batch 1 fitting.
    followed = [*shlex.split(command)[3:], BATCH_1]
    fixed = hydra_conf(followed)
    checked = validate(fixed, "advice", lambda extra: hydra_conf([*followed, *extra]), False)
    reports = fit_reports(fixed, checked.space, checked.spec, checked.settings)
    (report,) = [r for r in reports if r.at == {"data.seq_len": 128} and r.checkpointing == "none"]
    assert report.cells["fp32", 1, 1].fits and report.cells["fp32", 1, 1].peak_bytes == budget


BATCH_1 = (
    '++search.params={trainer.batch_size:"choice(1)",trainer.accum_steps:"choice(1)",'
    'trainer.precision:"choice(fp32)",data.seq_len:"choice(128)",'
    'trainer.activation_checkpointing:"choice(none)",model.lora.r:null}'
)


# The small GPT planned for a T4 whose budget is 0.19% of it (28.7 MiB): no table fits.
GPT_T4 = ["+experiment=gpt", "data.max_bytes=40000", "search.gpu=T4", "search.gpu_budget=0.19%"]


def test_more_cards_then_the_smallest_larger_card(hydra_conf, stores) -> None:
    """The study planned for a card it does not have shows the report, then what would fit
    (as `python -m search` commands): the smallest number of T4s that FSDP fits batch 1 on,
    then the smallest card of train/device/gpus.py whose 0.19% holds it."""
    overrides = [*GPT_T4, *stores["overrides"]]
    console = Console(record=True, width=400)
    with pytest.raises(ConfigError, match="search.gpu=T4 plans for a GPU this machine"):
        StudyDriver.prepare(hydra_conf(overrides), overrides, {}, console)
    text = console.export_text()
    assert "largest that fits" in text and "†" not in text
    given, _ = _batch1(hydra_conf, overrides, 64)
    peaks = {
        n: _batch1(hydra_conf, [*overrides, "trainer.strategy=fsdp", f"trainer.devices={n}"], 64)[0]
        for n in (2, 4, 8)
    }
    limit = int(15_102 * 2**20 * 0.0019)
    fsdp = next(n for n in (2, 4, 8) if peaks[n] * 1.05 <= limit)  # the premise: one fits
    assert given * 1.05 > limit
    # What batch 1 needs is its peak with the margin (the GPT trains every weight, a kind of
    # step no GPU has measured: 5%), the figure compared with the budget
    assert (
        f"What would fit batch 1 (accum_steps 1, fp32, data.seq_len=64): it needs "
        f"{format_bytes(given)} on T4, {format_bytes(given * 1.05)} with the margin of 5% "
        "(full fine-tuning steps: not measured on a GPU) to spare, over the budget of "
        f"{format_bytes(limit)} (0.19% of T4)"
    ) in text
    assert (
        f"  - FSDP over {fsdp} devices: {format_bytes(peaks[fsdp])} per rank on {fsdp} x T4 "
        f"({format_bytes(peaks[fsdp] * 1.05)} with its 5% margin), "
        f"fits the budget of {format_bytes(limit)} (0.19% of T4):\n"
        f"      python -m search {shlex.join(overrides)} trainer.strategy=fsdp "
        f"trainer.devices={fsdp}\n"
    ) in text
    v100, _ = _batch1(hydra_conf, [*overrides, "search.gpu=V100-16GB"], 64)
    l4, _ = _batch1(hydra_conf, [*overrides, "search.gpu=L4"], 64)
    assert v100 * 1.05 > 16 * 2**30 * 0.0019 and l4 * 1.05 <= 24 * 2**30 * 0.0019  # premise
    assert "  - a larger card, V100-16GB: " in text and ", does not fit the budget" in text
    rest = [o for o in overrides if not o.startswith("search.gpu=")]
    assert (
        f"  - a larger card, L4: {format_bytes(l4)} on L4 ({format_bytes(l4 * 1.05)} with its 5% "
        "margin), fits the budget of 46.7 MiB "
        f"(0.19% of L4):\n      python -m search {shlex.join(rest)} search.gpu=L4\n"
    ) in text
    assert "Not applicable here: bf16 weights (the model has no model.dtype)" in text


@pytest.mark.slow
def test_the_fit_report_command_prints_the_advice(tmp_path) -> None:
    """`python -m search.fit` as a user runs it: the tables, then what would fit, on stdout;
    and with a budget below the state, the configuration error with the advice."""
    run = subprocess.run(
        [sys.executable, "-m", "search.fit", *GPT_T4],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.index("fit report: table 3/3") < out.index(
        "Nothing fits: the smallest batch is predicted"
    )
    assert "python -m search.fit +experiment=gpt data.max_bytes=40000 search.gpu=T4" in out
    assert "search.gpu_budget=0.19% trainer.strategy=fsdp trainer.devices=" in out
    over = subprocess.run(
        [sys.executable, "-m", "search.fit", *GPT_T4, "search.gpu_budget=0.01%"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert over.returncode == 2, over.stderr
    assert "Configuration error" in over.stderr and "What would fit batch 1" in over.stderr
    assert "Fit report for" not in over.stdout


def test_a_state_over_the_card_is_not_answered_with_a_larger_budget(hydra_conf) -> None:
    """A 1.2B GPT with AdamW in fp32 on a T4: its parameters, gradients and moments alone
    are more than the card has, so the message gives no budget to raise to (it gave
    search.memory_budget=153798MiB for a 6.4B model on an 80 GB card) and points to the
    fit report, which says what would fit."""
    overrides = [
        "+experiment=gpt", "data.max_bytes=40000", "model.n_layer=6", "model.n_embd=4096",
        "model.n_head=32", "search.gpu=T4",
    ]  # fmt: skip
    cfg = hydra_conf(overrides)
    base = with_gpu_budget(cfg, overrides)
    with pytest.raises(OverBudget) as error:
        validate(cfg, "advice", lambda extra: hydra_conf([*base, *extra]), False)
    t4 = gpu("T4").total_bytes
    assert error.value.needed_bytes > t4  # the premise, predicted
    (problem,) = error.value.problems
    usable = 15_102 * 2**20 - 512 * 2**20  # what a T4 offers a process (search.gpu_budget)
    assert problem.startswith(f"search.memory_budget={format_bytes(usable)} is below the ")
    assert "search.memory_budget=" not in problem.split(" is below the ")[1]
    assert (
        "That is more than the 14.7 GiB T4 has, so no budget on it holds this run, whatever "
        "the batch; the fit report (python -m search.fit with these overrides) predicts what "
        "would" in problem
    )
