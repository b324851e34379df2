"""The training loop: accumulation, mixed precision, memory measurement, hooks; timed by
train/measure/throughput.py's clock.

One optimizer step = up to `accum_steps` micro-batches of `batch_size` samples. The task's
loss is summed over its units (samples, or tokens for a language model) and divided by the
units of the whole step, so a ragged last step, or sequences with unequal numbers of tokens,
give exactly the full-batch gradient. No host sync in the hot loop: losses accumulate on the
device and are read at logging intervals, where the clock is also read.

`_fit` tells a run's story; `_measured_step`, `_log` and `_validate` do its parts.
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

from tracking.metrics import (
    DATA_WAIT_SHARE,
    PEAK_BYTES,
    RESERVED_BYTES,
    STEP_MS,
    THROUGHPUT_SAMPLES,
    THROUGHPUT_SPREAD,
    TRAIN_EPOCH,
    TRAIN_FINAL_LOSS,
    TRAIN_LOSS,
    TRAIN_LR,
    TRAIN_S,
    VAL_ACC,
    VAL_LOSS,
    VAL_PREFIX,
    rank_peak_bytes,
    throughput,
)  # fmt: skip
from train.batches import (
    Padding,
    Pipeline,
    samples_planned,
    step_micro_batch_sizes,
    steps_plan,
    to_device,
)
from train.config import TrainerConfig
from train.data import Datasets, Splits
from train.evaluate import evaluate, probe_seconds_per_sample
from train.language.quantize import quant_state_tensors
from train.measure.energy import Energy, energy_meter
from train.measure.noise import NoiseReading, NoiseScale
from train.measure.throughput import ThroughputClock
from train.memory.budget import (
    MemoryMeter,
    MemoryStats,
    OutOfMemory,
    TensorMemoryTracker,
    is_oom_error,
    release_memory,
)
from train.parallel.ranks import CONTINUE, END, Ranks, Stopped
from train.precision import Precision
from train.tasks import Classification, Task, batch_size_of, split_in_two

Metrics = dict[str, float]
__all__ = ["steps_plan"]  # re-exported: planning belongs with the batches it plans


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


@dataclass(frozen=True)
class Run:
    """What `fit` trains, built once by its caller (train/run.py, train/parallel/distributed.py):
    the model, its optimizer and schedule, its data (a Pipeline, or Splits or Datasets with
    the default loader), the trainer settings, the device and the memory meter that holds the
    budget, the caller's hooks, the task, and on several processes this one's ranks."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: Pipeline | Splits | Datasets
    cfg: TrainerConfig
    device: torch.device
    meter: MemoryMeter
    hooks: Hooks = field(default_factory=Hooks)
    task: Task = field(default_factory=Classification)
    ranks: Ranks | None = None
    pipeline: Pipeline = field(init=False, repr=False)  # `data`'s batches, for `device`

    def __post_init__(self) -> None:
        object.__setattr__(self, "pipeline", Pipeline.of(self.data, self.device))


def fit(run: Run) -> RunResult:
    """Train under the memory budget. Raises OutOfMemory, Diverged, or what a hook raises;
    on several ranks (train/parallel/ranks.py) Stopped when rank 0's hooks asked to stop.

    A device OOM is turned into OutOfMemory only after its exception (whose traceback pins
    the failed step's activations) has been dropped and memory released.
    """
    run.meter.start()
    oom_message = None
    try:
        result = _fit(_Plan(run))
        if run.hooks.on_end:
            run.hooks.on_end(run.model)
        return result
    except Exception as error:
        if not is_oom_error(error):
            raise
        oom_message = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
    finally:
        run.pipeline.close()
    release_memory(run.device)
    raise OutOfMemory(oom_message, run.meter.stats().peak_bytes, run.meter.budget_bytes)


