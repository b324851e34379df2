"""One optimizer step and what a run is made of, below the loop that repeats it: `optimizer_step`
(unscaling, clipping, the optimizer and the scaler), the state tensors a step holds, which steps
the CPU tracker measures, the hooks a caller gives, divergence, and the run's result. The memory
predictor (train/memory/predict.py) computes this same step on fake tensors.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from batchfit.tracking.metrics import (
    DATA_WAIT_SHARE,
    PEAK_BYTES,
    RESERVED_BYTES,
    STEP_MS,
    THROUGHPUT_SAMPLES,
    THROUGHPUT_SPREAD,
    TRAIN_FINAL_LOSS,
    VAL_ACC,
    VAL_LOSS,
    rank_peak_bytes,
    throughput,
)  # fmt: skip
from batchfit.train.batches import Padding, steps_plan
from batchfit.train.config import TrainerConfig
from batchfit.train.language.quantize import quant_state_tensors
from batchfit.train.measure.energy import Energy
from batchfit.train.measure.memory import (
    MemoryStats,
)
from batchfit.train.measure.noise import NoiseReading, NoiseScale
from batchfit.train.parallel.ranks import Ranks
from batchfit.train.precision import Precision
from batchfit.train.tasks import Classification, Task

Metrics = dict[str, float]


class Diverged(Exception):
    """The training loss became NaN or infinite."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"train loss is {loss} at step {step}")
        self.step = step
        self.loss = loss


@dataclass
class Hooks:
    """Callbacks into the caller. An exception raised by a hook stops the run and propagates."""

    # (seconds per sample of one small forward/backward, samples the run will train on),
    # before the first step: lets a caller stop a hopeless configuration in seconds.
    on_probe: Callable[[float, int], None] | None = None
    on_step: Callable[[int, int, float], None] | None = None  # (step, num_steps, elapsed_s)
    # (peak and reserved bytes so far) once the run is past its memory check: it fits
    on_memory: Callable[[MemoryStats], None] | None = None
    on_log: Callable[[int, Metrics], None] | None = None  # every trainer.log_every_steps
    # After each validation; returning True ends the run there (e.g. its target is met).
    on_eval: Callable[[int, Metrics], bool | None] | None = None
    on_end: Callable[[nn.Module], None] | None = None  # the trained model (e.g. to save it)


MIN_SPREAD_INTERVALS = 3  # timed logging intervals before a run states its throughput's spread


