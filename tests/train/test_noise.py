"""The gradient noise scale (train/measure/noise.py) against the truth: per-sample gradients
computed
exactly with torch.func over the whole training set, at parameters that do not move (lr 0),
so the gradient's distribution is the same at every step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from tracking.metrics import GRAD_NOISE_SCALE, GRAD_SQ_NORM, GRAD_VARIANCE
from train.config import TrainerConfig
from train.data import Splits, synthetic
from train.loop import Run, fit, steps_plan
from train.lr import constant
from train.measure.noise import NoiseScale
from train.memory.budget import MemoryMeter

CPU = torch.device("cpu")


def _data() -> Splits:
    # 2500 samples, 2000 to train on: a batch of 64 is 3% of them, so sampling without
    # replacement changes a batch mean's variance by 3% at most.
    return synthetic(num_samples=2500, num_classes=4, channels=1, image_size=4, noise=2.0, seed=0)


def _model(data: Splits) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(data.train_x[0].numel(), data.num_classes))


def _truth(model: nn.Module, data: Splits) -> tuple[float, float]:
    """|G|² and tr(Σ) of the per-sample gradients over the training set."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (x.unsqueeze(0),))
        return F.cross_entropy(out, y.unsqueeze(0))

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, data.train_x, data.train_y)
    flat = torch.cat([g.flatten(1) for g in per_sample.values()], dim=1).double()
    mean = flat.mean(0)
    return float(mean.square().sum()), float((flat - mean).square().sum(1).mean())


def _fit_frozen(data: Splits, cfg: TrainerConfig):
    model = _model(data)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the parameters stay put
    _, num_steps = steps_plan(len(data.train_y), cfg)
    logged = []
    from train.loop import Hooks

    hooks = Hooks(on_log=lambda step, metrics: logged.append((step, metrics)))
    result = fit(Run(
        model, optimizer, constant(optimizer, num_steps), data, cfg, CPU,
        MemoryMeter(CPU, None), hooks,
    ))  # fmt: skip
    return model, result, logged


def test_the_estimator_converges_to_the_true_noise_scale():
    """Fed the gradients of many steps at a slow decay, both parts and their ratio land
    within 5% of the per-sample truth."""
    data = _data()
    model = _model(data)
    true_sq, true_var = _truth(model, data)
    noise = NoiseScale(model, CPU, "accumulation", decay=0.998)
    generator = torch.Generator().manual_seed(1)
    for _ in range(1500):
        idx = torch.randperm(len(data.train_y), generator=generator)[:64]
        x, y = data.train_x[idx], data.train_y[idx]
        model.zero_grad()
        noise.begin(16, 64, 64 / 16)
        F.cross_entropy(model(x[:16]), y[:16], reduction="sum").div(64).backward()
        noise.first_micro_batch()
        F.cross_entropy(model(x[16:]), y[16:], reduction="sum").div(64).backward()
        noise.step_end()
    reading = noise.read()
    assert reading.steps == 1500
    assert reading.grad_sq_norm == pytest.approx(true_sq, rel=0.05)
    assert reading.grad_variance == pytest.approx(true_var, rel=0.05)
    assert reading.noise_scale == pytest.approx(true_var / true_sq, rel=0.08)


@pytest.mark.parametrize(
    ("batch_size", "accum_steps", "estimator"),
    [(16, 4, "accumulation"), (64, 1, "split")],
)
def test_a_run_logs_the_noise_scale_it_measured(batch_size, accum_steps, estimator):
    """A run of 4 epochs logs stats/grad_noise_scale per logging interval and as a final
    figure, says which estimator measured it, and comes within a factor of 1.5 of the
    truth (about 10 steps' average at the default decay: a noisy estimate, seeded)."""
    data = _data()
    cfg = TrainerConfig(
        batch_size=batch_size, accum_steps=accum_steps, max_epochs=4, log_every_steps=5,
        device="cpu",
    )  # fmt: skip
    model, result, logged = _fit_frozen(data, cfg)
    true_sq, true_var = _truth(model, data)
    assert result.noise_estimator.startswith(f"{estimator}:")
    assert "over the trainable parameters" in result.noise_estimator
    final = result.metrics()[GRAD_NOISE_SCALE]
    assert true_var / true_sq / 1.5 < final < true_var / true_sq * 1.5
    intervals = [m for _, m in logged if GRAD_NOISE_SCALE in m]
    assert intervals and intervals[-1][GRAD_NOISE_SCALE] == final
    assert {GRAD_SQ_NORM, GRAD_VARIANCE} <= set(intervals[-1])


def test_the_split_window_stays_off_the_clock_and_trains_the_same_steps():
    """The split steps run a micro-batch as two halves: the same gradient (a linear model
    has no batch statistics), so the parameters end where an unmeasured run's do; they are
    not timed."""
    data = _data()
    base = dict(batch_size=64, accum_steps=1, max_epochs=1, device="cpu")
    measured, unmeasured = [], []
    for window, out in ((8, measured), (0, unmeasured)):
        cfg = TrainerConfig(**base, noise_scale_window=window)
        model = _model(data)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        _, num_steps = steps_plan(len(data.train_y), cfg)
        result = fit(Run(
            model, optimizer, constant(optimizer, num_steps), data, cfg, CPU,
            MemoryMeter(CPU, None),
        ))  # fmt: skip
        out += [result, [p.detach().clone() for p in model.parameters()]]
    (with_noise, params), (without, params0) = measured, unmeasured
    assert with_noise.num_steps == without.num_steps == 32
    assert without.noise_estimator == "none: trainer.noise_scale_window=0"
    assert GRAD_NOISE_SCALE not in without.metrics()
    assert with_noise.timed_steps == without.timed_steps - 8
    for a, b in zip(params, params0, strict=True):
        torch.testing.assert_close(a, b)


def test_too_short_a_run_says_why_it_has_no_estimate():
    data = _data()
    cfg = TrainerConfig(batch_size=512, accum_steps=1, max_epochs=1, device="cpu")
    _, result, _ = _fit_frozen(data, cfg)
    assert result.noise is None
    assert result.noise_estimator == "none: 4 steps are too few to measure it on"
