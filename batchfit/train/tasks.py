"""Tasks: how a batch feeds the model, what the loss is, and what validation measures.

A task is chosen with the `task` config group (`task=classification | language_model |
causal_lm | regression`) or a `_target_` of one's own: subclass `Task` and override what
differs, as one overrides a LightningModule's `training_step` or HF Trainer's `compute_loss`:

- `forward(model, batch)`: the model's output for a batch. A tuple or list batch calls
  `model(batch[0])`; a dict batch calls `model(**inputs)` with every key but the target.
  The output may be a tensor, a dict or a dataclass-like object (`logits` taken from it).
- `loss(output, batch)`: the **sum** of the loss over the batch's units, not the mean.
  The loop divides by the units of the whole optimizer step, so accumulated micro-batches
  of unequal size (a ragged last step, sequences with unequal numbers of tokens) give
  exactly the gradient of one large batch.
- `units(batch)`: how many units that sum is over, counted on the host before the step:
  samples for a classifier, target tokens for a language model. `unit` names them; the
  loop reports `throughput/<unit>_per_sec` beside `throughput/samples_per_sec`.
- `metrics()`: validation metrics as torchmetrics `Metric`s by name; each is logged as
  `val/<name>` and its direction is the metric's `higher_is_better`. `val/loss` (the mean
  loss per unit) is always measured. `derived` adds metrics computed from the others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanAbsoluteError, MeanSquaredError, Metric

from batchfit.tracking.metrics import VAL_LOSS, val

MAXIMIZE, MINIMIZE = "maximize", "minimize"


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    leaves = torch.utils._pytree.tree_leaves(batch)
    tensor = next((t for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if tensor is None:
        raise TypeError(f"a batch must hold at least one tensor, got {type(batch).__name__}")
    return tensor.shape[0]


def split_in_two(batch: Any) -> tuple[Any, Any]:
    """A batch's first half and the rest, split along the sample dimension (tensors whose
    first dimension is the batch's; other leaves go to both)."""
    n = batch_size_of(batch)
    half = n // 2

    def part(lo: int, hi: int | None) -> Any:
        def cut(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == n:
                return leaf[lo:hi]
            return leaf

        return torch.utils._pytree.tree_map(cut, batch)

    return part(0, half), part(half, None)


def logits_of(output: Any) -> torch.Tensor:
    """The prediction tensor of a model's output: the tensor itself, `output["logits"]` of a
    dict, or `output.logits` of a dataclass-like output (e.g. Hugging Face's ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    if hasattr(output, "logits"):
        return output.logits
    raise TypeError(
        f"the model returned a {type(output).__name__}; a task reads a tensor, a dict with "
        "'logits' or an object with .logits. Override Task.predictions to read another field"
    )


class ArgmaxAccuracy(Metric):
    """Share of targets equal to the argmax of the logits over their last dimension; targets
    equal to `ignore_index` are left out. Works for (N, C) vs (N,) and (N, T, V) vs (N, T)."""

    higher_is_better = True
    full_state_update = False
    plot_lower_bound = 0.0  # torchmetrics' bounds of a metric's values: a share
    plot_upper_bound = 1.0

    def __init__(self, ignore_index: int | None = None):
        super().__init__()
        self.ignore_index = ignore_index
        self.add_state("correct", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        keep = torch.ones_like(target, dtype=torch.bool)
        if self.ignore_index is not None:
            keep = target != self.ignore_index
        self.correct += ((preds.argmax(dim=-1) == target) & keep).sum()
        self.total += keep.sum()

    def compute(self) -> torch.Tensor:
        # in float64: exactly correct / total, as a Python division of the counts gives it
        return self.correct.double() / self.total.clamp_min(1)


class Task:
    """Classification-shaped defaults; see the module docstring for what to override."""

    unit = "samples"
    target_key: str | int = "labels"  # the target's key in a dict batch; tuples: the last item
    derived: dict[str, str] = {}  # metrics computed by `derive`, with their directions
    # The values each can take, (lowest, highest), None: unbounded: val/loss's (a user's loss
    # may be negative: unbounded unless the task says), and the derived metrics'. A task
    # metric's are its torchmetrics plot_lower_bound and plot_upper_bound.
    loss_range: tuple[float | None, float | None] = (None, None)
    derived_ranges: dict[str, tuple[float | None, float | None]] = {}

    def forward(self, model: nn.Module, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return model(**{k: v for k, v in batch.items() if k != self.target_key})
        return model(batch[0])

    def target(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping):
            if self.target_key not in batch:
                raise KeyError(
                    f"the batch has keys {sorted(batch)}, none of them the target "
                    f"{self.target_key!r}; set task.target_key"
                )
            return batch[self.target_key]
        return batch[-1]

    def predictions(self, output: Any) -> torch.Tensor:
        """What metrics and loss read of the output (logits, in fp32: a softmax over fp16 or
        bf16 logits is lossy)."""
        return logits_of(output).float()

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        return F.cross_entropy(self.predictions(output), self.target(batch), reduction="sum")

    def units(self, batch: Any) -> int:
        return batch_size_of(batch)

    def metrics(self) -> dict[str, Metric]:
        return {"acc": ArgmaxAccuracy()}

    def chance_loss(self, output: Any) -> float | None:
        """The loss per unit of a uniform guess, which an untrained model does no better
        than: ln C for a cross-entropy over C classes (or a vocabulary of C tokens), with or
        without label smoothing. None where the loss has no such baseline (a loss of one's
        own, regression). A trial whose validation loss is not below it did not learn
        (search/trial/objective.py: never recommended)."""
        if type(self).loss not in (Task.loss, Classification.loss, LanguageModel.loss):
            return None
        classes = self.predictions(output).shape[-1]
        return math.log(classes) if classes > 1 else None

    def update(self, metrics: dict[str, Metric], output: Any, batch: Any) -> None:
        preds, target = self.predictions(output), self.target(batch)
        for metric in metrics.values():
            metric.update(preds, target)

    def derive(self, values: dict[str, float]) -> dict[str, float]:
        """Metrics computed from the measured ones (`values` holds `loss` and `metrics()`)."""
        return {}

    def ranges(self) -> dict[str, tuple[float | None, float | None]]:
        """`val/<name>` -> (lowest, highest) value it can take, None where unbounded: what a
        search.target beyond them can never reach."""
        found: dict[str, tuple[float | None, float | None]] = {VAL_LOSS: self.loss_range}
        for name, metric in self.metrics().items():
            found[val(name)] = (metric.plot_lower_bound, metric.plot_upper_bound)
        found.update({val(name): r for name, r in self.derived_ranges.items()})
        return found

    def directions(self) -> dict[str, str]:
        """`val/<name>` -> maximize | minimize for everything validation reports."""
        found = {}
        for name, metric in self.metrics().items():
            if metric.higher_is_better is None:
                raise ValueError(
                    f"task metric {name!r} ({type(metric).__name__}) has higher_is_better=None;"
                    " set it on the metric class so a study knows which way is better"
                )
            found[val(name)] = MAXIMIZE if metric.higher_is_better else MINIMIZE
        found[VAL_LOSS] = MINIMIZE
        found.update({val(name): d for name, d in self.derived.items()})
        return found


class Classification(Task):
    """Cross-entropy over class logits (N, C) against integer labels (N,); val/acc."""

    loss_range = (0.0, None)  # a cross-entropy

    def __init__(self, target_key: str = "labels", label_smoothing: float = 0.0):
        self.target_key = target_key
        self.label_smoothing = label_smoothing

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        return F.cross_entropy(
            self.predictions(output),
            self.target(batch),
            reduction="sum",
            label_smoothing=self.label_smoothing,
        )


class LanguageModel(Task):
    """Next-token cross-entropy over logits (N, T, V) against targets (N, T); targets equal
    to `ignore_index` (padding) carry no loss. The unit is a target token: the loss of a
    step is its mean over the step's tokens, however they fall into sequences."""

    unit = "tokens"
    derived = {"perplexity": MINIMIZE}
    loss_range = (0.0, None)  # a cross-entropy
    derived_ranges = {"perplexity": (1.0, None)}  # exp(loss)

    def __init__(self, target_key: str = "labels", ignore_index: int = -100):
        self.target_key = target_key
        self.ignore_index = ignore_index

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        logits = self.predictions(output)
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            self.target(batch).reshape(-1),
            ignore_index=self.ignore_index,
            reduction="sum",
        )

    def units(self, batch: Any) -> int:
        return int((self.target(batch) != self.ignore_index).sum())

    def metrics(self) -> dict[str, Metric]:
        return {"acc": ArgmaxAccuracy(self.ignore_index)}  # next-token accuracy

    def derive(self, values: dict[str, float]) -> dict[str, float]:
        return {"perplexity": math.exp(min(values["loss"], 700.0))}