@dataclass
class RunResult:
    num_steps: int
    num_samples: int
    throughput_samples_per_sec: float
    step_ms: float
    peak_bytes: int
    reserved_bytes: int | None
    train_loss: float
    val: Metrics = field(default_factory=dict)  # the last validation's val/* figures
    evals: list[Metrics] = field(default_factory=list)
    # What the throughput clock saw: the optimizer steps and samples it timed (warm-up and
    # memory-measured steps excluded), and its seconds (validation excluded).
    timed_steps: int = 0
    timed_samples: int = 0
    timed_seconds: float = 0.0
    unit: str = "samples"  # the task's loss unit (tokens for a language model)
    timed_units: int = 0
    data_wait_s: float = 0.0  # of timed_seconds, waiting for the input pipeline
    # samples/s of each logging interval the clock timed: how steady the machine was
    interval_rates: list[float] = field(default_factory=list)
    # A data-parallel run's: each rank's peak (peak_bytes is the largest)
    rank_peak_bytes: list[int] = field(default_factory=list)
    # The gradient noise scale's last reading (train/measure/noise.py) and how it was measured;
    # None, and why not, where the run had no step to measure it on
    noise: NoiseReading | None = None
    noise_estimator: str = ""
    # The joules the device's counters saw over the timed steps (train/measure/energy.py);
    # None, and why not (or what counted them), where it has no counter
    energy: Energy | None = None
    energy_note: str = ""
    # The validation loss of a uniform guess (Task.chance_loss): ln C for C classes; None
    # where the task's loss has none or the run never validated
    chance_loss: float | None = None

    @property
    def val_acc(self) -> float:
        return self.val.get(VAL_ACC, math.nan)

    @property
    def val_loss(self) -> float:
        return self.val.get(VAL_LOSS, math.nan)

    def metrics(self) -> Metrics:
        """The run's final figures under their metric names (NaN ones left out), validation
        apart (it is logged as it happens)."""
        values = {
            THROUGHPUT_SAMPLES: self.throughput_samples_per_sec,
            STEP_MS: self.step_ms,
            DATA_WAIT_SHARE: (
                self.data_wait_s / self.timed_seconds if self.timed_seconds else math.nan
            ),
            PEAK_BYTES: float(self.peak_bytes),
            TRAIN_FINAL_LOSS: self.train_loss,
        }
        if self.unit != "samples":
            values[throughput(self.unit)] = (
                self.timed_units / self.timed_seconds if self.timed_seconds else math.nan
            )
        if self.reserved_bytes is not None:
            values[RESERVED_BYTES] = float(self.reserved_bytes)
        if len(self.rank_peak_bytes) > 1:
            for rank, peak in enumerate(self.rank_peak_bytes):
                values[rank_peak_bytes(rank)] = float(peak)
        if self.noise is not None:
            values.update(self.noise.metrics())
        if self.energy is not None:
            values.update(self.energy.metrics(self.timed_samples, self.timed_units, self.unit))
        if len(self.interval_rates) >= MIN_SPREAD_INTERVALS:
            rates = sorted(self.interval_rates)
            values[THROUGHPUT_SPREAD] = (rates[-1] - rates[0]) / statistics.median(rates)
        return {k: v for k, v in values.items() if not math.isnan(v)}

    def figures(self) -> Metrics:
        """Everything a study may optimise or recommend by: metrics() and val/*."""
        return {**self.metrics(), **{k: v for k, v in self.val.items() if not math.isnan(v)}}


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    precision: Precision,
    micro_batches: Iterable[Any],
    grad_clip_norm: float | None = None,
    num_units: float | None = None,
    task: Task | None = None,
    ranks: Ranks | None = None,
    num_micro_batches: int | None = None,
    noise: NoiseScale | None = None,
) -> torch.Tensor:
    """One optimizer step over `micro_batches`; returns the step's mean loss per unit (on
    device).

    `micro_batches` may be a generator (one micro-batch on the device at a time), in which
    case `num_units`, the task's units in the whole step, must be given. On several ranks
    (`ranks`, with the step's `num_micro_batches`) `num_units` is the whole step's units
    over the ranks' number: the gradients are averaged over the ranks. A `Padding`
    micro-batch runs with weight 0. `noise`, when it measures this step, reads the
    gradients after the first micro-batch and before the update (train/measure/noise.py).
    """
    task = task or Classification()
    if num_units is None:
        micro_batches = list(micro_batches)
        num_units = sum(task.units(batch) for batch in micro_batches)
    step_loss = None
    for i, batch in enumerate(micro_batches):
        weight = 1.0
        if isinstance(batch, Padding):
            batch, weight = batch.batch, 0.0
        if step_loss is None:
            step_loss = torch.zeros((), device=_device_of(batch))
        last = num_micro_batches is None or i == num_micro_batches - 1
        with ranks.micro_batch(last) if ranks else nullcontext():
            with precision.autocast():
                output = task.forward(model, batch)
            # A sum over the micro-batch's units, divided by the units of the whole step:
            # micro-batches of unequal size contribute in proportion, as in one big batch.
            loss = task.loss(output, batch) / max(num_units, 1)
            if not weight:
                loss = loss * weight
            scaler.scale(loss).backward()
        step_loss += loss.detach()
        if noise is not None and i == 0:
            noise.first_micro_batch()
    if noise is not None:
        noise.step_end()
    if grad_clip_norm is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return step_loss


def _device_of(batch: Any) -> torch.device:
    leaves = torch.utils._pytree.tree_leaves(batch)
    return next(t.device for t in leaves if isinstance(t, torch.Tensor))


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Tensors alive across steps: parameters, buffers, 4-bit scales, gradients, moments."""
    tensors = [*model.parameters(), *model.buffers(), *quant_state_tensors(model)]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def memory_steps(num_train: int, cfg: TrainerConfig, num_steps: int) -> list[int]:
    """The steps whose memory the CPU tracker measures: step 0 (it may already exceed the
    budget: stop early) and the first full-size step with optimizer state in place, the
    steady-state peak that train/memory/predict.py predicts. That is step 1, or step 2 when step 1
    is the short last step of a two-step epoch; with DDP, a step after the one where it
    rebuilds its gradient buckets (the second forward: the probe's backward may be the
    first). They stay out of the throughput timing."""
    full = sum(step_micro_batch_sizes(num_train, cfg, 0))
    first = 2 if cfg.strategy == "ddp" else 1
    full_size = sum(step_micro_batch_sizes(num_train, cfg, first)) == full
    steady = first if full_size else first + 1
    return [s for s in (0, steady) if s < num_steps]


def step_micro_batch_sizes(num_train: int, cfg: TrainerConfig, step: int) -> list[int]:
    """Samples per micro-batch of optimizer step `step` on rank 0 (the one with the most),
    sliced as `fit` slices them: the last step of an epoch may be short, and so may its
    last micro-batch."""
    steps_per_epoch, _ = steps_plan(num_train, cfg)
    start = (step % steps_per_epoch) * cfg.global_batch_size
    samples = min(cfg.global_batch_size, num_train - start)
    chunk = cfg.batch_size * cfg.devices
    return [min(cfg.batch_size, samples - i) for i in range(0, samples, chunk)]
