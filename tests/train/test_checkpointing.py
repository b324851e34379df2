"""Activation checkpointing (`trainer.activation_checkpointing=blocks`): the same training for
less memory, predicted as exactly as without it on CPU, searchable, and shown by the fit
report."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchfit.common.checks import ConfigError
from batchfit.search.fit.layouts import fit_reports
from batchfit.search.study.validate import validate
from batchfit.train import checkpointing
from batchfit.train.build import build_task
from batchfit.train.config import TrainerConfig
from batchfit.train.models import resnet18
from batchfit.train.plan import plan
from batchfit.train.run import run
from batchfit.train.workload import Workloads

GPT = [
    "+experiment=gpt",
    "data.max_bytes=20000",
    "data.seq_len=64",
    "trainer.batch_size=16",
    "trainer.max_steps=4",
    "trainer.device=cpu",
    "search.memory_budget=null",
]


@pytest.mark.parametrize("mode", ["none", "blocks"])
def test_prediction_is_the_measured_peak(hydra_conf, mode: str) -> None:
    cfg = hydra_conf([*GPT, f"trainer.activation_checkpointing={mode}"])
    spec = plan(cfg, None)
    workload = Workloads().of(cfg)
    predicted = workload.predict(spec, cfg.optimizer).peak_bytes
    assert predicted == run(cfg, spec, workload=workload).peak_bytes


def test_blocks_train_the_same_model_for_less_memory(hydra_conf) -> None:
    results = {}
    workloads = Workloads()  # one data set; a predictor per mode
    for mode in ("none", "blocks"):
        cfg = hydra_conf([*GPT, f"trainer.activation_checkpointing={mode}"])
        spec = plan(cfg, None)
        workload = workloads.of(cfg)
        predicted = workload.predict(spec, cfg.optimizer).peak_bytes
        results[mode] = (predicted, run(cfg, spec, workload=workload))
    (peak_none, plain), (peak_blocks, checkpointed) = results["none"], results["blocks"]
    assert peak_blocks < 0.8 * peak_none  # the two blocks' activations are not kept
    # Recomputed activations are the same numbers: the same losses and validation.
    assert checkpointed.train_loss == pytest.approx(plain.train_loss, rel=1e-6)
    assert checkpointed.val == pytest.approx(plain.val, rel=1e-6)


def test_resnet_blocks_are_wrapped() -> None:
    model = resnet18(num_classes=10, in_channels=3)
    assert checkpointing.apply(model, "blocks") == 8  # 4 stages x 2 BasicBlocks
    assert checkpointing.apply(resnet18(num_classes=10), "none") == 0
    out = model(torch.randn(2, 3, 8, 8))
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_model_names_its_own_blocks_or_is_refused() -> None:
    class Stack(nn.Module):
        def __init__(self, blocks: type[nn.Module] | None):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
            if blocks is not None:
                self.checkpoint_blocks = (blocks,)

        def forward(self, x):
            return self.layers(x)

    assert checkpointing.apply(Stack(nn.Linear), "blocks") == 2
    with pytest.raises(ValueError, match="give the model a `checkpoint_blocks` attribute"):
        checkpointing.apply(Stack(None), "blocks")


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="trainer.activation_checkpointing must be one of none"):
        TrainerConfig(activation_checkpointing="full")


def test_searched_checkpointing_gets_a_fit_report_each(hydra_conf, tmp_path) -> None:
    overrides = [
        *GPT[:2],  # seq_len 128: fp32 fits batch 32 and bf16 64 without checkpointing
        "trainer.device=cpu",
        f"search.storage=sqlite:///{tmp_path}/o.db",
        '++search.params={trainer.activation_checkpointing:"choice(none,blocks)"}',
    ]
    cfg = hydra_conf(overrides)
    checked = validate(cfg, "ckpt", lambda extra: hydra_conf([*overrides, *extra]), False)
    assert build_task(cfg).unit == "tokens"
    reports = fit_reports(cfg, checked.space, checked.spec, checked.settings)
    # One report per checkpointing mode x searched seq_len (the experiment's 64, 128, 256).
    by_layout = {(r.checkpointing, r.at["data.seq_len"]): r for r in reports}
    assert sorted(by_layout) == sorted(
        (mode, seq_len) for mode in ("none", "blocks") for seq_len in (64, 128, 256)
    )
    none, blocks = by_layout["none", 128], by_layout["blocks", 128]
    # Under the experiment's 160 MiB, checkpointing fits a larger batch in each precision.
    for precision in none.precisions:
        assert (blocks.largest(precision, 1) or 0) > (none.largest(precision, 1) or 0)
    assert set(none.rows()["activation_checkpointing"]) == {"none"}
