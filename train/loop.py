"""The training loop: accumulation, mixed precision, timing, memory measurement, hooks.

One optimizer step = up to `accum_steps` micro-batches of `batch_size` samples. The task's
loss is summed over its units (samples, or tokens for a language model) and divided by the
units of the whole step, so a ragged last step, or sequences with unequal numbers of tokens,
give exactly the full-batch gradient. No host sync in the hot loop: losses accumulate on the
device and are read at logging intervals, where the clock is also read.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from train.batches import Pipeline, steps_plan, to_device
from train.config import TrainerConfig
from train.data import Datasets, Splits
from train.memory import (
    MemoryMeter,
    MemoryStats,
    OutOfMemory,
    TensorMemoryTracker,
    is_oom_error,
    release_memory,
)
from train.precision import Precision
from train.tasks import Classification, Task, batch_size_of

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

    @property
    def val_acc(self) -> float:
        return self.val.get("val/acc", math.nan)

    @property
    def val_loss(self) -> float:
        return self.val.get("val/loss", math.nan)

    def metrics(self) -> Metrics:
        """The run's final figures under their metric names (NaN ones left out), validation
        apart (it is logged as it happens)."""
        values = {
            "throughput/samples_per_sec": self.throughput_samples_per_sec,
            "time/step_ms": self.step_ms,
            "time/data_wait_share": (
                self.data_wait_s / self.timed_seconds if self.timed_seconds else math.nan
            ),
            "memory/peak_bytes": float(self.peak_bytes),
            "train/final_loss": self.train_loss,
        }
        if self.unit != "samples":
            values[f"throughput/{self.unit}_per_sec"] = (
                self.timed_units / self.timed_seconds if self.timed_seconds else math.nan
            )
        if self.reserved_bytes is not None:
            values["memory/reserved_bytes"] = float(self.reserved_bytes)
        if len(self.interval_rates) >= MIN_SPREAD_INTERVALS:
            rates = sorted(self.interval_rates)
            values["throughput/spread"] = (rates[-1] - rates[0]) / statistics.median(rates)
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
    num_units: int | None = None,
    task: Task | None = None,
) -> torch.Tensor:
    """One optimizer step over `micro_batches`; returns the step's mean loss per unit (on
    device).

    `micro_batches` may be a generator (one micro-batch on the device at a time), in which
    case `num_units`, the task's units in the whole step, must be given.
    """
    task = task or Classification()
    if num_units is None:
        micro_batches = list(micro_batches)
        num_units = sum(task.units(batch) for batch in micro_batches)
    step_loss = None
    for batch in micro_batches:
        if step_loss is None:
            step_loss = torch.zeros((), device=_device_of(batch))
        with precision.autocast():
            output = task.forward(model, batch)
        # A sum over the micro-batch's units, divided by the units of the whole step:
        # micro-batches of unequal size contribute in proportion, as in one big batch.
        loss = task.loss(output, batch) / max(num_units, 1)
        scaler.scale(loss).backward()
        step_loss += loss.detach()
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
    """Tensors alive across steps: parameters, buffers, gradients, optimizer state."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