def split_window(cfg: TrainerConfig, num_steps: int, first_timed_step: int) -> range:
    """The steps where the noise scale's split estimator runs a one-micro-batch step as two
    halves (train/measure/noise.py), off the throughput clock: up to trainer.noise_scale_window
    from the first step the clock would time, at most a third of the steps left, and at
    least 2; empty where the run has several micro-batches a step, or too few steps."""
    if cfg.accum_steps > 1 or cfg.batch_size < 2:
        return range(0)
    window = min(cfg.noise_scale_window, (num_steps - first_timed_step) // 3)
    return range(first_timed_step, first_timed_step + window) if window >= 2 else range(0)


@dataclass
class _Plan:
    """A run and its plan, fixed before its first step: what its steps, logging and
    validations share."""

    run: Run
    precision: Precision = field(init=False)
    scaler: torch.amp.GradScaler = field(init=False)
    steps_per_epoch: int = field(init=False)
    num_steps: int = field(init=False)
    measured_steps: list[int] = field(init=False)  # run under the CPU memory tracker
    memory_checked_step: int = field(init=False)  # past it, the run fits its budget
    first_timed_step: int = field(init=False)  # warm-up and measured steps stay off the clock
    noise: NoiseScale | None = field(init=False)  # the gradient noise scale's estimator
    noise_steps: range = field(init=False)  # the steps it measures
    noise_note: str = field(init=False)  # how it measures, or why it does not
    # the task's chance_loss, from the first validation's first batch (RunResult.chance_loss)
    chance: list[float | None] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        run = self.run
        cfg, num_train = run.cfg, run.pipeline.num_train
        self.precision = Precision(cfg.precision, run.device.type)
        self.scaler = self.precision.grad_scaler()
        self.steps_per_epoch, self.num_steps = steps_plan(num_train, cfg)
        tracked = run.meter.needs_tracker
        self.measured_steps = memory_steps(num_train, cfg, self.num_steps) if tracked else []
        self.memory_checked_step = max(self.measured_steps, default=0)
        timed_from = max([cfg.warmup_steps, *(s + 1 for s in self.measured_steps)])
        self.first_timed_step = min(timed_from, self.num_steps - 1)
        self._plan_noise_scale()

    def _plan_noise_scale(self) -> None:
        """Which estimator of train/measure/noise.py this run uses, on which steps. With several
        micro-batches a step, every step past the memory-measured ones; with one, a window
        of split steps, taken off the throughput clock, of at most a third of the steps
        left to time."""
        cfg, ranks, model = self.run.cfg, self.run.ranks, self.run.model
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        adapters = any("lora_" in name for name in trainable)
        self.noise, self.noise_steps = None, range(0)
        if cfg.accum_steps > 1:
            estimator = "ranks" if ranks else "accumulation"
            self.noise_steps = range(self.memory_checked_step + 1, self.num_steps)
        else:
            start = self.first_timed_step
            window = split_window(cfg, self.num_steps, start)
            if cfg.noise_scale_window == 0:
                self.noise_note = "none: trainer.noise_scale_window=0"
                return
            if cfg.batch_size < 2:
                self.noise_note = "none: a micro-batch of one sample cannot be split"
                return
            if not window:
                self.noise_note = f"none: {self.num_steps} steps are too few to measure it on"
                return
            estimator = "split"
            self.noise_steps = window
            self.first_timed_step = window.stop
        world = ranks.world if ranks else 1
        sharded = cfg.strategy == "fsdp"
        self.noise = NoiseScale(model, self.run.device, estimator, world, sharded, adapters)
        self.noise_note = self.noise.describe()

    def noise_step(
        self, step: int, host_batches: list[Any], step_units: int
    ) -> tuple[list[Any], bool]:
        """The micro-batches of `step`, split in two when the split estimator measures it;
        and whether the noise scale measures this step (set up on it when it does)."""
        noise, cfg, ranks = self.noise, self.run.cfg, self.run.ranks
        if noise is None or step not in self.noise_steps:
            return host_batches, False
        # Full steps only, the same on every rank: a ragged last step's sizes differ per rank.
        start = (step % self.steps_per_epoch) * cfg.global_batch_size
        if self.run.pipeline.num_train - start < cfg.global_batch_size:
            return host_batches, False
        if noise.estimator == "split":
            host_batches = list(split_in_two(host_batches[0]))
        world = ranks.world if ranks else 1
        small = batch_size_of(host_batches[0]) * (world if noise.sharded else 1)
        big = cfg.global_batch_size
        first_units = self.run.task.units(host_batches[0])
        if not 0 < small < big or not first_units:
            return host_batches, False
        grad_factor = (step_units / world) / first_units  # optimizer_step's num_units
        noise.begin(small, big, grad_factor, self.scaler)
        return host_batches, True

    def epoch(self, step: int) -> float:
        """Epochs done after `step`, fractional."""
        epoch, index_in_epoch = divmod(step, self.steps_per_epoch)
        return epoch + (index_in_epoch + 1) / self.steps_per_epoch

    def log_due(self, step: int) -> bool:
        return (step + 1) % self.run.cfg.log_every_steps == 0 or step + 1 == self.num_steps

    def validation_due(self, step: int) -> bool:
        """Every trainer.val_every_steps, else at each epoch's end; and after the last step."""
        every = self.run.cfg.val_every_steps or self.steps_per_epoch
        return (step + 1) % every == 0 or step + 1 == self.num_steps

    def optimizer_step(
        self, host_batches: list[Any], num_units: int, copy: bool = False, noise: bool = False
    ) -> torch.Tensor:
        """One step over the host micro-batches, moved to the device one at a time; on
        several ranks `num_units` is the whole step's. `noise`: the noise scale measures it."""
        run, ranks = self.run, self.run.ranks
        micro = (_on_device(b, run.device, copy) for b in host_batches)
        return optimizer_step(
            run.model, run.optimizer, self.scaler, self.precision, micro,
            run.cfg.grad_clip_norm, num_units / ranks.world if ranks else num_units, run.task,
            ranks, len(host_batches), self.noise if noise else None,
        )  # fmt: skip


def _on_device(batch: Any, device: torch.device, copy: bool) -> Any:
    if isinstance(batch, Padding):
        return Padding(to_device(batch.batch, device, copy))
    return to_device(batch, device, copy)


def _fit(plan: _Plan) -> RunResult:
    run = plan.run
    model, pipeline, cfg, hooks, task, ranks = (
        run.model, run.pipeline, run.cfg, run.hooks, run.task, run.ranks
    )  # fmt: skip
    if hooks.on_probe:
        seconds = probe_seconds_per_sample(model, pipeline, cfg, plan.precision, run.device, task)
        hooks.on_probe(seconds, samples_planned(pipeline.num_train, cfg))
    meter = energy_meter(run.device)  # or why there is none
    clock = ThroughputClock(run.device, plan.first_timed_step, task.unit, meter=meter)
    interval_loss = _IntervalLoss(run.device)
    train_loss, num_samples, evals, done_steps = math.nan, 0, [], plan.num_steps
    model.train()
    steps = pipeline.train_steps(cfg, plan.num_steps, ranks.rank if ranks else 0)
    with plan.precision.matmul_mode():
        for step in range(plan.num_steps):
            clock.begin(step)
            host_batches, samples, waited = next(steps)
            units = sum(task.units(b) for b in host_batches if not isinstance(b, Padding))
            step_units = ranks.step_units(units) if ranks else units
            if step in plan.measured_steps:
                step_loss = _measured_step(plan, host_batches, step_units)
            else:
                host_batches, noise = plan.noise_step(step, host_batches, step_units)
                step_loss = plan.optimizer_step(host_batches, step_units, noise=noise)
            del host_batches  # this step's batches go before the next step's arrive
            if hooks.on_memory and step == plan.memory_checked_step:
                hooks.on_memory(run.meter.stats())
            step_lr = run.scheduler.get_last_lr()[0]  # the rate this step used
            run.scheduler.step()
            interval_loss.add(step_loss)
            num_samples += samples
            clock.step(step, samples, units, waited)
            if hooks.on_step:
                hooks.on_step(step + 1, plan.num_steps, clock.elapsed())
            if plan.log_due(step):
                train_loss = _log(plan, clock, step, interval_loss.read(), step_lr)
            if plan.validation_due(step) and _validate(plan, clock, step, evals):
                done_steps = step + 1  # on_eval ended the run here
                break
    clock.stop()
    return _result(plan, clock, done_steps, num_samples, train_loss, evals)


def _measured_step(plan: _Plan, host_batches: list[Any], num_units: int) -> torch.Tensor:
    """An optimizer step under the CPU tensor tracker, its peak recorded in the meter."""
    tracker = TensorMemoryTracker()
    tracker.register(state_tensors(plan.run.model, plan.run.optimizer))
    with tracker:  # the micro-batches count too: on a GPU they live on the device
        step_loss = plan.optimizer_step(host_batches, num_units, copy=True)
    plan.run.meter.record_tracked_peak(tracker, plan.run.ranks)
    return step_loss


class _IntervalLoss:
    """The train loss summed on the device over a logging interval's steps: read, a host
    sync, only at the interval's end."""

    def __init__(self, device: torch.device):
        self._sum = torch.zeros((), device=device)
        self._num_steps = 0

    def add(self, step_loss: torch.Tensor) -> None:
        self._sum += step_loss
        self._num_steps += 1

    def read(self) -> float:
        """The interval's mean step loss; starts the next interval."""
        mean = self._sum.item() / self._num_steps  # host sync: once per interval
        self._sum.zero_()
        self._num_steps = 0
        return mean


def _log(plan: _Plan, clock: ThroughputClock, step: int, train_loss: float, lr: float) -> float:
    """Ends a logging interval: raises Diverged on a loss that is not finite, reads the
    clock, and reports both to on_log. Returns the loss. On several ranks the loss is
    their mean and the interval's rates their sum."""
    ranks, hooks = plan.run.ranks, plan.run.hooks
    throughput = clock.interval(step)  # read even without on_log: the result's rates need it
    if ranks:
        train_loss, *rates = ranks.sum([train_loss, *throughput.values()])
        train_loss /= ranks.world
        throughput = dict(zip(throughput, rates, strict=True))
    if not math.isfinite(train_loss):
        raise Diverged(step + 1, train_loss)
    reading = plan.noise.read(ranks) if plan.noise else None  # a collective on ranks
    if hooks.on_log:
        metrics = {TRAIN_LOSS: train_loss, TRAIN_LR: lr, TRAIN_EPOCH: plan.epoch(step)}
        noise = reading.logged() if reading else {}
        hooks.on_log(step + 1, {**metrics, **throughput, **noise})
    return train_loss


def _validate(plan: _Plan, clock: ThroughputClock, step: int, evals: list[Metrics]) -> bool:
    """Evaluates after `step` off the clock and appends the metrics to `evals`; True when
    on_eval ends the run here."""
    run = plan.run
    clock.pause()
    metrics = evaluate(
        run.model, run.pipeline, run.cfg.batch_size, plan.precision, run.device, run.task,
        run.ranks, plan.chance,
    )  # fmt: skip
    metrics.update(
        step=step + 1, epoch=plan.epoch(step), num_epochs=plan.num_steps / plan.steps_per_epoch
    )
    metrics[TRAIN_S] = clock.train_seconds(step + 1)
    evals.append(metrics)
    answer = run.hooks.on_eval(step + 1, metrics) if run.hooks.on_eval else None
    if run.ranks:  # rank 0's answer (CONTINUE, END or STOP: its trial's side raised) for all
        decision = run.ranks.decide(int(answer or CONTINUE))
        if decision not in (CONTINUE, END):
            raise Stopped
        answer = decision == END
    if answer:
        return True
    if step + 1 < plan.num_steps:  # after the last step the clock stays stopped
        clock.resume(step)
    return False


def _result(
    plan: _Plan,
    clock: ThroughputClock,
    num_steps: int,
    num_samples: int,
    train_loss: float,
    evals: list[Metrics],
) -> RunResult:
    seconds, timed_steps = clock.seconds, clock.timed_steps(num_steps)
    memory = plan.run.meter.stats()
    noise = plan.noise.read(plan.run.ranks) if plan.noise else None
    return RunResult(
        num_steps=num_steps,
        num_samples=num_samples,
        throughput_samples_per_sec=clock.timed_samples / seconds if seconds else math.nan,
        step_ms=1000 * seconds / timed_steps if timed_steps else math.nan,
        peak_bytes=memory.peak_bytes,
        reserved_bytes=memory.reserved_bytes,
        train_loss=train_loss,
        val={k: v for k, v in evals[-1].items() if k.startswith(VAL_PREFIX)},
        evals=evals,
        timed_steps=timed_steps,
        timed_samples=clock.timed_samples,
        timed_seconds=seconds,
        unit=plan.run.task.unit,
        timed_units=clock.timed_units,
        data_wait_s=clock.data_wait_s,
        interval_rates=clock.interval_rates,
        noise=noise,
        noise_estimator=plan.noise.note(noise) if plan.noise else plan.noise_note,
        energy=clock.energy(),
        energy_note=clock.energy_note,
        chance_loss=plan.chance[0] if plan.chance else None,
    )
