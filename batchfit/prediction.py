"""A training step's peak memory predicted for your own model, from your own code.

    import batchfit
    prediction = batchfit.predict_peak(model, batch, optimizer=opt, precision="bf16",
                                       gpu="A100-40GB")
    print(prediction.peak_bytes, prediction.fits)

The step is the one `python -m search.fit` predicts (batchfit/train/memory/predict.py: a
forward, backward and optimizer step computed on fake tensors, replayed through a model of
CUDA's caching allocator for a card), run on a copy of the model whose parameters have no
storage: a prediction allocates nothing of the model's size, moves nothing and changes
nothing of the model or the optimizer it is given. A model on the meta device is predicted
the same way (an 8B model in a notebook, its weights never in memory).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchfit.train.config import TrainerConfig
from batchfit.train.device.gpus import gpu as gpu_entry
from batchfit.train.device.sizes import format_bytes
from batchfit.train.device.spec import DeviceSpec, device_spec
from batchfit.train.language.quantize import fake_param
from batchfit.train.memory.fakes import storage_bytes
from batchfit.train.memory.fitting import fits_budget, largest_fitting_batch
from batchfit.train.memory.predict import MemoryPredictor, PredictionUnsupported
from batchfit.train.memory.predict import Prediction as StepPeak
from batchfit.train.memory.preflight import step_margin
from batchfit.train.memory.reserve import cublas_workspaces
from batchfit.train.plan import USABLE, card_budget_bytes
from batchfit.train.precision import PRECISIONS, unsupported_reason
from batchfit.train.tasks import Task, batch_size_of

OptimizerArg = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Forward = Callable[[nn.Module, Any], Any]
Loss = Callable[[Any, Any], torch.Tensor]
STRATEGIES = ("none", "ddp", "fsdp")


@dataclass(frozen=True)
class Breakdown:
    """What a predicted peak is made of, in bytes; the parts add up to `peak_bytes`.

    `weights_bytes`, `gradients_bytes` and `optimizer_state_bytes` live across steps (with
    DDP, the gradient buckets count as gradients; with FSDP each is one rank's shard);
    `activations_bytes` is the rest of the live tensors at the step's peak (activations kept
    for the backward pass, temporaries); on CUDA `workspace_bytes` are cuBLAS's workspaces
    and `allocator_bytes` what the caching allocator holds beyond live tensors (rounding,
    split blocks, cached segments) at the smallest limit the step runs in."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    workspace_bytes: int = 0
    allocator_bytes: int = 0

    def __str__(self) -> str:
        parts = {
            "weights": self.weights_bytes,
            "gradients": self.gradients_bytes,
            "optimizer state": self.optimizer_state_bytes,
            "activations": self.activations_bytes,
            "workspaces": self.workspace_bytes,
            "allocator": self.allocator_bytes,
        }
        return ", ".join(f"{name} {format_bytes(n)}" for name, n in parts.items() if n)


@dataclass(frozen=True)
class Prediction:
    """The predicted peak memory of one training step, and whether it fits.

    `peak_bytes` is what `python -m search.fit` shows in the step's cell: on CPU the peak of
    live tensor bytes, on CUDA the smallest per-process limit the caching allocator runs the
    step in (what `max_memory_reserved` reads under such a limit). It fits when
    `peak_bytes x (1 + margin) <= budget_bytes`."""

    peak_bytes: int
    breakdown: Breakdown
    device: str  # "cpu", or the card: "A100-40GB"
    batch_size: int  # samples per micro-batch, per device
    accum_steps: int
    precision: str
    budget_bytes: int | None  # None: no budget (the whole device is the limit)
    margin: float  # the share of the peak kept free under the budget
    margin_why: str  # why the margin is what it is ("" for the default)
    world_size: int = 1
    seconds: float = 0.0  # how long the prediction took

    @property
    def fits(self) -> bool | None:
        """Whether the step fits the budget with the margin to spare (None: no budget)."""
        if self.budget_bytes is None:
            return None
        return fits_budget(self.peak_bytes, self.budget_bytes, self.margin)

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step, over every device."""
        return self.batch_size * self.accum_steps * self.world_size

    def __str__(self) -> str:
        verdict = {None: "", True: " fits", False: " does not fit"}[self.fits]
        budget = ""
        if self.budget_bytes is not None:
            budget = f" {format_bytes(self.budget_bytes)} with {self.margin:.0%} to spare"
        return (
            f"{self.batch_size}x{self.accum_steps} {self.precision} on {self.device}: peak "
            f"{format_bytes(self.peak_bytes)} ({self.breakdown}){verdict}{budget}"
        )


class UserTask(Task):
    """A user's step as a batchfit Task: their `forward(model, batch)` (default: a tensor
    batch as it is, a tuple's or list's first element, a dict's entries as keywords) and
    their `loss(output, batch)` (default: the output's own loss, e.g. a Hugging Face model's
    with labels in the batch). A batch's units are its samples."""

    kind = "steps of a model of your own"  # what a margin's reason calls them

    def __init__(self, forward: Forward | None = None, loss: Loss | None = None):
        self._forward, self._loss = forward, loss

    def forward(self, model: nn.Module, batch: Any) -> Any:
        if self._forward is not None:
            return self._forward(model, batch)
        if isinstance(batch, torch.Tensor):
            return model(batch)
        if isinstance(batch, Mapping):
            return model(**batch)
        return model(batch[0])

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        if self._loss is not None:
            return self._loss(output, batch)
        return own_loss(output)

    def units(self, batch: Any) -> int:
        return batch_size_of(batch)


