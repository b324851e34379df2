"""Lightning: the batch size predicted to fit, set before the first step, instead of tried
until CUDA runs out of memory.

    from batchfit.lightning import PredictedBatchSize
    trainer = Trainer(accelerator="gpu", precision="bf16-mixed", accumulate_grad_batches=4,
                      callbacks=[PredictedBatchSize()])
    trainer.fit(module, datamodule)   # batch_size and accumulation set before step 0

At `on_fit_start` (the module set up, its optimizer built, nothing trained) the callback
predicts the module's own step (its `training_step` and the optimizer `configure_optimizers`
gave, on one batch of its own train dataloader) on fake tensors, for the card it trains on (or
one named: `gpu="A100-40GB"`), per rank under DDP. By default it keeps the effective batch the
run asks for (`batch_size x accumulate_grad_batches x ranks`): the micro-batch becomes the
largest divisor of the per-rank batch that fits, and accumulation makes up the rest. Lightning's
own `BatchSizeFinder` doubles the batch until an OOM instead, on one device only, and leaves
the accumulation as it was. `print_fit_table(module)` prints the fit report of a module.

Install with `pip install "batchfit[lightning]"`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.parsing import (
    lightning_getattr,
    lightning_hasattr,
    lightning_setattr,
)

from batchfit.prediction import Prediction, StepPredictor
from batchfit.table import BATCH_SIZES, FitTable, tabulate

# Lightning's precision setting -> batchfit's (autocast with fp32 weights)
PRECISIONS = {
    "32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16",
}  # fmt: skip


def step_of(module: pl.LightningModule, batch_index: int = 0) -> dict[str, Any]:
    """StepPredictor's forward and loss for a LightningModule's own `training_step`: its
    output is the loss, or a dict holding it under "loss". On the prediction's copy of the
    module, `self.log` is a no-op (the copy is attached to no Trainer)."""

    def forward(model: pl.LightningModule, batch: Any) -> Any:
        with warnings.catch_warnings():  # "self.log() ... not registered": the copy's
            warnings.simplefilter("ignore")
            return model.training_step(batch, batch_index)

    def loss(output: Any, batch: Any) -> Any:
        found = output.get("loss") if isinstance(output, dict) else output
        if found is None:
            raise TypeError(
                "training_step returned no loss (manual optimization?): batchfit predicts "
                "automatic optimization's step, which needs the loss or {'loss': ...}"
            )
        return found

    return {"forward": forward, "loss": loss}


def _precision_of(trainer: pl.Trainer) -> str:
    setting = str(trainer.precision)
    if setting not in PRECISIONS:
        raise ValueError(
            f"Trainer(precision={setting!r}): batchfit predicts {', '.join(PRECISIONS)}; "
            "drop PredictedBatchSize for this run, or train with precision='bf16-mixed'"
        )
    return PRECISIONS[setting]


def _strategy_of(trainer: pl.Trainer) -> tuple[str, int]:
    ranks = trainer.world_size
    if ranks == 1:
        return "none", 1
    name = type(trainer.strategy).__name__.lower()
    return ("fsdp" if "fsdp" in name else "ddp"), ranks


def _example(trainer: pl.Trainer, module: pl.LightningModule) -> Any:
    """One batch of the run's train dataloader (its shapes, not its values, matter)."""
    source = trainer.datamodule if trainer.datamodule is not None else module
    return next(iter(source.train_dataloader()))


