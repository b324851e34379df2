"""Hugging Face Trainer: the per-device batch, accumulation and precision predicted to fit a
card, before the Trainer starts, instead of halved after each OOM.

    from batchfit.hf import fit_arguments, PredictionCallback
    fitted = fit_arguments(model, args, train_dataset, gpu="A100-40GB")
    trainer = Trainer(model, fitted.args, train_dataset=train_dataset,
                      callbacks=[PredictionCallback(fitted.prediction)])

`fit_arguments` predicts the model's own step (its loss, from the labels in the batch) on one
batch the collator makes of the train dataset, and returns the arguments with
`per_device_train_batch_size` the largest divisor of the per-device effective batch
(`per_device_train_batch_size x gradient_accumulation_steps`) that fits, and
`gradient_accumulation_steps` making up the rest: the effective batch the arguments asked for
is kept. `auto_find_batch_size=True` halves the batch after each OOM instead and does not
raise the accumulation. `PredictionCallback` measures each optimizer step's peak (CUDA's
`max_memory_reserved`; on the CPU, the tensor tracker batchfit measures CPU runs with) beside
the prediction.

Install with `pip install "batchfit[llm]"`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback, TrainingArguments, default_data_collator

from batchfit.prediction import Prediction, StepPredictor, own_loss
from batchfit.train.measure.memory import TensorMemoryTracker
from batchfit.train.step import state_tensors

EXAMPLE_SAMPLES = 64  # the example batch: the longest sequences among the first 64 samples
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FittedArguments:
    """`args` with the batch, accumulation and precision set; the `prediction` of its step."""

    args: TrainingArguments
    prediction: Prediction


def precision_of(args: TrainingArguments) -> str:
    """batchfit's name of the arguments' precision: bf16, fp16 (autocast) or fp32."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def example_batch(train_dataset: Any, data_collator: Any = None) -> dict[str, torch.Tensor]:
    """One batch the collator (default: transformers' default_data_collator) makes of the
    first EXAMPLE_SAMPLES samples: padded to the longest of them, as the prediction wants
    a sequence at its largest."""
    collate = data_collator or default_data_collator
    samples = [train_dataset[i] for i in range(min(EXAMPLE_SAMPLES, len(train_dataset)))]
    if not samples:
        raise ValueError("train_dataset is empty: give at least one sample")
    return dict(collate(samples))


def fit_arguments(
    model: torch.nn.Module,
    args: TrainingArguments,
    train_dataset: Any = None,
    *,
    data_collator: Any = None,
    example: Any = None,
    precision: str | None = None,
    gpu: str | None = None,
    budget: int | str | None = None,
    margin: float | None = None,
) -> FittedArguments:
    """The arguments with the largest per-device batch predicted to fit, keeping the
    effective batch.

    Args:
        model: the model the Trainer will train (its own loss, from the batch's labels).
        args: the TrainingArguments; their per-device batch x accumulation is kept.
        train_dataset: the train dataset, whose collated samples are the example batch.
        data_collator: the Trainer's collator (default: default_data_collator).
        example: a batch to predict with instead of the dataset's.
        precision: "bf16", "fp16" or "fp32" to train with; default the arguments'.
        gpu: a card of batchfit's table ("A100-40GB"); default this machine's GPU, else CPU.
        budget: memory per device (bytes, "40GiB", "90%", "usable"); default on a GPU what
            it offers a process; on the CPU it must be given.
        margin: the share of the peak kept free (default: the kind of step's measured error).

    Returns:
        FittedArguments: `args` (a copy; the given ones are unchanged) and the prediction.

    Raises:
        ValueError: no example; nothing fits, not even one sample a device.
        PredictionUnsupported: the model does not run on fake tensors.
    """
    if example is None and train_dataset is None:
        raise ValueError("give train_dataset (with its data_collator), or example=a batch")
    batch = example if example is not None else example_batch(train_dataset, data_collator)
    precision = precision or precision_of(args)
    ranks = max(1, int(args.world_size))
    strategy = "none" if ranks == 1 else ("fsdp" if args.fsdp else "ddp")
    step = StepPredictor(
        model, batch, optimizer=None, gpu=gpu, budget=budget, margin=margin,
        strategy=strategy, devices=ranks, grad_clip_norm=args.max_grad_norm or None,
        forward=loss_only, loss=lambda loss, batch: loss,
    )  # fmt: skip
    per_device = args.per_device_train_batch_size * args.gradient_accumulation_steps
    found = step.keeping(per_device, precision)
    if found is None:
        raise ValueError(
            f"not even one sample a device fits {step.budget_bytes} bytes on "
            f"{step.target.name} in {precision}: see batchfit.fit_table for what would"
        )
    fitted = dataclasses.replace(
        args,
        per_device_train_batch_size=found.batch_size,
        gradient_accumulation_steps=found.accum_steps,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        auto_find_batch_size=False,
    )
    return FittedArguments(fitted, found)


def loss_only(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The model's own loss, its other outputs (the logits) let go at once, as the Trainer's
    compute_loss does: only what autograd saved outlives the forward pass."""
    return own_loss(model(**batch))


class PredictionCallback(TrainerCallback):
    """Measures every optimizer step's peak beside the prediction: on CUDA the caching
    allocator's `max_memory_reserved` (reset at each step's start), on the CPU the peak of
    live tensors (the tracker batchfit measures CPU runs with). `measured_peak_bytes` holds
    the largest; at the end of training it is logged with the prediction's error."""

    def __init__(self, prediction: Prediction):
        self.prediction = prediction
        self.measured: list[int] = []  # per optimizer step
        self._tracker: TensorMemoryTracker | None = None

    @property
    def measured_peak_bytes(self) -> int | None:
        return max(self.measured) if self.measured else None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):  # noqa: ANN001, ANN201
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        elif model is not None and optimizer is not None:
            self._tracker = TensorMemoryTracker()
            self._tracker.register(state_tensors(model, optimizer))
            self._tracker.__enter__()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        if torch.cuda.is_available():
            self.measured.append(torch.cuda.max_memory_reserved())
        elif self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.measured.append(self._tracker.peak_bytes)
            self._tracker = None

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        measured = self.measured_peak_bytes
        if measured:
            error = (self.prediction.peak_bytes - measured) / measured
            log.info(
                "batchfit: predicted peak %d bytes, measured %d (%+.2f%%)",
                self.prediction.peak_bytes, measured, 100 * error,
            )  # fmt: skip
