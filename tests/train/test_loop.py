"""The training loop: accumulation, low precision, step planning, fit end to end, hooks."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchfit.tracking.metrics import (
    THROUGHPUT_SAMPLES,
    THROUGHPUT_SPREAD,
    TRAIN_LOSS,
    TRAIN_LR,
    TRAIN_S,
    VAL_ACC,
    VAL_LOSS,
)
from batchfit.train import loop
from batchfit.train.batches import samples_planned, steps_plan
from batchfit.train.config import TrainerConfig
from batchfit.train.data import Splits, synthetic
from batchfit.train.loop import Run, fit
from batchfit.train.lr import constant
from batchfit.train.measure.evaluate import evaluate, probe_seconds_per_sample
from batchfit.train.measure.memory import MemoryMeter
from batchfit.train.models import small_cnn
from batchfit.train.precision import Precision
from batchfit.train.step import Diverged, Hooks, memory_steps, optimizer_step

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# --------------------------------------------------------------------------- helpers


def _batch(n: int = 8, features: int = 6, classes: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=gen)
    y = torch.randint(0, classes, (n,), generator=gen)
    return x, y


def _linear(features: int = 6, classes: int = 4, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(features, classes)


def _sgd_step(model: nn.Module, micro, precision: str = "fp32", clip: float | None = None):
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    prec = Precision(precision, "cpu")
    scaler = prec.grad_scaler()
    loss = optimizer_step(model, optimizer, scaler, prec, micro, clip)
    return loss, scaler


def _chunks(x: torch.Tensor, y: torch.Tensor, sizes: list[int]):
    assert sum(sizes) == len(y)
    return list(zip(x.split(sizes), y.split(sizes), strict=True))


class DtypeRecorder(nn.Module):
    """A linear layer that remembers the dtype its matmul produced (autocast's choice)."""

    def __init__(self, features: int = 6, classes: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(features, classes)
        self.dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x.flatten(1))
        self.dtypes.append(out.dtype)
        return out


def _splits(num_samples: int = 190, seed: int = 0) -> Splits:
    # 1x4x4 images, 3 well-separated classes: learnable in a few SGD steps.
    # num_samples=190 -> 38 validation, 152 training samples.
    return synthetic(
        num_samples=num_samples, num_classes=3, channels=1, image_size=4, noise=0.5, seed=seed
    )


def _flat_linear(data: Splits, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    features = data.train_x[0].numel()
    return nn.Sequential(nn.Flatten(), nn.Linear(features, data.num_classes))


def _fit(model, data, cfg, hooks=None, lr=0.1, budget=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    _, num_steps = steps_plan(len(data.train_y), cfg)
    scheduler = constant(optimizer, num_steps)
    meter = MemoryMeter(CPU, budget)
    return fit(Run(model, optimizer, scheduler, data, cfg, CPU, meter, hooks or Hooks()))


class Recorder:
    """Hooks that record every call, in order."""

    def __init__(self):
        self.events: list[tuple] = []

    def hooks(self) -> Hooks:
        return Hooks(
            on_probe=lambda seconds, samples: self.events.append(("probe", seconds, samples)),
            on_step=lambda step, total, elapsed: self.events.append(("step", step, total, elapsed)),
            on_log=lambda step, metrics: self.events.append(("log", step, dict(metrics))),
            on_eval=lambda step, metrics: self.events.append(("eval", step, dict(metrics))),
        )

    def of(self, kind: str) -> list[tuple]:
        return [e for e in self.events if e[0] == kind]


# --------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize(
    "sizes", [[8], [4, 4], [1] * 8, [3, 5], [5, 3], [2, 1, 5]], ids=lambda s: "+".join(map(str, s))
)
def test_accumulated_step_equals_full_batch_sgd_step(sizes):
    x, y = _batch()
    # Reference: one plain SGD step (lr=1) on the full-batch mean loss, computed by hand.
    reference = _linear()
    full_loss = F.cross_entropy(reference(x), y)
    grads = torch.autograd.grad(full_loss, list(reference.parameters()))
    expected = [p.detach() - g for p, g in zip(reference.parameters(), grads, strict=True)]

    model = _linear()
    loss, _ = _sgd_step(model, _chunks(x, y, sizes))

    for param, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.detach(), want, rtol=0, atol=1e-6)
    # The returned loss is the step's mean loss, whatever the micro-batch split.
    torch.testing.assert_close(loss, full_loss.detach(), rtol=0, atol=1e-6)
    # Gradients are released after the step (set_to_none).
    assert all(p.grad is None for p in model.parameters())


def test_two_by_four_equals_eight_by_one_equals_ragged():
    x, y = _batch()
    results = {}
    for name, sizes in {"2x4": [4, 4], "8x1": [1] * 8, "3+5": [3, 5], "8": [8]}.items():
        model = _linear()
        loss, _ = _sgd_step(model, _chunks(x, y, sizes))
        results[name] = (loss, [p.detach().clone() for p in model.parameters()])
    base_loss, base_params = results["8"]
    for name, (loss, params) in results.items():
        torch.testing.assert_close(loss, base_loss, rtol=0, atol=1e-6, msg=name)
        for got, want in zip(params, base_params, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
    # ...and the step actually moved the parameters.
    assert not torch.allclose(base_params[0], _linear().weight.detach())


def test_batchnorm_sees_micro_batch_statistics_so_accumulation_is_not_equivalent():
    """Expected, documented difference: BatchNorm normalises each micro-batch by its own
    statistics, so 2x4 is not the same step as 1x8 (the linear case above is)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 4, 4, generator=gen)
    y = torch.randint(0, 4, (8,), generator=gen)

    def step(sizes):
        torch.manual_seed(0)
        model = small_cnn(num_classes=4, in_channels=3, width=4)
        _sgd_step(model, _chunks(x, y, sizes))
        return [p.detach().clone() for p in model.parameters()]

    one, two = step([8]), step([4, 4])
    assert any(not torch.allclose(a, b, atol=1e-5) for a, b in zip(one, two, strict=True))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_grad_clipping_clips_the_true_gradient(precision):
    # Plain SGD with lr=1: the update is -grad, so its norm is the clipped gradient norm.
    # Under fp16 the scaler must unscale before clipping, else the update would be
    # clip / loss_scale (65536 times too small).
    x, y = _batch()
    model = DtypeRecorder()
    before = [p.detach().clone() for p in model.parameters()]
    clip = 1e-3
    _sgd_step(model, [(x, y)], precision=precision, clip=clip)
    deltas = [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]
    update_norm = torch.linalg.vector_norm(torch.cat([d.flatten() for d in deltas]))
    assert update_norm.item() == pytest.approx(clip, rel=1e-3)


# --------------------------------------------------------------------------- precision


@pytest.mark.parametrize(
    ("precision", "dtype", "scaled"),
    [("bf16", torch.bfloat16, False), ("fp16", torch.float16, True)],
)
def test_low_precision_step_on_cpu(precision, dtype, scaled):
    x, y = _batch()
    model = DtypeRecorder()
    before = [p.detach().clone() for p in model.parameters()]
    loss, scaler = _sgd_step(model, _chunks(x, y, [3, 5]), precision=precision)

    assert model.dtypes == [dtype, dtype]  # autocast ran each micro-batch in low precision
    assert torch.isfinite(loss)
    assert loss.dtype == torch.float32  # the loss itself is computed in fp32
    assert scaler.is_enabled() is scaled
    # Master weights stay fp32 and were updated.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(
        not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters(), strict=True)
    )
    # Close to the fp32 step (low-precision rounding only).
    reference = DtypeRecorder()
    ref_loss, _ = _sgd_step(reference, _chunks(x, y, [3, 5]))
    assert reference.dtypes == [torch.float32, torch.float32]
    assert loss.item() == pytest.approx(ref_loss.item(), abs=0.05)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("precision", "dtype", "scaled"),
    [
        ("fp32", torch.float32, False),
        ("bf16", torch.bfloat16, False),
        ("fp16", torch.float16, True),
    ],
)
def test_low_precision_step_on_cuda(precision, dtype, scaled):
    device = torch.device("cuda")
    x, y = _batch()
    x, y = x.to(device), y.to(device)
    model = DtypeRecorder().to(device)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    prec = Precision(precision, "cuda")
    scaler = prec.grad_scaler()
    loss = optimizer_step(model, optimizer, scaler, prec, _chunks(x, y, [3, 5]))
    assert model.dtypes == [dtype, dtype]
    assert torch.isfinite(loss).item()
    assert scaler.is_enabled() is scaled
    assert all(
        not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters(), strict=True)
    )


# --------------------------------------------------------------------------- planning


@pytest.mark.parametrize(
    ("num_train", "kwargs", "plan", "samples"),
    [
        # exact epochs
        (160, dict(batch_size=16, accum_steps=2, max_epochs=3), (5, 15), 480),
        # ragged last step: 152 = 4 * 32 + 24
        (152, dict(batch_size=16, accum_steps=2, max_epochs=3), (5, 15), 456),
        # max_steps cuts the second epoch after 2 of its 5 steps: 152 + 2 * 32
        (152, dict(batch_size=16, accum_steps=2, max_epochs=3, max_steps=7), (5, 7), 216),
        # max_steps cuts inside the ragged step's epoch, ending exactly on the ragged step
        (152, dict(batch_size=16, accum_steps=2, max_epochs=3, max_steps=10), (5, 10), 304),
        # max_steps larger than the epoch budget: epochs win
        (152, dict(batch_size=16, accum_steps=2, max_epochs=1, max_steps=100), (5, 5), 152),
        # only a step budget
        (10, dict(batch_size=4, max_epochs=None, max_steps=7), (3, 7), 10 + 10 + 4),
        # effective batch larger than the data set: one (partial) step per epoch
        (10, dict(batch_size=8, accum_steps=4, max_epochs=2), (1, 2), 20),
    ],
)
def test_steps_plan_and_samples_planned(num_train, kwargs, plan, samples):
    cfg = TrainerConfig(**kwargs)
    assert steps_plan(num_train, cfg) == plan
    assert samples_planned(num_train, cfg) == samples


# --------------------------------------------------------------------------- fit


def test_fit_end_to_end_results_and_hooks():
    data = _splits()  # 152 training samples
    cfg = TrainerConfig(batch_size=16, accum_steps=2, max_epochs=3, log_every_steps=4)
    steps_per_epoch, num_steps = steps_plan(len(data.train_y), cfg)
    assert (steps_per_epoch, num_steps) == (5, 15)
    rec = Recorder()
    model = _flat_linear(data)

    result = _fit(model, data, cfg, rec.hooks())

    assert result.num_steps == num_steps
    # Ragged last step (152 = 4 * 32 + 24): every sample counted exactly once per epoch.
    assert result.num_samples == 3 * len(data.train_y) == samples_planned(len(data.train_y), cfg)
    assert result.throughput_samples_per_sec > 0
    assert math.isfinite(result.throughput_samples_per_sec)
    assert result.step_ms > 0
    assert result.peak_bytes > 0  # CPU: accounted by the tracker
    assert result.reserved_bytes is None
    assert 0.0 <= result.val_acc <= 1.0
    assert result.val_acc > 0.8  # learnable data: well above chance (1/3)
    assert math.isfinite(result.val_loss) and result.val_loss > 0
    assert math.isfinite(result.train_loss)

    # on_probe once, first, with the number of samples the run will train on.
    probes = rec.of("probe")
    assert len(probes) == 1 and rec.events[0][0] == "probe"
    assert probes[0][1] > 0
    assert probes[0][2] == samples_planned(len(data.train_y), cfg)

    # on_step after every step, with increasing elapsed time.
    steps = rec.of("step")
    assert [s[1] for s in steps] == list(range(1, num_steps + 1))
    assert all(s[2] == num_steps for s in steps)
    elapsed = [s[3] for s in steps]
    assert elapsed == sorted(elapsed) and elapsed[0] >= 0

    # on_log every log_every_steps and at the last step.
    logs = rec.of("log")
    assert [s[1] for s in logs] == [4, 8, 12, 15]
    for _, _, metrics in logs:
        assert math.isfinite(metrics[TRAIN_LOSS])
        assert metrics[TRAIN_LR] == pytest.approx(0.1)
        # Logged steps are past the untimed first steps, so throughput is reported.
        assert metrics[THROUGHPUT_SAMPLES] > 0
    assert logs[-1][2][TRAIN_LOSS] == result.train_loss

    # on_eval at the end of each epoch, with the validation metrics.
    evals = rec.of("eval")
    assert [s[1] for s in evals] == [5, 10, 15]
    for (_, step, metrics), epoch in zip(evals, [1.0, 2.0, 3.0], strict=True):
        assert 0.0 <= metrics[VAL_ACC] <= 1.0
        assert metrics[VAL_LOSS] > 0
        assert metrics["step"] == step
        assert metrics["epoch"] == pytest.approx(epoch)
    assert result.evals == [e[2] for e in evals]
    assert result.val_acc == evals[-1][2][VAL_ACC]
    assert result.val_loss == evals[-1][2][VAL_LOSS]
    # The last evaluation is of the final model.
    again = evaluate(model, data, 7, Precision("fp32", "cpu"), CPU)
    assert again[VAL_ACC] == result.val_acc
    assert again[VAL_LOSS] == pytest.approx(result.val_loss, rel=1e-5)
    # Training helped.
    assert evals[-1][2][VAL_LOSS] < evals[0][2][VAL_LOSS]


def test_fit_max_steps_cuts_an_epoch():
    data = _splits()
    cfg = TrainerConfig(batch_size=16, accum_steps=2, max_epochs=3, max_steps=7)
    rec = Recorder()
    result = _fit(_flat_linear(data), data, cfg, rec.hooks())
    assert result.num_steps == 7
    assert result.num_samples == 152 + 2 * 32 == samples_planned(152, cfg)
    assert [e[1] for e in rec.of("eval")] == [5, 7]  # end of epoch 1, then the last step
    assert rec.of("eval")[-1][2]["epoch"] == pytest.approx(1 + 2 / 5)


def test_fit_val_every_steps():
    data = _splits()
    cfg = TrainerConfig(batch_size=32, max_epochs=2, val_every_steps=4, log_every_steps=3)
    rec = Recorder()
    result = _fit(_flat_linear(data), data, cfg, rec.hooks())
    assert result.num_steps == 10
    assert [e[1] for e in rec.of("eval")] == [4, 8, 10]
    assert [e[1] for e in rec.of("log")] == [3, 6, 9, 10]


def test_fit_is_deterministic_for_a_seed():
    data = _splits()
    cfg = TrainerConfig(batch_size=8, accum_steps=2, max_epochs=1, seed=3)
    models = [_flat_linear(data), _flat_linear(data)]
    results = [_fit(m, data, cfg) for m in models]
    assert results[0].train_loss == results[1].train_loss
    # Every figure of every validation but the seconds it took to get there.
    untimed = [[{k: v for k, v in e.items() if k != TRAIN_S} for e in r.evals] for r in results]
    assert untimed[0] == untimed[1] and len(untimed[0]) == 1
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


def test_fit_single_step_run():
    data = _splits()
    cfg = TrainerConfig(batch_size=200, max_steps=1, max_epochs=None)
    result = _fit(_flat_linear(data), data, cfg)
    assert result.num_steps == 1
    assert result.num_samples == len(data.train_y)
    assert result.step_ms > 0 and result.throughput_samples_per_sec > 0


class StopRun(Exception):
    pass


@pytest.mark.parametrize("hook", ["on_probe", "on_step", "on_log", "on_eval"])
def test_a_hook_raising_stops_the_run_and_propagates(hook):
    data = _splits()
    cfg = TrainerConfig(batch_size=32, max_epochs=3, log_every_steps=2)
    steps_seen: list[int] = []

    def raiser(*args):
        raise StopRun(hook)

    hooks = Hooks(on_step=lambda step, total, elapsed: steps_seen.append(step))
    setattr(hooks, hook, raiser)
    with pytest.raises(StopRun, match=hook):
        _fit(_flat_linear(data), data, cfg, hooks)
    # The run stopped at the first call of the raising hook.
    first_call = {"on_probe": [], "on_step": [], "on_log": [1, 2], "on_eval": [1, 2, 3, 4, 5]}
    assert steps_seen == first_call[hook]


def test_a_hook_can_stop_after_some_steps():
    data = _splits()
    cfg = TrainerConfig(batch_size=32, max_epochs=3)
    calls: list[int] = []

    def on_step(step, total, elapsed):
        calls.append(step)
        if step == 2:
            raise StopRun("pruned")

    with pytest.raises(StopRun):
        _fit(_flat_linear(data), data, cfg, Hooks(on_step=on_step))
    assert calls == [1, 2]


class NaNModel(nn.Module):
    def __init__(self, features: int, classes: int):
        super().__init__()
        self.lin = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.flatten(1)) * float("nan")


@pytest.mark.parametrize(("log_every", "step"), [(1, 1), (3, 3)])
def test_nan_loss_raises_diverged_at_the_first_check(log_every, step):
    data = _splits()
    cfg = TrainerConfig(batch_size=32, max_epochs=2, log_every_steps=log_every)
    steps_seen: list[int] = []
    hooks = Hooks(on_step=lambda s, total, elapsed: steps_seen.append(s))
    with pytest.raises(Diverged, match=f"at step {step}") as info:
        _fit(NaNModel(16, 3), data, cfg, hooks)
    assert info.value.step == step
    assert math.isnan(info.value.loss)
    assert steps_seen == list(range(1, step + 1))  # the run stopped at the check


def test_huge_learning_rate_diverges():
    # lr=1e38 drives the weights past float32's range within a step, so the logits hold inf
    # and the loss is NaN at step 2. (A merely large lr such as 1e6 does not diverge on this
    # separable data: cross-entropy stays finite for huge logits and the loss goes to 0.)
    data = _splits()
    cfg = TrainerConfig(batch_size=16, max_epochs=3, log_every_steps=1)
    with pytest.raises(Diverged) as info:
        _fit(_flat_linear(data), data, cfg, lr=1e38)
    assert info.value.step == 2
    assert not math.isfinite(info.value.loss)


def test_probe_leaves_parameters_buffers_and_gradients_as_found():
    data = synthetic(num_samples=40, num_classes=4, channels=3, image_size=6, seed=1)
    torch.manual_seed(0)
    model = small_cnn(num_classes=4, in_channels=3, width=4)
    params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    seconds = probe_seconds_per_sample(
        model, data, TrainerConfig(batch_size=8), Precision("fp32", "cpu"), CPU
    )
    assert seconds > 0
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters(), strict=True))
    # BatchNorm running statistics (and num_batches_tracked) untouched by the probe.
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_evaluate_counts_accuracy_over_ragged_batches():
    class Fixed(nn.Module):
        """Predicts class 0 for every sample: accuracy is the share of label 0."""

        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.tensor([5.0, 0.0, 0.0]))

        def forward(self, x):
            return self.bias.expand(len(x), 3)

    val_y = torch.tensor([0, 1, 0, 2, 0, 0, 1])
    data = Splits(torch.zeros(1, 1, 1, 1), torch.zeros(1, dtype=torch.int64),
                  torch.zeros(7, 1, 1, 1), val_y, 3)  # fmt: skip
    metrics = evaluate(Fixed(), data, 3, Precision("fp32", "cpu"), CPU)
    assert metrics[VAL_ACC] == pytest.approx(4 / 7)
    expected_loss = F.cross_entropy(torch.tensor([5.0, 0.0, 0.0]).expand(7, 3), val_y)
    assert metrics[VAL_LOSS] == pytest.approx(expected_loss.item(), rel=1e-6)


# --------------------------------------------------------------------------- the throughput clock


@pytest.mark.parametrize(
    ("warmup_steps", "first_timed", "timed_samples"),
    [
        # 152 training samples, effective batch 32: steps of 32, 32, 32, 32, 24 per epoch.
        # The CPU tracker measures steps 0 and 1 (the first full step with optimizer state):
        # with no warm-up the clock starts at step 2 -> steps 2..9 are timed:
        # 32 + 32 + 24 (epoch 1) + 152 (epoch 2) = 240 samples.
        (0, 2, 240),
        # Warm-up past the measured steps: steps 3..9 -> 32 + 24 + 152 = 208 samples.
        (3, 3, 208),
    ],
)
def test_the_clock_times_neither_memory_measured_nor_warm_up_steps(
    warmup_steps: int, first_timed: int, timed_samples: int
) -> None:
    data = _splits()
    # (without the noise scale's window of split steps, also off the clock: test_noise.py)
    cfg = TrainerConfig(
        batch_size=32, accum_steps=1, max_epochs=2, warmup_steps=warmup_steps, device="cpu",
        noise_scale_window=0,
    )  # fmt: skip
    assert memory_steps(len(data.train_y), cfg, 10) == [0, 1]
    result = _fit(_flat_linear(data), data, cfg)
    assert result.num_steps == 10
    assert result.timed_steps == 10 - first_timed
    assert result.timed_samples == timed_samples
    # The figures are the timed samples over the timed seconds, nothing else.
    assert result.throughput_samples_per_sec == pytest.approx(timed_samples / result.timed_seconds)
    assert result.step_ms == pytest.approx(1000 * result.timed_seconds / result.timed_steps)


def test_validation_is_not_on_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each validation sleeps SLEEP_S; the timed steps of this tiny linear model take a few
    milliseconds in all (tens under load), so a clock that ran through validation would
    read at least 2 x SLEEP_S (the validations after steps 2 and 3, both timed)."""
    sleep_s = 0.5
    real_evaluate = loop.evaluate

    def slow_evaluate(*args, **kwargs):  # noqa: ANN002, ANN003
        time.sleep(sleep_s)
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", slow_evaluate)
    data = _splits()
    cfg = TrainerConfig(
        batch_size=32, max_steps=4, max_epochs=None, val_every_steps=1, warmup_steps=0,
        device="cpu",
    )  # fmt: skip
    result = _fit(_flat_linear(data), data, cfg)
    assert len(result.evals) == 4 and result.timed_steps == 2
    assert result.timed_seconds < sleep_s, result.timed_seconds


def test_the_throughput_spread_is_over_the_timed_logging_intervals():
    data = _splits()
    # 152 samples / 8 = 19 steps an epoch, 2 epochs: 38 steps; warm-up 2; a log every 4;
    # the noise scale's window of split steps (off the clock) is steps 2-9.
    cfg = TrainerConfig(batch_size=8, max_epochs=2, log_every_steps=4, warmup_steps=2)
    result = _fit(_flat_linear(data), data, cfg)
    # Logs at steps 12, 16, ..., 36 and the last (38), past the untimed steps: 8 intervals.
    assert len(result.interval_rates) == 8 and all(r > 0 for r in result.interval_rates)
    rates = sorted(result.interval_rates)
    median = (rates[3] + rates[4]) / 2
    assert result.metrics()[THROUGHPUT_SPREAD] == pytest.approx((rates[-1] - rates[0]) / median)
    short = _fit(_flat_linear(data), data, TrainerConfig(batch_size=8, max_steps=6))
    assert THROUGHPUT_SPREAD not in short.metrics()  # one interval says nothing of it
