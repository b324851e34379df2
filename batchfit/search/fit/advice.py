"""What would fit when nothing does: the memory levers batchfit has, each tried by a real
prediction of the smallest step, cheapest first, and printed as commands to copy.

When no cell of the fit report fits (or the budget cannot even hold the parameters,
gradients and optimizer state), a smaller batch is no answer. `advise` predicts batch 1
(accumulation 1, the space's shortest `data.seq_len` when it is searched) with each lever
that applies to the config:

1. on the same card, one lever at a time: the weights in bfloat16 (`model.dtype=bfloat16`,
   where the model has that key; costs the weights' precision, no speed), activation
   checkpointing (`trainer.activation_checkpointing=blocks`; costs about one more forward
   pass per step), LoRA adapters (`model.lora`, where the model has that key and trains
   every weight; trains adapters instead of the model), 4-bit base weights (QLoRA:
   `model.quantization=nf4`, with LoRA; costs speed, each matmul dequantizes its weight,
   and a little loss);
2. the same card with two or three of them (those that did not fit alone);
3. more cards of the same kind: FSDP over 2, 4, 8 devices (`trainer.strategy=fsdp
   trainer.devices=N`; each rank's step is predicted), alone, then with the levers of 1;
4. one larger card of train/device/gpus.py (`search.gpu=...`), the smallest that fits, when the
   plan is for a named card and the budget follows the card (a share of it, or all of it).

That order is what "cheapest" means here: what changes only the run before what changes
the training, the same hardware before more of it, more of the same card before a
different card. The search stops after FOUND levers fit, and skips what those dominate (a
combination holding a lever that fits alone, more devices than fit already). Each
candidate is one prediction, made with the same predictor as the report's cells.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import hydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from batchfit.common.checks import ConfigError
from batchfit.common.overrides import merge_overrides
from batchfit.search.sampling.space import SearchSpace, parse_space
from batchfit.train.config import RunSpec
from batchfit.train.device.gpus import GPUS, Gpu
from batchfit.train.device.sizes import format_bytes
from batchfit.train.memory.fitting import fits_budget
from batchfit.train.memory.predict import MemoryPredictor, PredictionUnsupported
from batchfit.train.memory.preflight import UNMEASURED_MARGIN, Margin, step_margin
from batchfit.train.params import CHECKPOINTING_KEY, DEVICES_KEY, PRECISION_KEY, STRATEGY_KEY
from batchfit.train.plan import (
    GPU_KEY,
    budget_source,
    card_budget_bytes,
    follows_card,
    plan,
    with_gpu_budget,
)
from batchfit.train.precision import unsupported_reason
from batchfit.train.workload import Workloads

FOUND = 2  # levers that fit, printed; the search stops there
DEVICE_COUNTS = (2, 4, 8)
SEQ_LEN_KEY = "data.seq_len"
# peft's LoRA on every linear layer but the output head, at the rank of conf/model/hf_causal_lm
LORA = "{r:8,alpha:16,target_modules:all-linear}"


@dataclass(frozen=True)
class Lever:
    words: str  # what it does, for the user: "activation checkpointing"
    overrides: tuple[str, ...]  # what it adds to the command line


@dataclass(frozen=True)
class Tried:
    """One candidate: the user's overrides with some levers, and batch 1 predicted with them."""

    levers: tuple[Lever, ...]  # () for the command as given
    overrides: tuple[str, ...]  # the user's command line with the levers' overrides
    where: str  # "on H100-80GB", "per rank on 2 x H100-80GB"
    peak_bytes: int | None  # None: not predicted (see reason)
    limit_bytes: int | None
    fits: bool
    reason: str | None = None  # why it could not be predicted (a config problem)
    state_bytes: int | None = None  # parameters, gradients and optimizer state (per rank)
    budget: str = ""  # where the budget comes from: "90% of H200"
    # kept free under the budget: search.preflight_margin, or its kind of step's
    margin: Margin = Margin(UNMEASURED_MARGIN)
    batch_size: int = 1  # the smallest the model trains with (BatchNorm after pooling: 2)

    @property
    def words(self) -> str:
        return " + ".join(lever.words for lever in self.levers) or "as given"

    def needs(self) -> str:
        """What batch 1 needs, with its margin when it has one: "16.7 GiB on H100-80GB
        (17.5 GiB with its 5% margin)"."""
        assert self.peak_bytes is not None
        text = f"{format_bytes(self.peak_bytes)} {self.where}"
        if self.margin.value > 0:
            needed = format_bytes(self.peak_bytes * (1 + self.margin.value))
            text += f" ({needed} with its {self.margin.value:.0%} margin)"
        return text