def own_loss(output: Any) -> torch.Tensor:
    """The loss a model returns itself: `output.loss`, `output["loss"]`, or a scalar."""
    found = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if found is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        found = output
    if not isinstance(found, torch.Tensor):
        raise TypeError(
            f"loss: the model returned a {type(output).__name__} without a loss; pass "
            "loss=callable(output, batch), e.g. loss=lambda out, b: F.cross_entropy(out, b[1]), "
            "or put the labels in the batch for a model that computes its own loss"
        )
    return found


def target_of(gpu: str | None) -> DeviceSpec:
    """The device predicted for: a card of the table (planned: this machine need not have
    it), else this machine's GPU, else its CPU."""
    if gpu is not None:
        try:
            gpu_entry(gpu)
        except ValueError as error:
            raise ValueError(f"gpu={gpu!r}: {error}".replace("search.gpu", "gpu")) from None
        return device_spec(torch.device("cpu"), gpu)  # planned: the card need not be here
    here = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    return device_spec(here or torch.device("cpu"), None)


def budget_of(budget: int | str | None, target: DeviceSpec) -> int | None:
    """The budget in bytes: given (bytes, "40GiB", "90%" of the device, "usable"), else what
    a CUDA device offers a process (its memory less the CUDA context), else None (CPU)."""
    if budget is None:
        return card_budget_bytes(USABLE, target) if target.gpu is not None else None
    try:
        return card_budget_bytes(budget, target)
    except ValueError as error:
        raise ValueError(f"budget={budget!r}: {error}") from None


def fake_copy(model: nn.Module, leave_out: Sequence[object] = ()) -> nn.Module:
    """A copy of `model`'s modules in training mode whose parameters and buffers are meta
    tensors of the same shapes, strides, dtypes and requires_grad: nothing of the model's
    size is copied, and the model itself is left as it was (the predictor makes the copy's
    tensors fake in place). Each module is copied with its own containers (hooks, the
    tensors' dicts); its other attributes are the original's, not copies (a data set a
    LightningModule holds is not copied), except references to `leave_out` (a Lightning
    Trainer), which are None. A 4-bit weight keeps a copy of its quantization state."""
    tensors: dict[int, torch.Tensor | None] = {}
    modules: dict[int, nn.Module] = {}
    left = {id(other) for other in leave_out}

    def meta(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        if id(tensor) not in tensors:  # tied weights stay one tensor
            empty = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta"
            )
            tensors[id(tensor)] = (
                _meta_param(tensor, empty) if isinstance(tensor, nn.Parameter) else empty
            )
        return tensors[id(tensor)]

    def module_copy(module: nn.Module) -> nn.Module:
        if id(module) not in modules:
            new = modules[id(module)] = copy.copy(module)  # its own __dict__, values shared
            for name, value in vars(module).items():
                if id(value) in left:
                    setattr(new, name, None)
                elif isinstance(value, (dict, list, set)):  # hooks, buffer names: its own
                    new.__dict__[name] = copy.copy(value)
            new._parameters = {k: meta(v) for k, v in module._parameters.items()}
            new._buffers = {k: meta(v) for k, v in module._buffers.items()}
            new._modules = {
                k: None if v is None else module_copy(v) for k, v in module._modules.items()
            }
            weight = new._parameters.get("weight")
            if getattr(weight, "quant_state", None) is not None:  # it reads its own layer
                weight.module = new
                if getattr(new, "quant_state", None) is not None:
                    new.quant_state = weight.quant_state
        return modules[id(module)]

    copied = module_copy(model)
    copied.train()
    return copied