class CausalLM(LanguageModel):
    """Hugging Face's convention for causal language models: a sample's `labels` are its
    `input_ids` (positions to leave out set to `ignore_index`), and position t predicts
    token t+1. The task shifts the labels, not the model: they move one to the left and the
    last position is ignored (as transformers' own ForCausalLMLoss does, so that the logits
    are not copied into a shifted view). The model gets every key but `labels`, so it
    computes no loss of its own (a mean, which accumulation would get wrong); the loss is
    summed over target tokens. A model that returns a ModelOutput works as is."""

    def target(self, batch: Any) -> torch.Tensor:
        labels = super().target(batch)
        return F.pad(labels[..., 1:], (0, 1), value=self.ignore_index)


class Regression(Task):
    """Mean squared error between the output and a float target of the same shape (a
    trailing dimension of 1 is squeezed); val/mse and val/mae."""

    loss_range = (0.0, None)  # a squared error

    def __init__(self, target_key: str = "labels"):
        self.target_key = target_key

    @staticmethod
    def _column(values: torch.Tensor) -> torch.Tensor:
        # (N, 1) -> (N,): an output or target column must not broadcast against the other
        return values.squeeze(-1) if values.dim() > 1 and values.shape[-1] == 1 else values

    def predictions(self, output: Any) -> torch.Tensor:
        return self._column(logits_of(output).float())

    def target(self, batch: Any) -> torch.Tensor:
        return self._column(super().target(batch).float())

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        target = self.target(batch)
        return F.mse_loss(self.predictions(output), target, reduction="sum") / max(
            1, target[0].numel()
        )

    def metrics(self) -> dict[str, Metric]:
        return {"mse": MeanSquaredError(), "mae": MeanAbsoluteError()}
