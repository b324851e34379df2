"""batchfit.lightning's reading of a Trainer: one rank's step under DDP (Lightning's FSDP
needs a GPU, its name read the same way), the
precisions it predicts, and the step it predicts for a module (docs/python.md trains one)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

import batchfit  # noqa: E402
from batchfit.lightning import PredictedBatchSize, _precision_of, _strategy_of  # noqa: E402


class Classifier(pl.LightningModule):
    def __init__(self, batch_size: int = 64):
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):  # noqa: ANN201
        data = TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
        return DataLoader(data, batch_size=self.batch_size)


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [("auto", ("none", 1)), ("ddp", ("ddp", 2)), ("ddp_spawn", ("ddp", 2))],
)
def test_a_data_parallel_trainer_is_predicted_per_rank(strategy: str, expected: tuple) -> None:
    devices = 1 if strategy == "auto" else 2
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False)
    assert _strategy_of(trainer) == expected


def test_the_callbacks_step_is_one_ranks_ddp_step() -> None:
    """Under DDP the callback predicts what the API predicts for strategy="ddp": one rank's
    step with the gradient buckets beside it."""
    module = Classifier()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    step = PredictedBatchSize(budget="64MiB").predictor(trainer, module)
    batch = next(iter(module.train_dataloader()))
    direct = batchfit.predict_peak(
        module.net, batch[0], loss=lambda out, b: out.sum(), budget="64MiB",
        strategy="ddp", devices=2,
    )  # fmt: skip
    ours = step.predict(64)
    assert (step.strategy, step.devices) == ("ddp", 2)
    assert ours.breakdown.gradients_bytes == direct.breakdown.gradients_bytes  # buckets too
    assert ours.breakdown.gradients_bytes > sum(p.numel() * 4 for p in module.parameters())


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_a_precision_batchfit_does_not_predict_is_refused_in_one_line(precision: str) -> None:
    trainer = pl.Trainer(accelerator="cpu", precision=precision, logger=False)
    with pytest.raises(ValueError, match=rf"Trainer\(precision='{precision}'\): batchfit predicts"):
        _precision_of(trainer)


def test_mixed_precisions_are_batchfits() -> None:
    # (16-mixed is bf16-mixed on a CPU: Lightning changes it, saying so)
    for setting, ours in (("32-true", "fp32"), ("bf16-mixed", "bf16")):
        trainer = pl.Trainer(accelerator="cpu", precision=setting, logger=False)
        assert _precision_of(trainer) == ours