def _meta_param(param: nn.Parameter, empty: torch.Tensor) -> nn.Parameter:
    """fake_param's Parameter, a 4-bit weight's quantization state copied: the predictor
    makes its tensors fake in place, which must not reach the user's model."""
    new = fake_param(param, empty)
    if getattr(param, "quant_state", None) is not None:
        new.quant_state = copy.deepcopy(param.quant_state)
    return new


def optimizer_factory(optimizer: OptimizerArg | None) -> Callable[[list], torch.optim.Optimizer]:
    """How the predictor builds the optimizer over the copy's parameters: a factory as it
    is; an instance as its class with its defaults (its own state and parameters are left
    alone; per-group options are not kept); None: AdamW, the fine-tuning default."""
    if optimizer is None:
        return lambda params: torch.optim.AdamW(params)
    if isinstance(optimizer, torch.optim.Optimizer):
        kind = type(optimizer)
        # defaults the constructor takes (AdamW's hold Adam's decoupled_weight_decay too)
        accepted = inspect.signature(kind.__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return lambda params: kind(params, **defaults)
    if callable(optimizer):
        return optimizer
    raise TypeError(
        f"optimizer: got a {type(optimizer).__name__}; give a torch.optim.Optimizer, or a "
        "factory of one, e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4)"
    )


def _as_batch(batch: Any) -> Any:
    """A dict for any mapping (a Hugging Face BatchEncoding is not a pytree node)."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        return dict(batch)
    return batch


class StepPredictor:
    """One model's training step, predicted for any batch size, accumulation and
    precision: the model is copied and the step prepared once, and each geometry takes a
    fraction of a second after the first. `predict_peak`, `fit_table` and `largest_batch`
    build one; keep one to ask many questions of the same model.

    Args:
        model: the model, on any device or the meta device; it is not changed.
        batch: one example batch: a tensor, a tuple or list, a dict (a BatchEncoding), as
            the training loop gives it to the step. Its tensors' first dimension is the
            batch's; the other dimensions (a sequence length) should be at their largest.
        optimizer: a torch.optim.Optimizer (its class and defaults are used) or a factory
            `params -> Optimizer`; default AdamW.
        loss: `loss(output, batch) -> tensor`; default: the output's own loss.
        forward: `forward(model, batch) -> output`; default: a tensor batch as it is, a
            tuple's first element, a dict's entries as keywords.
        task: a batchfit Task instead of `forward` and `loss`.
        gpu: a card of the table ("A100-40GB", "H100-80GB", "L4", ...) to predict for;
            default this machine's GPU, else its CPU.
        budget: the memory the step may use: bytes, "40GiB", "90%", or "usable"; default on
            a GPU what it offers a process (its memory less the CUDA context), on the CPU none.
        margin: the share of the peak kept free under the budget; default the measured
            error of the kind of step (1% for language-model LoRA steps on CUDA, else 5%).
        strategy: "none", or "ddp" / "fsdp" over `devices` GPUs: each prediction is then one
            rank's step.
        devices: the data-parallel world size.
        grad_clip_norm: clip gradients to this norm in the step (None: no clipping).
        leave_out: objects the model refers to that the prediction's copy of it must not
            copy (a Lightning Trainer): the copy refers to None instead.

    Raises:
        ValueError: an argument out of its range (named, with the fix).
        TypeError: an optimizer, loss or batch of the wrong kind.
        PredictionUnsupported: the model or step does not run on fake tensors.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        *,
        optimizer: OptimizerArg | None = None,
        loss: Loss | None = None,
        forward: Forward | None = None,
        task: Task | None = None,
        gpu: str | None = None,
        budget: int | str | None = None,
        margin: float | None = None,
        strategy: str = "none",
        devices: int = 1,
        grad_clip_norm: float | None = None,
        leave_out: Sequence[object] = (),
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: got a {type(model).__name__}; give a torch.nn.Module")
        _check_choice("strategy", strategy, STRATEGIES)
        _check_count("devices", devices)
        if strategy == "none" and devices != 1:
            raise ValueError(f"devices={devices} needs strategy='ddp' or 'fsdp'")
        if margin is not None and not 0 <= margin < 1:
            raise ValueError(f"margin={margin}: give a share of the peak in [0, 1), e.g. 0.05")
        self.example = _as_batch(batch)
        self.example_size = batch_size_of(self.example)  # TypeError without a tensor
        self.target = target_of(gpu)
        self.budget_bytes = budget_of(budget, self.target)
        self.task = task or UserTask(forward, loss)
        self.strategy, self.devices, self.grad_clip_norm = strategy, devices, grad_clip_norm
        parallel = self._trainer(1, 1, "fp32") if strategy != "none" else None
        self.predictor = MemoryPredictor(
            fake_copy(model, leave_out),
            optimizer_factory(optimizer),
            self.example,
            self.target,
            self.task,
            parallel,
        )
        found = step_margin(margin, self.predictor)  # given, else the kind of step's
        self.margin = found.value
        self.margin_why = "margin= given" if margin is not None else found.why

    def _trainer(self, batch_size: int, accum_steps: int, precision: str) -> TrainerConfig:
        return TrainerConfig(
            batch_size=batch_size,
            accum_steps=accum_steps,
            precision=precision,
            grad_clip_norm=self.grad_clip_norm,
            strategy=self.strategy,
            devices=self.devices,
        )

    def unsupported(self, precision: str) -> str | None:
        """Why the device predicted for cannot run `precision` (None: it can)."""
        _check_choice("precision", precision, PRECISIONS)
        return unsupported_reason(precision, self.target)

    def predict(
        self, batch_size: int | None = None, *, accum_steps: int = 1, precision: str = "fp32"
    ) -> Prediction:
        """The step of micro-batches of `batch_size` (default: the example's) samples per
        device, `accum_steps` of them per optimizer step, under `precision` (fp32, tf32,
        bf16 autocast, fp16 autocast with a GradScaler).

        Raises:
            ValueError: a size below 1, a precision the device cannot run.
            PredictionUnsupported: the step does not run on fake tensors.
        """
        batch_size = self.example_size if batch_size is None else batch_size
        _check_count("batch_size", batch_size)
        _check_count("accum_steps", accum_steps)
        reason = self.unsupported(precision)
        if reason is not None:
            raise ValueError(f"precision={precision!r}: {reason}")
        trainer = self._trainer(batch_size, accum_steps, precision)
        num_train = trainer.global_batch_size  # one full-size step
        return self._public(self.predictor.predict(trainer, num_train, self.budget_bytes), trainer)

    def _public(self, found: StepPeak, trainer: TrainerConfig) -> Prediction:
        """The predictor's answer for `trainer`'s step, as the API gives it."""
        return Prediction(
            found.peak_bytes,
            self._breakdown(found.peak_bytes, found.tensor_bytes),
            self.target.name,
            trainer.batch_size,
            trainer.accum_steps,
            trainer.precision,
            self.budget_bytes,
            self.margin,
            self.margin_why,
            self.devices,
            found.seconds,
        )

    def largest(
        self,
        *,
        precision: str = "fp32",
        accum_steps: int = 1,
        max_batch_size: int = 4096,
    ) -> Prediction | None:
        """The largest micro-batch (per device, at most `max_batch_size`) whose step fits
        the budget with the margin, as the fit report reads its column (every smaller batch
        fits too); None when a batch of 1 does not. Peaks grow with the batch, so it doubles
        then bisects: about 2 log2(batch) predictions.

        Raises:
            ValueError: no budget to fit (on the CPU, give `budget`).
        """
        self._need_budget("largest_batch")
        _check_count("max_batch_size", max_batch_size)

        def fitting(b: int) -> Prediction | None:
            found = self.predict(b, accum_steps=accum_steps, precision=precision)
            return found if found.fits else None

        best, low, high = None, 1, None
        size = 1
        while size <= max_batch_size:  # doubling: 1, 2, 4, ... until one does not fit
            found = fitting(size)
            if found is None:
                high = size
                break
            best, low = found, size
            size *= 2
        if best is None:
            return None
        high = high or max_batch_size + 1
        while high - low > 1:  # fits at low, not at high
            mid = (low + high) // 2
            found = fitting(mid)
            low, high, best = (mid, high, found) if found else (low, mid, best)
        return best

    def keeping(self, per_device: int, precision: str = "fp32") -> Prediction | None:
        """The largest micro-batch dividing `per_device` (samples per device per optimizer
        step) whose step fits, with the accumulation that keeps `per_device`: what to train
        with to keep an effective batch. None when one sample does not fit. The rule a
        study's derived accumulation uses (train/memory/fitting.py largest_fitting_batch).

        Raises:
            ValueError: no budget to fit (on the CPU, give `budget`).
        """
        self._need_budget("keeping an effective batch")
        _check_count("per_device", per_device)
        reason = self.unsupported(precision)
        if reason is not None:
            raise ValueError(f"precision={precision!r}: {reason}")
        trainer = self._trainer(per_device, 1, precision)
        assert self.budget_bytes is not None
        found = largest_fitting_batch(
            self.predictor, trainer, trainer.global_batch_size, self.budget_bytes, self.margin
        )
        if found is None:
            return None
        size, peak = found
        return self._public(
            peak, dataclasses.replace(trainer, batch_size=size, accum_steps=per_device // size)
        )

    def _need_budget(self, what: str) -> None:
        if self.budget_bytes is None:
            raise ValueError(
                f"{what} needs a budget: give budget='8GiB' (or bytes), or gpu='A100-40GB'"
            )

    def _breakdown(self, peak_bytes: int, tensor_bytes: int) -> Breakdown:
        model = self.predictor.model
        params = list(model.parameters())
        shard = self.devices if self.strategy == "fsdp" else 1
        weights = math.ceil(storage_bytes([*params, *model.buffers()]) / shard)
        trainable = [p for p in params if p.requires_grad]
        gradients = math.ceil(storage_bytes(trainable) / shard) + sum(self.predictor.bucket_sizes)
        state = self.predictor.state_bytes or weights + gradients
        optimizer_state = max(0, state - weights - gradients)
        workspaces = 0
        if self.target.type == "cuda" and self.target.capability is not None:
            workspaces = sum(cublas_workspaces(self.target.capability, training=True))
        activations = max(0, tensor_bytes - weights - gradients - optimizer_state)
        allocator = peak_bytes - weights - gradients - optimizer_state - activations - workspaces
        if allocator < 0:  # the workspaces were counted inside the limit's live peak
            workspaces, allocator = max(0, workspaces + allocator), 0
        return Breakdown(weights, gradients, optimizer_state, activations, workspaces, allocator)


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: give an integer >= 1")


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: give one of {', '.join(choices)}")


def predict_peak(
    model: nn.Module,
    batch: Any,
    *,
    batch_size: int | None = None,
    accum_steps: int = 1,
    precision: str = "fp32",
    **settings: Any,
) -> Prediction:
    """The predicted peak memory of one training step of `model` on `batch`.

    Args:
        model: the model (any device, the meta device included); it is not changed.
        batch: one example batch, as the step receives it (see StepPredictor).
        batch_size: samples per micro-batch per device (default: the batch's own).
        accum_steps: micro-batches per optimizer step.
        precision: "fp32", "tf32", "bf16" or "fp16" (autocast; fp16 with a GradScaler).
        **settings: StepPredictor's keywords: optimizer, loss, forward, task, gpu, budget,
            margin, strategy, devices, grad_clip_norm.

    Returns:
        The Prediction: `peak_bytes`, its `breakdown`, and whether it `fits` the budget.

    Raises:
        ValueError: an argument out of its range.
        TypeError: an optimizer, loss or batch of the wrong kind.
        PredictionUnsupported: the model does not run on fake tensors.
    """
    step = StepPredictor(model, batch, **settings)
    return step.predict(batch_size, accum_steps=accum_steps, precision=precision)


def largest_batch(
    model: nn.Module,
    batch: Any,
    *,
    precision: str = "fp32",
    accum_steps: int = 1,
    max_batch_size: int = 4096,
    **settings: Any,
) -> Prediction | None:
    """The largest micro-batch per device whose step fits the budget with the margin.

    Args:
        model: the model (any device, the meta device included); it is not changed.
        batch: one example batch, as the step receives it (see StepPredictor).
        precision: "fp32", "tf32", "bf16" or "fp16".
        accum_steps: micro-batches per optimizer step.
        max_batch_size: the largest batch tried.
        **settings: StepPredictor's keywords (gpu, budget, optimizer, loss, ...).

    Returns:
        The Prediction at that batch size, or None when not even a batch of 1 fits.

    Raises:
        ValueError: no budget (on the CPU without `budget`), or an argument out of range.
        PredictionUnsupported: the model does not run on fake tensors.
    """
    step = StepPredictor(model, batch, **settings)
    return step.largest(precision=precision, accum_steps=accum_steps, max_batch_size=max_batch_size)


__all__ = [
    "Breakdown",
    "Prediction",
    "PredictionUnsupported",
    "StepPredictor",
    "largest_batch",
    "predict_peak",
]