class _Clock:
    """Seconds of training, excluding validation; synchronises the device before reading."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = 0.0
        self._started: float | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self._started = time.perf_counter()

    def stop(self) -> None:
        if self._started is not None:
            self._sync()
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def read(self) -> float:
        self.stop()
        self.start()
        return self.seconds


PROBE_SAMPLES = 8


def _train_seconds(timed_s: float, steps: int, first_timed: int, untimed_wall: float) -> float:
    """Training seconds of the first `steps` steps, validation excluded, by the throughput
    clock: the timed steps as timed, and the steps it leaves out (warm-up, memory-measured)
    at the timed steps' mean (their own time is kernel selection and tracking, not
    training); before any timed step, their wall time."""
    timed = steps - first_timed
    if timed <= 0:
        return untimed_wall
    return timed_s + first_timed * timed_s / timed


def probe_seconds_per_sample(
    model: nn.Module,
    data: Pipeline | Splits | Datasets,
    cfg: TrainerConfig,
    precision: Precision,
    device: torch.device,
    task: Task | None = None,
) -> float:
    """Seconds per sample of a forward/backward pass of a few samples; parameters and buffers
    are left as found.

    The same batch runs twice and the second pass is timed: the first pays one-time costs
    (kernel selection and primitive creation for this shape), which would otherwise dominate
    a small batch, badly so on a loaded machine. A small batch still runs less efficiently
    than the real micro-batch, so this overestimates the run's time: good enough to tell a
    configuration that is 50x too slow from one that is not, in a few seconds at most.
    """
    task = task or Classification()
    pipeline = Pipeline.of(data)
    saved = [b.clone() for b in model.buffers()]  # BatchNorm statistics must not see the probe
    batch = to_device(pipeline.example(min(cfg.batch_size, PROBE_SAMPLES)), device)
    n = batch_size_of(batch)
    clock = _Clock(device)
    for _ in range(2):
        clock.seconds = 0.0
        clock.start()
        with precision.matmul_mode():
            with precision.autocast():
                output = task.forward(model, batch)
            task.loss(output, batch).backward()
        clock.stop()
        model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for buffer, value in zip(model.buffers(), saved, strict=True):
            buffer.copy_(value)
    return clock.seconds / n


def samples_planned(num_train: int, cfg: TrainerConfig) -> int:
    steps_per_epoch, num_steps = steps_plan(num_train, cfg)
    full_epochs, rest_steps = divmod(num_steps, steps_per_epoch)
    return full_epochs * num_train + min(rest_steps * cfg.effective_batch_size, num_train)


def step_micro_batch_sizes(num_train: int, cfg: TrainerConfig, step: int) -> list[int]:
    """Samples per micro-batch of optimizer step `step`, sliced as `fit` slices them: the last
    step of an epoch may be short, and so may its last micro-batch."""
    steps_per_epoch, _ = steps_plan(num_train, cfg)
    start = (step % steps_per_epoch) * cfg.effective_batch_size
    samples = min(cfg.effective_batch_size, num_train - start)
    return [min(cfg.batch_size, samples - i) for i in range(0, samples, cfg.batch_size)]


def memory_steps(num_train: int, cfg: TrainerConfig, num_steps: int) -> list[int]:
    """The steps whose memory the CPU tracker measures: step 0 (it may already exceed the
    budget: stop early) and the first full-size step with optimizer state in place, the
    steady-state peak that train/predict.py predicts. That is step 1, or step 2 when step 1
    is the short last step of a two-step epoch. Both stay out of the throughput timing."""
    full = sum(step_micro_batch_sizes(num_train, cfg, 0))
    steady = 1 if sum(step_micro_batch_sizes(num_train, cfg, 1)) == full else 2
    return [s for s in (0, steady) if s < num_steps]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: Pipeline | Splits | Datasets,
    batch_size: int,
    precision: Precision,
    device: torch.device,
    task: Task | None = None,
) -> Metrics:
    """The task's validation metrics, `val/loss` (mean per unit) and the derived ones, over
    the validation split; one host sync per metric at the end."""
    task = task or Classification()
    pipeline = Pipeline.of(data)
    metrics = {name: metric.to(device) for name, metric in task.metrics().items()}
    model.eval()
    loss_sum = torch.zeros((), device=device)
    units = 0
    for host_batch in pipeline.val_batches(batch_size):
        units += task.units(host_batch)
        batch = to_device(host_batch, device)
        with precision.autocast():
            output = task.forward(model, batch)
        loss_sum += task.loss(output, batch)
        task.update(metrics, output, batch)
    model.train()
    values = {name: float(metric.compute()) for name, metric in metrics.items()}
    values["loss"] = loss_sum.item() / max(units, 1)
    for metric in metrics.values():
        # torchmetrics wraps update and compute in closures over the metric, a reference
        # cycle: without them its device tensors go now, not at the next garbage collection.
        for wrapped in ("update", "compute"):
            vars(metric).pop(wrapped, None)
    values.update(task.derive(values))
    return {f"val/{name}": value for name, value in values.items()}


def fit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    data: Pipeline | Splits | Datasets,
    cfg: TrainerConfig,
    device: torch.device,
    meter: MemoryMeter,
    hooks: Hooks | None = None,
    task: Task | None = None,
) -> RunResult:
    """Train under the memory budget. Raises OutOfMemory, Diverged, or what a hook raises.

    A device OOM is turned into OutOfMemory only after its exception (whose traceback pins
    the failed step's activations) has been dropped and memory released.
    """
    pipeline = Pipeline.of(data, device)
    meter.start()
    oom_message = None
    hooks = hooks or Hooks()
    try:
        result = _fit(
            model, optimizer, scheduler, pipeline, cfg, device, meter, hooks,
            task or Classification(),
        )  # fmt: skip
        if hooks.on_end:
            hooks.on_end(model)
        return result
    except Exception as error:
        if not is_oom_error(error):
            raise
        oom_message = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
    finally:
        pipeline.close()
    release_memory(device)
    raise OutOfMemory(oom_message, meter.stats().peak_bytes, meter.budget_bytes)


def _fit(model, optimizer, scheduler, pipeline, cfg, device, meter, hooks, task) -> RunResult:  # noqa: ANN001
    precision = Precision(cfg.precision, device.type)
    scaler = precision.grad_scaler()
    num_train = pipeline.num_train
    steps_per_epoch, num_steps = steps_plan(num_train, cfg)
    measured_steps = memory_steps(num_train, cfg, num_steps) if meter.needs_tracker else []
    memory_checked_step = max(measured_steps, default=0)  # past it, the run fits its budget
    timed_from = max([cfg.warmup_steps, *(s + 1 for s in measured_steps)])
    first_timed_step = min(timed_from, num_steps - 1)
    if hooks.on_probe:
        seconds = probe_seconds_per_sample(model, pipeline, cfg, precision, device, task)
        hooks.on_probe(seconds, samples_planned(num_train, cfg))
    clock = _Clock(device)
    started = time.perf_counter()
    loss_sum = torch.zeros((), device=device)
    interval_steps, last_loss, num_samples = 0, math.nan, 0
    timed_samples, timed_units, data_wait = 0, 0, 0.0
    interval_rates: list[float] = []
    last_read = (0, 0.0)  # timed samples and seconds at the previous logging interval
    evals: list[Metrics] = []
    done_steps, untimed_wall, train_s = num_steps, 0.0, 0.0
    model.train()
    steps = pipeline.train_steps(cfg, num_steps)
    with precision.matmul_mode():
        for step in range(num_steps):
            epoch, index_in_epoch = divmod(step, steps_per_epoch)
            if step == first_timed_step:
                clock.start()
            host_batches, samples, waited = next(steps)
            units = sum(task.units(batch) for batch in host_batches)
            if step in measured_steps:
                tracker = TensorMemoryTracker()
                tracker.register(state_tensors(model, optimizer))
                with tracker:  # the micro-batches count too: on a GPU they live on the device
                    micro = (to_device(b, device, copy=True) for b in host_batches)
                    step_loss = optimizer_step(
                        model, optimizer, scaler, precision, micro, cfg.grad_clip_norm, units, task
                    )
                meter.record_tracked_peak(tracker)
            else:
                micro = (to_device(b, device) for b in host_batches)
                step_loss = optimizer_step(
                    model, optimizer, scaler, precision, micro, cfg.grad_clip_norm, units, task
                )
            del host_batches, micro
            if hooks.on_memory and step == memory_checked_step:
                hooks.on_memory(meter.stats())
            step_lr = scheduler.get_last_lr()[0]  # the rate this step used
            scheduler.step()
            loss_sum += step_loss
            interval_steps += 1
            num_samples += samples
            if step >= first_timed_step:
                timed_samples += samples
                timed_units += units
                data_wait += waited
            if step < first_timed_step:  # wall time of the steps the clock leaves out
                untimed_wall = time.perf_counter() - started
            if hooks.on_step:
                hooks.on_step(step + 1, num_steps, time.perf_counter() - started)
            last_step = step + 1 == num_steps
            if (step + 1) % cfg.log_every_steps == 0 or last_step:
                last_loss = loss_sum.item() / interval_steps  # host sync: once per interval
                if not math.isfinite(last_loss):
                    raise Diverged(step + 1, last_loss)
                loss_sum.zero_()
                interval_steps = 0
                if step >= first_timed_step and clock.read() > last_read[1]:
                    interval_rates.append(
                        (timed_samples - last_read[0]) / (clock.seconds - last_read[1])
                    )
                    last_read = (timed_samples, clock.seconds)
                if hooks.on_log:
                    metrics = {
                        "train/loss": last_loss,
                        "train/lr": step_lr,
                        "train/epoch": epoch + (index_in_epoch + 1) / steps_per_epoch,
                    }
                    if step >= first_timed_step and clock.read() > 0:
                        metrics["throughput/samples_per_sec"] = timed_samples / clock.seconds
                        if task.unit != "samples":
                            metrics[f"throughput/{task.unit}_per_sec"] = timed_units / clock.seconds
                        metrics["time/data_wait_share"] = data_wait / clock.seconds
                    hooks.on_log(step + 1, metrics)
            end_of_epoch = index_in_epoch + 1 == steps_per_epoch
            due = cfg.val_every_steps and (step + 1) % cfg.val_every_steps == 0
            if (due if cfg.val_every_steps else end_of_epoch) or last_step:
                clock.stop()
                metrics = evaluate(model, pipeline, cfg.batch_size, precision, device, task)
                metrics.update(
                    step=step + 1,
                    epoch=epoch + (index_in_epoch + 1) / steps_per_epoch,
                    num_epochs=num_steps / steps_per_epoch,
                )
                # Never less than at the previous validation: the estimate of the steps off
                # the clock moves with the timed mean.
                train_s = max(
                    train_s, _train_seconds(clock.seconds, step + 1, first_timed_step, untimed_wall)
                )
                metrics["time/train_s"] = train_s
                evals.append(metrics)
                if hooks.on_eval and hooks.on_eval(step + 1, metrics):
                    done_steps = step + 1
                    break
                if step >= first_timed_step and not last_step:
                    clock.start()
    clock.stop()
    num_steps = done_steps
    timed_steps = max(num_steps - first_timed_step, 0)
    memory = meter.stats()
    return RunResult(
        num_steps=num_steps,
        num_samples=num_samples,
        throughput_samples_per_sec=timed_samples / clock.seconds if clock.seconds else math.nan,
        step_ms=1000 * clock.seconds / timed_steps if timed_steps else math.nan,
        peak_bytes=memory.peak_bytes,
        reserved_bytes=memory.reserved_bytes,
        train_loss=last_loss,
        val={k: v for k, v in evals[-1].items() if k.startswith("val/")},
        evals=evals,
        timed_steps=timed_steps,
        timed_samples=timed_samples,
        timed_seconds=clock.seconds,
        unit=task.unit,
        timed_units=timed_units,
        data_wait_s=data_wait,
        interval_rates=interval_rates,
    )
