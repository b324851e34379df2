"""The training loop: accumulation, mixed precision, memory measurement, hooks; timed by
train/measure/throughput.py's clock. The step it repeats is train/step.py's.

One optimizer step = up to `accum_steps` micro-batches of `batch_size` samples. The task's
loss is summed over its units (samples, or tokens for a language model) and divided by the
units of the whole step, so a ragged last step, or sequences with unequal numbers of tokens,
give exactly the full-batch gradient. No host sync in the hot loop: losses accumulate on the
device and are read at logging intervals, where the clock is also read.

`_fit` tells a run's story; `_measured_step`, `_log` and `_validate` do its parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from batchfit.tracking.metrics import (
    TRAIN_EPOCH,
    TRAIN_LOSS,
    TRAIN_LR,
    TRAIN_S,
    VAL_PREFIX,
)  # fmt: skip
from batchfit.train.batches import Padding, Pipeline, samples_planned, steps_plan, to_device
from batchfit.train.config import TrainerConfig
from batchfit.train.data import Datasets, Splits
from batchfit.train.measure.energy import energy_meter
from batchfit.train.measure.evaluate import evaluate, probe_seconds_per_sample
from batchfit.train.measure.memory import (
    MemoryMeter,
    OutOfMemory,
    TensorMemoryTracker,
    is_oom_error,
    release_memory,
)
from batchfit.train.measure.noise import NoiseScale
from batchfit.train.measure.throughput import ThroughputClock
from batchfit.train.parallel.ranks import CONTINUE, END, Ranks, Stopped
from batchfit.train.precision import Precision
from batchfit.train.step import (
    Diverged,
    Hooks,
    Metrics,
    RunResult,
    memory_steps,
    optimizer_step,
    state_tensors,
)
from batchfit.train.tasks import Classification, Task, batch_size_of, split_in_two


@dataclass(frozen=True)
class Run:
    """What `fit` trains, built once by its caller (train/run.py, train/launch/distributed.py):
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