class PredictedBatchSize(pl.Callback):
    """Sets the batch size (and the accumulation) predicted to fit, before the first step.

    Args:
        gpu: a card of batchfit's table to fit ("A100-40GB"); default the device trained
            on (its own GPU, or the CPU).
        budget: the memory a rank may use (bytes, "40GiB", "90%", "usable"); default what
            the GPU offers a process; on the CPU it must be given.
        margin: the share of the peak kept free (default: the measured error of the kind of
            step, 5% where unmeasured).
        batch_arg_name: the attribute holding the batch size, on the module, its hparams or
            the datamodule (as Lightning's BatchSizeFinder finds it).
        keep_effective_batch: keep batch_size x accumulate_grad_batches (the largest of its
            divisors that fits becomes the micro-batch); False: the largest batch that fits,
            up to `max_batch_size`, with the accumulation left as it is.
        max_batch_size: the largest micro-batch tried when not keeping the effective batch.

    After `fit` starts, `prediction` holds the step set (peak, breakdown, fits) and
    `accumulate_grad_batches` the accumulation.

    Raises:
        ValueError: the run's precision is not one batchfit predicts; no batch fits.
        AttributeError: the batch size is found on neither the module nor the datamodule.
    """

    def __init__(
        self,
        gpu: str | None = None,
        budget: int | str | None = None,
        margin: float | None = None,
        batch_arg_name: str = "batch_size",
        keep_effective_batch: bool = True,
        max_batch_size: int = 4096,
    ):
        self.gpu, self.budget, self.margin = gpu, budget, margin
        self.batch_arg_name = batch_arg_name
        self.keep_effective_batch, self.max_batch_size = keep_effective_batch, max_batch_size
        self.prediction: Prediction | None = None
        self.accumulate_grad_batches: int | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise AttributeError(
                f"batch_arg_name={self.batch_arg_name!r} is on neither the module, its hparams "
                "nor the datamodule; name the attribute the train dataloader reads"
            )
        asked = int(lightning_getattr(pl_module, self.batch_arg_name))
        accumulation = int(trainer.accumulate_grad_batches)
        step = self.predictor(trainer, pl_module)
        precision = _precision_of(trainer)
        if self.keep_effective_batch:
            found = step.keeping(asked * accumulation, precision)
        else:
            found = step.largest(
                precision=precision, accum_steps=accumulation, max_batch_size=self.max_batch_size
            )
        if found is None:
            raise ValueError(
                f"no batch of this module fits {step.budget_bytes} bytes on {step.target.name} "
                f"in {precision}, not even 1 sample: see batchfit.lightning.print_fit_table"
            )
        lightning_setattr(pl_module, self.batch_arg_name, found.batch_size)
        trainer.accumulate_grad_batches = found.accum_steps
        self.prediction, self.accumulate_grad_batches = found, found.accum_steps
        pl.utilities.rank_zero_info(
            f"batchfit: {self.batch_arg_name}={found.batch_size}, accumulate_grad_batches="
            f"{found.accum_steps} (asked {asked} x {accumulation}): {found}"
        )

    def predictor(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> StepPredictor:
        """The module's step, predicted on its own batch and optimizer for this run."""
        strategy, ranks = _strategy_of(trainer)
        return StepPredictor(
            pl_module,
            _example(trainer, pl_module),
            optimizer=trainer.optimizers[0] if trainer.optimizers else None,
            gpu=self.gpu,
            budget=self.budget,
            margin=self.margin,
            strategy=strategy,
            devices=ranks,
            leave_out=[trainer],  # the copy is attached to no Trainer
            **step_of(pl_module),
        )


def print_fit_table(
    module: pl.LightningModule,
    datamodule: pl.LightningDataModule | None = None,
    *,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    precisions: Sequence[str] = ("fp32", "bf16"),
    accum_steps: Sequence[int] = (1,),
    **settings: Any,
) -> FitTable:
    """Print (and return) the fit report of a LightningModule's own step: its
    `training_step` on one batch of the datamodule's (else its own) train dataloader, with
    the optimizer its `configure_optimizers` returns.

    Args:
        module: the LightningModule; it is not changed.
        datamodule: where the train dataloader comes from (default: the module).
        batch_sizes: the table's rows (samples per micro-batch per device).
        precisions: its columns: any of "fp32", "tf32", "bf16", "fp16".
        accum_steps: micro-batches per optimizer step, a block of rows each.
        **settings: StepPredictor's keywords: gpu, budget, margin, strategy, devices.

    Returns:
        The FitTable printed.
    """
    source = datamodule if datamodule is not None else module
    batch = next(iter(source.train_dataloader()))
    optimizers = module.configure_optimizers()
    optimizer = _first_optimizer(optimizers)
    step = StepPredictor(module, batch, optimizer=optimizer, **step_of(module), **settings)
    table = tabulate(step, batch_sizes, precisions, accum_steps)
    print(table.render())
    return table


def _first_optimizer(configured: Any) -> Any:
    """The optimizer of configure_optimizers' return: one, a list or tuple (of optimizers,
    or of them and schedulers), or a dict with "optimizer"."""
    while isinstance(configured, (list, tuple)) and configured:
        configured = configured[0]
    if isinstance(configured, dict):
        configured = configured["optimizer"]
    return configured