@dataclass
class Advice:
    geometry: str  # what was predicted besides batch 1: "accum_steps 1, fp32, data.seq_len=64"
    given: Tried  # the command as given
    tried: list[Tried] = field(default_factory=list)
    not_applicable: list[str] = field(default_factory=list)  # levers that do not apply, why
    seconds: float = 0.0
    below: str | None = None  # why batch 1 cannot train, where the smallest is larger

    @property
    def fitting(self) -> list[Tried]:
        return [t for t in self.tried if t.fits]

    def lines(self, command: str) -> list[str]:
        """What to print: each candidate predicted, and the command of each that fits."""
        given = self.given
        batch = f"batch {given.batch_size}"
        if given.peak_bytes is None:
            return [f"No advice: no batch up to {SMALLEST[-1]} can be predicted ({given.reason})"]
        if given.fits:
            return [
                f"{batch.capitalize()} fits ({self.geometry}): {format_bytes(given.peak_bytes)} "
                f"{given.where}: search smaller batch sizes, e.g. trainer.batch_size: "
                "choice(1, 2, 4) in search.params"
            ]
        # what the cell needs, not only its peak: with the margin, the figure the check compares
        margin, needs = given.margin, f"{format_bytes(given.peak_bytes)} {given.where}"
        if margin.value > 0:
            needed = format_bytes(given.peak_bytes * (1 + margin.value))
            needs += f", {needed} with the margin of {margin.words()} to spare"
        lines = [
            f"What would fit {batch} ({self.geometry}{self._smallest()}): it needs {needs}, over "
            f"{_budget(given)}. Each lever batchfit has, predicted in {self.seconds:.0f} s, "
            f"cheapest first ({CHEAPEST}):"
        ]
        for tried in self.tried:
            if tried.reason is not None:
                lines.append(f"  - {tried.words}: not predicted: {tried.reason}")
                continue
            verdict = "fits" if tried.fits else "does not fit"
            lines.append(
                f"  - {tried.words}: {tried.needs()}, {verdict} {_budget(tried)}"
                + (":" if tried.fits else "")
            )
            if tried.fits:
                lines.append(f"      {command} {shlex.join(tried.overrides)}")
        if not self.fitting:
            lines.append(f"  None of them makes {batch} fit.")
        if self.not_applicable:
            lines.append(f"  Not applicable here: {'; '.join(self.not_applicable)}.")
        return lines

    def _smallest(self) -> str:
        """Why the advice is for a batch above 1: the reason batch 1 cannot train."""
        if self.given.batch_size == 1 or self.below is None:
            return ""
        return f"; batch 1 cannot train: {self.below}"


# Batch sizes tried, smallest first, for the smallest one the model trains with: BatchNorm
# over a 1x1 feature map (ResNet after its pooling) needs 2 samples (train/run.py does so too).
SMALLEST = (1, 2, 4, 8)

CHEAPEST = (
    "the same card before more of it, more cards before a larger one; on one card the "
    "weights in bf16, then checkpointing, then LoRA, then 4-bit weights, one lever before two"
)


def _budget(tried: Tried) -> str:
    return f"the budget of {format_bytes(tried.limit_bytes)} ({tried.budget})"


