"""The memory check before a run trains: its predicted peak x (1 + margin) against the
budget, the rule a search trial applies (search/trial/trial_config.py; such a trial is pruned as
oom_predicted), and for a run that fails it, the configurations that pass.

`python -m train` refuses such a run before anything trains, with these numbers and
configurations in the message, unless `search.preflight=false` forces it.

The margin is `search.preflight_margin` when given; by default (null) it comes from the
prediction's measured error for the kind of step (`step_margin`): a kind measured on a real
GPU (MEASURED) gets a margin just over its worst error there; a step with convolutions, or
of a kind never measured on a GPU, keeps UNMEASURED_MARGIN, 5%. What the 5% was chosen for:
allocations made inside kernels raised the smallest limit of the replayed public traces by
at most 2.44% (docs/design.md, tests/bench/test_cuda_trace.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.conv import _ConvNd

from batchfit.common.checks import ConfigError, flag_problems, number_problems
from batchfit.train.config import TrainerConfig
from batchfit.train.device.sizes import format_bytes
from batchfit.train.memory.fitting import fits_budget, largest_fitting_batch
from batchfit.train.memory.predict import MemoryPredictor, Prediction, PredictionUnsupported
from batchfit.train.tasks import LanguageModel

MARGIN_KEY = "search.preflight_margin"
UNMEASURED_MARGIN = 0.05  # steps of a kind no GPU has measured (module docstring)


@dataclass(frozen=True)
class Measured:
    """A kind of step whose predictions were measured on a real GPU: the worst error
    there (predicted - measured max_memory_reserved, as a share of it) and the margin that
    covers it."""

    kind: str  # "language-model LoRA steps"
    worst_error: float
    margin: float
    gpu: str  # where it was measured

    def __post_init__(self) -> None:
        assert abs(self.worst_error) < self.margin <= UNMEASURED_MARGIN, self


# Llama 3.2 1B with LoRA r8 on the seven projections, bf16 autocast, on one H200 (torch
# 2.11, 2026-12-04): batch 4 x 1024 fp32 weights +0.07%; batch 8 x 1024 checkpointed fp32
# weights +0.61%; batch 4 x 2048 checkpointed bf16 weights +0.71% (the project's GPU
# notes; bench/prediction.py's qlora() cells). Every error is an over-prediction; the margin
# is the worst, rounded up to the next percent.
LANGUAGE_MODEL_LORA = Measured("language-model LoRA steps", 0.0071, 0.01, "an H200")
MEASURED = (LANGUAGE_MODEL_LORA,)


@dataclass(frozen=True)
class Margin:
    """The share of a predicted peak kept free under the budget, and why it is that."""

    value: float
    why: str = ""  # for a report's title: "language-model LoRA steps measured within ..."

    @property
    def given(self) -> bool:
        return self.why == MARGIN_KEY

    def words(self) -> str:
        """'1% (language-model LoRA steps measured within 0.71% on an H200)'."""
        return f"{self.value:.0%}" + (f" ({self.why})" if self.why else "")


def step_kind(predictor: MemoryPredictor) -> tuple[Measured | None, str]:
    """The measured kind of the predictor's step, or None and what makes it unmeasured.

    A step has convolutions when its model has a torch convolution module (nn.Conv1d/2d/3d,
    ConvTranspose*): cuDNN's path, under-predicted by up to 65% on an H200 before its
    workspaces were modelled. Convolutions called functionally (F.conv2d) are not seen."""
    model: nn.Module = predictor.model
    if predictor.target.type != "cuda":
        return None, ""  # CPU: the prediction counts what the budget accounts
    if any(isinstance(module, _ConvNd) for module in model.modules()):
        return None, "steps with convolutions: not measured within it on a GPU"
    if not isinstance(predictor.task, LanguageModel):
        kind = getattr(predictor.task, "kind", f"{type(predictor.task).__name__} steps")
        return None, f"{kind}: not measured on a GPU"
    if any("4bit" in type(module).__name__ for module in model.modules()):
        return None, "4-bit (QLoRA) steps: not measured on a GPU"
    if predictor.strategy != "none":
        return None, f"{predictor.strategy} steps: not measured on a GPU"
    names = [name for name, _ in model.named_parameters()]
    if not any("lora_" in name for name in names):
        return None, "full fine-tuning steps: not measured on a GPU"
    return LANGUAGE_MODEL_LORA, ""


# Keys whose values change the kind of a step (step_kind): a study searching one of them
# has trials of several kinds, and holds the unmeasured margin for all
KIND_KEYS = ("model.quantization", "model.lora", "trainer.strategy", "trainer.devices")


def step_margin(
    setting: float | None, predictor: MemoryPredictor | None, searched: Iterable[str] = ()
) -> Margin:
    """search.preflight_margin when given (`setting`); else the margin of the predictor's
    kind of step (step_kind; None: the model cannot be predicted). `searched`: the keys a
    study's space searches; one of KIND_KEYS makes its trials of several kinds."""
    if setting is not None:
        return Margin(float(setting), MARGIN_KEY)
    if predictor is None:
        return Margin(UNMEASURED_MARGIN)
    measured, why = step_kind(predictor)
    if measured is None:
        return Margin(UNMEASURED_MARGIN, why)
    kinds = [key for key in searched if key in KIND_KEYS]
    if kinds:
        return Margin(
            UNMEASURED_MARGIN, f"the space searches {kinds[0]}: not all its steps were measured"
        )
    within = f"{measured.kind} measured within {measured.worst_error:.2%} on {measured.gpu}"
    return Margin(measured.margin, within)


