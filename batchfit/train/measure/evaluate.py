"""Passes over a run's data outside its optimizer steps, each leaving the model as it found
it: `evaluate`, the validation pass whose metrics a run's hooks see (train/loop.py calls it
off the throughput clock), and `probe_seconds_per_sample`, the timed pass of a few samples
that lets a caller stop a hopeless configuration before the run's first step.
"""

from __future__ import annotations

import torch
from torch import nn

from batchfit.tracking.metrics import val
from batchfit.train.batches import Padding, Pipeline, to_device
from batchfit.train.config import TrainerConfig
from batchfit.train.data import Datasets, Splits
from batchfit.train.measure.throughput import Stopwatch
from batchfit.train.parallel.ranks import Ranks
from batchfit.train.precision import Precision
from batchfit.train.tasks import Classification, Task, batch_size_of

Metrics = dict[str, float]


PROBE_SAMPLES = 8


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
    clock = Stopwatch(device)
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


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: Pipeline | Splits | Datasets,
    batch_size: int,
    precision: Precision,
    device: torch.device,
    task: Task | None = None,
    ranks: Ranks | None = None,
    chance: list[float | None] | None = None,
) -> Metrics:
    """The task's validation metrics, `val/loss` (mean per unit) and the derived ones, over
    the validation split; one host sync per metric at the end. On several ranks each
    evaluates its share of the split and the sums are the ranks' together. `chance`, if
    empty: the task's chance_loss of the first output is appended to it."""
    task = task or Classification()
    pipeline = Pipeline.of(data)
    metrics = {name: metric.to(device) for name, metric in task.metrics().items()}
    model.eval()
    loss_sum = torch.zeros((), device=device)
    units = 0
    rank, world = (ranks.rank, ranks.world) if ranks else (0, 1)
    for host_batch in pipeline.val_batches(batch_size, rank, world):
        padding = isinstance(host_batch, Padding)  # the forward the other ranks run
        host_batch = host_batch.batch if padding else host_batch
        batch = to_device(host_batch, device)
        with precision.autocast():
            output = task.forward(model, batch)
        if padding:
            continue
        units += task.units(host_batch)
        if chance is not None and not chance:
            chance.append(task.chance_loss(output))
        loss_sum += task.loss(output, batch)
        task.update(metrics, output, batch)
    model.train()
    values = {name: float(metric.compute()) for name, metric in metrics.items()}
    total, units = ranks.sum([loss_sum.item(), units]) if ranks else (loss_sum.item(), units)
    values["loss"] = total / max(units, 1)
    for metric in metrics.values():
        # torchmetrics wraps update and compute in closures over the metric, a reference
        # cycle: without them its device tensors go now, not at the next garbage collection.
        for wrapped in ("update", "compute"):
            vars(metric).pop(wrapped, None)
    values.update(task.derive(values))
    return {val(name): value for name, value in values.items()}