def advise(
    cfg: DictConfig,
    overrides: Sequence[str],
    compose: Callable[[list[str]], DictConfig],
    workloads: Workloads | None = None,
    state_bytes: int | None = None,
) -> Advice:
    """Batch 1 predicted as given and with each lever (module docstring), cheapest first,
    until FOUND fit. `cfg`: the command's config (its budget applied: with_gpu_budget);
    `overrides`: its command line as the user gave it, which the printed commands extend;
    `compose`: composes a whole command line; `workloads`: the report's, whose predictor
    answers the command as given; `state_bytes`: what the parameters, gradients and
    optimizer state need (card-independent: a larger card below it is not tried)."""
    started = time.perf_counter()
    spec = plan(cfg, cfg.search.memory_budget)
    space = parse_space(cfg.search.params or {})
    geometry = _geometry(spec, space)
    words = ", ".join(["accum_steps 1", *(f"{k}={v}" for k, v in geometry.items())])
    words = words.replace(f"{PRECISION_KEY}=", "")
    predict = _Predictor(compose, geometry, cfg.search.preflight_margin)
    given = predict(tuple(overrides), (), cfg, workloads)
    advice = Advice(words, given, below=predict.below)
    if given.fits or given.peak_bytes is None:
        return advice
    state_bytes = state_bytes or given.state_bytes
    same_card, advice.not_applicable = _same_card_levers(cfg, space)
    _search(_Search(advice, overrides, predict), cfg, space, spec, same_card, state_bytes)
    advice.seconds = time.perf_counter() - started
    return advice


def what_would_fit(
    cfg: DictConfig,
    overrides: Sequence[str],
    command: str,
    workloads: Workloads | None = None,
    state_bytes: int | None = None,
) -> list[str]:
    """`advise`, composing as the entry point `command` does (Hydra initialised), as the
    lines to print."""

    def compose(full: list[str]) -> DictConfig:
        return hydra.compose(config_name="config", overrides=full)

    return advise(cfg, overrides, compose, workloads, state_bytes).lines(command)


def merge(overrides: Sequence[str], levers: Sequence[Lever]) -> tuple[str, ...]:
    """The user's command line with the levers' overrides, each replacing the same key's."""
    added = [o for lever in levers for o in lever.overrides]
    return tuple(merge_overrides(list(overrides), added))


def _geometry(spec: RunSpec, space: SearchSpace) -> dict[str, object]:
    """Batch 1's other settings: the configured precision (the space's first one the device
    runs, when the configured one is not searched), the shortest searched data.seq_len."""
    precision = spec.trainer.precision
    choices = getattr(space.distributions.get(PRECISION_KEY), "choices", None)
    if choices:
        runs = [str(c) for c in choices if unsupported_reason(str(c), spec.target) is None]
        if runs and precision not in runs:
            precision = runs[0]
    geometry: dict[str, object] = {PRECISION_KEY: precision}
    seq_lens = getattr(space.distributions.get(SEQ_LEN_KEY), "choices", None)
    if seq_lens:
        geometry[SEQ_LEN_KEY] = min(int(v) for v in seq_lens)
    return geometry


