"""The throughput of several run configurations, measured side by side.

A trial's own throughput is measured while it trains, at whatever moment the machine gave
it: on a shared machine identical configurations measured minutes apart differ by half.
Here each configuration is built and timed for a few optimizer steps in turn, round after
round, so a drift of the machine's speed (other processes, clocks, thermal limits) slows
them all alike, and the spread over the rounds says how far a difference between two of
them can be trusted.

    speeds = measure([(cfg_a, spec_a), (cfg_b, spec_b)], rounds=3)
    speeds[0].beats(speeds[1])  # faster in every round than the other in its best one
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from batchfit.train.batches import to_device
from batchfit.train.build import build_model, build_optimizer
from batchfit.train.config import RunSpec
from batchfit.train.measure.memory import release_memory
from batchfit.train.measure.throughput import Stopwatch
from batchfit.train.precision import Precision
from batchfit.train.step import optimizer_step
from batchfit.train.workload import Workload, Workloads

ROUNDS = 3  # visits per configuration: the spread needs more than one
WARMUP_STEPS = 1  # per visit, untimed: kernel selection and allocator warm-up for the shapes
MIN_STEPS = 2  # timed optimizer steps per visit, at least ...
MIN_SECONDS = 0.5  # ... and at least this long, so that the clock's resolution does not count
MAX_STEPS = 50  # a visit of many tiny steps stops here


@dataclass(frozen=True)
class Speed:
    """One configuration's throughput per round: samples/s and the task's units/s (tokens
    for a language model; the same as samples otherwise)."""

    samples_per_sec: tuple[float, ...]
    units_per_sec: tuple[float, ...]
    unit: str = "samples"

    def rates(self, unit: str) -> tuple[float, ...]:
        return self.samples_per_sec if unit == "samples" else self.units_per_sec

    def median(self, unit: str = "samples") -> float:
        return statistics.median(self.rates(unit))

    def spread(self, unit: str = "samples") -> float:
        """(fastest round - slowest round) / median: the noise of this measurement."""
        rates = self.rates(unit)
        return (max(rates) - min(rates)) / self.median(unit)

    def beats(self, other: Speed, unit: str = "samples") -> bool:
        """Faster beyond the noise: its slowest round is faster than the other's fastest."""
        return min(self.rates(unit)) > max(other.rates(unit))


def _visit(cfg: DictConfig, spec: RunSpec, workload: Workload) -> tuple[float, float]:
    """Build the run on the workload's data, warm it up, and time optimizer steps:
    (samples/s, units/s)."""
    torch.manual_seed(spec.trainer.seed)
    pipeline = workload.pipeline(spec.device)
    task = workload.task
    model = build_model(cfg, pipeline, task, spec.trainer.activation_checkpointing, spec.device)
    optimizer = build_optimizer(cfg, model.parameters(), spec.lr)
    precision = Precision(spec.trainer.precision, spec.device.type)
    scaler = precision.grad_scaler()
    clock = Stopwatch(spec.device)
    samples = units = steps = 0
    model.train()
    try:
        with precision.matmul_mode():
            batches = pipeline.train_steps(spec.trainer, WARMUP_STEPS + MAX_STEPS)
            for step, (host_batches, num_samples, _) in enumerate(batches):
                if step == WARMUP_STEPS:
                    clock.start()
                num_units = sum(task.units(batch) for batch in host_batches)
                micro = (to_device(b, spec.device) for b in host_batches)
                optimizer_step(
                    model, optimizer, scaler, precision, micro, spec.trainer.grad_clip_norm,
                    num_units, task,
                )  # fmt: skip
                if step < WARMUP_STEPS:
                    continue
                samples, units, steps = samples + num_samples, units + num_units, steps + 1
                if steps >= MIN_STEPS and clock.read() >= MIN_SECONDS:
                    break
        clock.stop()
    finally:
        pipeline.close()
        del model, optimizer
        release_memory(spec.device)
    return samples / clock.seconds, units / clock.seconds


def measure(
    runs: Sequence[tuple[DictConfig, RunSpec]],
    rounds: int = ROUNDS,
    workloads: Workloads | None = None,
) -> list[Speed]:
    """Each run's throughput over `rounds` rounds; in each round every run is visited once,
    the order rotating so that none is always first (or last) after a change of load. The
    runs' data comes from `workloads` (a study's: built once; else a new one's)."""
    workloads = workloads or Workloads()
    of = [workloads.of(cfg) for cfg, _ in runs]
    samples: list[list[float]] = [[] for _ in runs]
    units: list[list[float]] = [[] for _ in runs]
    if runs:  # untimed: what the process pays once (thread pools, allocator, first kernels)
        _visit(*runs[0], of[0])
    for round_index in range(rounds):
        for offset in range(len(runs)):
            i = (round_index + offset) % len(runs)
            per_sample, per_unit = _visit(*runs[i], of[i])
            samples[i].append(per_sample)
            units[i].append(per_unit)
    return [
        Speed(tuple(s), tuple(u), workload.task.unit)
        for workload, s, u in zip(of, samples, units, strict=True)
    ]