@dataclass(frozen=True)
class PreflightConfig:
    """search.preflight and search.preflight_margin (conf/search/default.yaml)."""

    preflight: bool = True  # false: train without the check (a real OOM may still end it)
    # a share of the predicted peak kept free; None: from the step's kind (step_margin)
    preflight_margin: float | None = None

    def __post_init__(self) -> None:
        problems = flag_problems("search.preflight", self.preflight)
        problems += margin_problems(self.preflight_margin)
        if problems:
            raise ConfigError(problems)


def margin_problems(margin: object) -> list[str]:
    """What is wrong with search.preflight_margin: a number in [0, 1), or null."""
    return number_problems(
        MARGIN_KEY, margin, "a number in [0, 1)",
        at_least=0, below=1, or_null=True, fix=0.05,
    )  # fmt: skip


@dataclass(frozen=True)
class Geometry:
    """A batch geometry predicted to fit, as the overrides that select it."""

    batch_size: int
    accum_steps: int
    peak_bytes: int

    def overrides(self) -> str:
        return f"trainer.batch_size={self.batch_size} trainer.accum_steps={self.accum_steps}"


@dataclass(frozen=True)
class Misfit:
    """A run predicted not to fit its budget, and what fits instead at its precision."""

    trainer: TrainerConfig
    peak_bytes: int
    budget_bytes: int
    margin: Margin
    options: tuple[tuple[Geometry, str], ...]  # (what fits, how it differs), best first

    def describe(self) -> str:
        """The check's numbers: prediction, margin (and why, when it is not the key's),
        budget."""
        t = self.trainer
        needed = self.peak_bytes * (1 + self.margin.value)
        why = f" ({self.margin.why})" if self.margin.why and not self.margin.given else ""
        return (
            f"trainer.batch_size={t.batch_size} x trainer.accum_steps={t.accum_steps} in "
            f"{t.precision} is predicted to peak at {format_bytes(self.peak_bytes)}; with "
            f"{MARGIN_KEY}={self.margin.value:g}{why} that is {format_bytes(needed)}, over "
            f"search.memory_budget={format_bytes(self.budget_bytes)}"
        )

    def message(self) -> str:
        """The refusal: the numbers, what fits instead, and how to train it anyway."""
        t = self.trainer
        fixes = [
            f"{g.overrides()} ({why}, predicted {format_bytes(g.peak_bytes)})"
            for g, why in self.options
        ]
        fit = f" What fits in {t.precision}: {'; or '.join(fixes)}." if fixes else ""
        if not any(g.accum_steps == t.accum_steps for g, _ in self.options):
            fit += f" At trainer.accum_steps={t.accum_steps} not even a batch of 2 fits."
        return (
            f"{self.describe()}, so it would run out of memory: nothing was trained.{fit} Or "
            "raise search.memory_budget, or lower search.preflight_margin; to train it anyway "
            "(a real OOM may end it), add search.preflight=false"
        )


def misfit(
    predictor: MemoryPredictor,
    trainer: TrainerConfig,
    num_train: int,
    prediction: Prediction,
    budget_bytes: int | None,
    setting: float | None,
) -> Misfit | None:
    """None when the run is predicted to fit (or has no budget); else what fits instead: its
    effective batch with more accumulation, the largest batch at its accumulation, and the
    largest without accumulation (up to its effective batch). `setting`:
    search.preflight_margin (None: from the step's kind, step_margin)."""
    kept = step_margin(setting, predictor)
    margin = kept.value
    if budget_bytes is None or fits_budget(prediction.peak_bytes, budget_bytes, margin):
        return None
    effective = trainer.effective_batch_size
    found: list[tuple[Geometry | None, str]] = []
    try:
        whole = largest_fitting_batch(predictor, trainer, num_train, budget_bytes, margin)
    except PredictionUnsupported:
        whole = None
    if whole is not None:
        geometry = Geometry(whole[0], effective // whole[0], whole[1].peak_bytes)
        found.append((geometry, f"the same effective batch {effective}"))

    def largest(accum_steps: int, at_most: int) -> Geometry | None:
        return _largest_batch(
            predictor, trainer, num_train, budget_bytes, margin, accum_steps, at_most
        )

    unaccumulated = "the largest batch without accumulation"
    if trainer.accum_steps > 1:
        at_accum = f"the largest batch at {trainer.accum_steps} micro-batches a step"
        found.append((largest(trainer.accum_steps, trainer.batch_size - 1), at_accum))
        found.append((largest(1, effective), unaccumulated))
    else:
        found.append((largest(1, trainer.batch_size - 1), unaccumulated))
    options: list[tuple[Geometry, str]] = []
    for geometry, why in found:
        if geometry is not None and all(geometry != g for g, _ in options):
            options.append((geometry, why))
    return Misfit(trainer, prediction.peak_bytes, budget_bytes, kept, tuple(options))


def _largest_batch(
    predictor: MemoryPredictor,
    trainer: TrainerConfig,
    num_train: int,
    budget_bytes: int,
    margin: float,
    accum_steps: int,
    at_most: int,
) -> Geometry | None:
    """The largest batch size up to `at_most` that fits at `accum_steps`, bisected (peak
    memory grows with the batch); None when not even 2 does (1 is not tried: BatchNorm
    cannot train on a single sample, nor is it advice)."""
    found = None
    low, high = 2, at_most
    while low <= high:
        mid = (low + high) // 2
        geometry = dataclasses.replace(
            trainer, batch_size=mid, accum_steps=accum_steps, effective_batch_size=None
        )
        try:
            peak = predictor.predict(geometry, num_train).peak_bytes
        except PredictionUnsupported:
            return found
        if fits_budget(peak, budget_bytes, margin):
            found, low = Geometry(mid, accum_steps, peak), mid + 1
        else:
            high = mid - 1
    return found