class _Predictor:
    """Batch 1 of a command line, predicted: composed as that command composes it, its
    budget applied as the entry points apply it (with_gpu_budget), its own predictor, and
    its own margin (`setting`: search.preflight_margin; None: from its kind of step)."""

    def __init__(
        self, compose: Callable[[list[str]], DictConfig], geometry: dict, setting: float | None
    ) -> None:
        self.compose = compose
        self.geometry = geometry
        self.setting = setting
        self.below: str | None = None  # why batch 1 cannot train (when it cannot)

    def __call__(
        self,
        overrides: tuple[str, ...],
        levers: tuple[Lever, ...],
        cfg: DictConfig | None = None,
        workloads: Workloads | None = None,
    ) -> Tried:
        try:
            if cfg is None:
                seq = [f"{k}={v}" for k, v in self.geometry.items() if k == SEQ_LEN_KEY]
                cfg = self.compose([*overrides, *seq])
                with_gpu_budget(cfg, overrides)
            elif SEQ_LEN_KEY in self.geometry:  # another workload: not the report's
                cfg, workloads = copy.deepcopy(cfg), None
                OmegaConf.update(cfg, SEQ_LEN_KEY, self.geometry[SEQ_LEN_KEY], merge=False)
            spec = plan(cfg, cfg.search.memory_budget)
            workload = (workloads or Workloads()).of(cfg)
            predictor = workload.predictor(spec, cfg.optimizer)
            batch_size, peak = self._smallest(predictor, spec, workload.num_train)
        except (ConfigError, PredictionUnsupported, HydraException, ValueError) as error:
            reason = "; ".join(error.problems) if isinstance(error, ConfigError) else str(error)
            return Tried(levers, overrides, "", None, None, False, reason)
        margin = step_margin(self.setting, predictor)
        fits = fits_budget(peak, spec.limit_bytes, margin.value)
        where, state = _where(spec), predictor.state_bytes
        budget = budget_source(cfg.search.memory_budget, spec)
        return Tried(
            levers, overrides, where, peak, spec.limit_bytes, fits, None, state, budget, margin,
            batch_size,
        )  # fmt: skip

    def _smallest(
        self, predictor: MemoryPredictor, spec: RunSpec, num_train: int
    ) -> tuple[int, int]:
        """(batch size, predicted peak) of the smallest batch of SMALLEST that trains; the
        first one's error where none does. Why batch 1 cannot is kept (`below`)."""
        first = None
        for batch_size in SMALLEST:
            trainer = dataclasses.replace(
                spec.trainer,
                batch_size=batch_size,
                accum_steps=1,
                effective_batch_size=None,
                precision=str(self.geometry[PRECISION_KEY]),
            )
            try:
                return batch_size, predictor.predict(trainer, num_train).peak_bytes
            except PredictionUnsupported as error:
                first = first or error
                self.below = self.below or str(error)
        assert first is not None
        raise first


def _where(spec: RunSpec) -> str:
    devices = spec.trainer.devices
    if spec.target.type != "cuda":
        return f"per rank of {devices} on this machine" if devices > 1 else "on this machine"
    name = spec.target.name
    return f"per rank on {devices} x {name}" if spec.trainer.strategy != "none" else f"on {name}"


def _redundant(combo: Sequence[Lever]) -> bool:
    """A lever whose overrides another of `combo` holds already (LoRA within QLoRA)."""
    return any(set(a.overrides) <= set(b.overrides) for a, b in itertools.permutations(combo, 2))


def _same_card_levers(cfg: DictConfig, space: SearchSpace) -> tuple[list[Lever], list[str]]:
    """The levers of the same card that apply to `cfg`, cheapest first; why the others do
    not."""
    levers, absent = [], []
    searched = set(space.distributions)
    model = cfg.model
    if "dtype" not in model:
        absent.append("bf16 weights (the model has no model.dtype)")
    elif str(model.dtype) == "float32" and "model.dtype" not in searched:
        levers.append(Lever("bf16 weights", ("model.dtype=bfloat16",)))
    checkpointing = cfg.trainer.activation_checkpointing
    if CHECKPOINTING_KEY in searched:
        absent.append(f"activation checkpointing (the report's tables search {CHECKPOINTING_KEY})")
    elif checkpointing == "none":
        levers.append(Lever("activation checkpointing", (f"{CHECKPOINTING_KEY}=blocks",)))
    if "lora" not in model:
        absent.append("LoRA (the model has no model.lora)")
    elif model.lora is None:
        levers.append(Lever("LoRA adapters", (f"model.lora={LORA}",)))
    if "quantization" not in model:
        absent.append("4-bit base weights (the model has no model.quantization)")
    elif str(model.quantization) == "none" and "model.quantization" not in searched:
        lora = () if model.get("lora") is not None else (f"model.lora={LORA}",)
        levers.append(Lever("4-bit base weights (QLoRA)", (*lora, "model.quantization=nf4")))
    return levers, absent


