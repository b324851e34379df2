"""Learning rate: batch-size scaling rules and schedules."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from batchfit.train.lr import constant, rule_for, scaled_lr, warmup_cosine
from batchfit.train.plan import plan, with_lr_reference


@pytest.mark.parametrize(
    ("rule", "batch", "ref", "expected"),
    [
        ("none", 1024, 256, 0.1),
        ("none", 16, 256, 0.1),
        ("linear", 256, 256, 0.1),
        ("linear", 1024, 256, 0.4),
        ("linear", 64, 256, 0.025),
        ("sqrt", 1024, 256, 0.2),
        ("sqrt", 64, 256, 0.05),
        ("sqrt", 256, 256, 0.1),
    ],
)
def test_scaled_lr(rule, batch, ref, expected):
    assert scaled_lr(0.1, batch, rule, ref) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("rule", ["cubic", "Linear", "", "log"])
def test_scaled_lr_unknown_rule(rule):
    with pytest.raises(ValueError, match=f"unknown learning-rate scaling rule {rule!r}"):
        scaled_lr(0.1, 64, rule, 256)


def _optimizer(lr: float = 0.5) -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=lr)


def _rates(make, total: int, lr: float = 0.5) -> list[float]:
    """The rate each optimizer step uses, stepping the schedule after each step as fit does."""
    optimizer = _optimizer(lr)
    scheduler = make(optimizer, total)
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    rates.append(optimizer.param_groups[0]["lr"])  # after the last step
    return rates


def test_constant():
    assert _rates(constant, 7) == [0.5] * 8


def test_warmup_cosine_shape():
    total, lr = 100, 0.5
    rates = _rates(lambda opt, n: warmup_cosine(opt, n, warmup_fraction=0.1), total, lr)
    warmup = 10
    # Linear warm-up from lr / warmup to lr.
    assert rates[0] == pytest.approx(lr / warmup)
    assert rates[:warmup] == pytest.approx([lr * (k + 1) / warmup for k in range(warmup)])
    # Peak at 1 (the full rate) after the warm-up ...
    assert rates[warmup - 1] == pytest.approx(lr)
    assert rates[warmup] == pytest.approx(lr)
    assert max(rates) == pytest.approx(lr)
    # ... then a monotone cosine decay ...
    decay = rates[warmup:]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    midpoint = warmup + (total - warmup) // 2
    assert rates[midpoint] == pytest.approx(lr / 2)
    # ... that ends near 0 at the last step and at 0 after it.
    assert rates[total - 1] == pytest.approx(0.0, abs=1e-3 * lr)
    assert rates[total] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("total", [1, 2, 5, 9])
def test_warmup_cosine_short_runs(total):
    # Fewer than 10 steps: a single warm-up step, already at the full rate, then a monotone
    # decay that reaches 0 once the run is over (the last step itself still uses a rate > 0).
    rates = _rates(warmup_cosine, total)
    used = rates[:total]
    assert used[0] == pytest.approx(0.5)
    assert all(0 < r <= 0.5 + 1e-12 for r in used)
    assert all(a >= b for a, b in zip(used, used[1:], strict=False))
    if total >= 2:
        assert rates[total] == pytest.approx(0.0, abs=1e-12)


def test_warmup_cosine_factor_formula():
    optimizer = _optimizer(1.0)
    scheduler = warmup_cosine(optimizer, 20, warmup_fraction=0.25)  # 5 warm-up steps
    factor = scheduler.lr_lambdas[0]
    assert [factor(s) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    for step in range(5, 21):
        progress = (step - 5) / 15
        assert factor(step) == pytest.approx(0.5 * (1 + math.cos(math.pi * progress)))
    assert factor(1000) == pytest.approx(0.0)  # clamped past the end


@pytest.mark.parametrize(
    ("target", "rule"),
    [
        ("torch.optim.SGD", "linear"),
        ("torch.optim.AdamW", "sqrt"),
        ("torch.optim.Adam", "sqrt"),
        ("torch.optim.NAdam", "sqrt"),
        ("bitsandbytes.optim.PagedAdamW8bit", "sqrt"),
        ("transformers.optimization.Adafactor", "sqrt"),
        ("torch.optim.RMSprop", "none"),
        ("", "none"),
    ],
)
def test_auto_takes_the_optimizers_rule(target, rule):
    assert rule_for(target) == rule


def test_a_run_uses_its_rate_as_given_and_a_study_fixes_the_reference(hydra_conf):
    """`auto` resolves by the optimizer; without a reference batch a run's own global batch
    is it (the rate as given); a study fixes the reference at the command line's batch, so
    that every geometry trains at the rate its rule scales it to."""
    cfg = hydra_conf(["optimizer=adamw", "optimizer.lr=0.001", "trainer.batch_size=16"])
    spec = plan(cfg, None)
    assert (spec.lr_rule, spec.lr_ref, spec.lr) == ("sqrt", 16, 0.001)
    overrides = with_lr_reference(cfg, ["trainer.batch_size=16", "trainer.accum_steps=2"])
    assert overrides[-1] == "trainer.lr_ref_batch_size=16"  # the config's 16 x 1
    trial = hydra_conf(["optimizer=adamw", "optimizer.lr=0.001", *overrides])
    trial_spec = plan(trial, None)  # 16 x 2 = 32: twice the reference
    assert trial_spec.lr == pytest.approx(0.001 * math.sqrt(2))
    sgd = hydra_conf(["trainer.batch_size=16", "trainer.lr_ref_batch_size=64"])
    assert with_lr_reference(sgd, ["x=1"]) == ["x=1"]  # a reference given is kept
    assert plan(sgd, None).lr == pytest.approx(sgd.optimizer.lr / 4)  # linear for SGD
    none = hydra_conf(["trainer.lr_scaling=none"])
    assert with_lr_reference(none, []) == []  # no rule: nothing to fix
    searched = with_lr_reference(none, [], ["trainer.lr_scaling"])
    assert searched == [f"trainer.lr_ref_batch_size={none.trainer.batch_size}"]