class _Search:
    """Tries candidates for `advise` until FOUND fit; a candidate holding every lever of
    one that fits already (a superset) is skipped: it cannot be cheaper."""

    def __init__(self, advice: Advice, overrides: Sequence[str], predict: _Predictor) -> None:
        self.advice = advice
        self.overrides = overrides
        self.predict = predict

    @property
    def done(self) -> bool:
        return len(self.advice.fitting) >= FOUND

    def attempt(self, levers: tuple[Lever, ...]) -> bool:
        """Whether `levers` make batch 1 fit (predicted; False when skipped or done)."""
        fitting = [set(t.levers) for t in self.advice.fitting]
        if self.done or any(fit <= set(levers) for fit in fitting):
            return False
        tried = self.predict(merge(self.overrides, levers), levers)
        self.advice.tried.append(tried)
        return tried.fits


def _search(
    search: _Search,
    cfg: DictConfig,
    space: SearchSpace,
    spec: RunSpec,
    same_card: list[Lever],
    state_bytes: int | None,
) -> None:
    """The candidates, cheapest first (module docstring)."""
    for lever in list(same_card):
        search.attempt((lever,))
        tried = search.advice.tried[-1] if search.advice.tried else None
        if tried is not None and tried.levers == (lever,) and tried.reason is not None:
            # the model refuses it (no blocks to checkpoint): no combination has it either
            search.advice.tried.pop()
            search.advice.not_applicable.append(f"{lever.words} ({tried.reason})")
            same_card.remove(lever)
    for size in range(2, len(same_card) + 1):
        for combo in itertools.combinations(same_card, size):
            if not _redundant(combo):
                search.attempt(combo)
    if STRATEGY_KEY not in space.distributions and DEVICES_KEY not in space.distributions:
        counts = [n for n in DEVICE_COUNTS if n > spec.trainer.devices]
        # alone, then with the same card's levers that do not fit alone
        alone = {t.levers for t in search.advice.fitting}
        helpers = tuple(  # FSDP does not shard 4-bit weights (train/run.py refuses it)
            lever for lever in same_card
            if (lever,) not in alone and "model.quantization=nf4" not in lever.overrides
        )  # fmt: skip
        for extra in [(), helpers][: 2 if helpers else 1]:
            sharded = [Lever(f"FSDP over {n} devices", _fsdp(n)) for n in counts]
            if any(search.attempt((*extra, fsdp)) for fsdp in sharded):
                break
    for card in _larger_cards(cfg, spec, state_bytes):
        if search.attempt((Lever(f"a larger card, {card.name}", (f"{GPU_KEY}={card.name}",)),)):
            break


def _fsdp(devices: int) -> tuple[str, ...]:
    return (f"{STRATEGY_KEY}=fsdp", f"{DEVICES_KEY}={devices}")


def _larger_cards(cfg: DictConfig, spec: RunSpec, state_bytes: int | None) -> list[Gpu]:
    """The cards of train/device/gpus.py with more memory than the planned one, smallest first
    (one of each size and compute capability), whose budget can hold `state_bytes`; none
    unless the plan is for a named card whose budget follows it (all of it, a share, or
    what it offers a process)."""
    budget = cfg.search.memory_budget
    if spec.target.local or spec.target.gpu is None or not follows_card(budget):
        return []
    cards, seen = [], set()
    for card in sorted(GPUS, key=lambda g: g.total_bytes):
        limit = card_budget_bytes(budget, card) or card.total_bytes
        kind = (card.total_bytes, card.capability)
        if card.total_bytes <= spec.target.total_bytes or kind in seen:
            continue
        seen.add(kind)
        if state_bytes is None or limit >= state_bytes:
            cards.append(card)
    return cards
