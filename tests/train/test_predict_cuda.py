"""The prediction for a CUDA device, on this machine without one (train/memory/predict.py with a
DeviceSpec of train/device/spec.py): the optimizer implementation CUDA runs, models built fake
from the start, the reserve under a limit, and `search.gpu` planning for a named card."""

from __future__ import annotations

import resource

import pytest
import torch
from torch import nn

from batchfit.common.checks import ConfigError
from batchfit.tracking.metrics import PREDICTED_BYTES, PREDICTED_RESERVED_BYTES, PREDICTION_ERROR
from batchfit.train.config import TrainerConfig
from batchfit.train.device.allocator_settings import AllocatorSettings
from batchfit.train.device.gpus import gpu
from batchfit.train.device.spec import DeviceSpec
from batchfit.train.measure.memory import MemoryStats
from batchfit.train.memory.predict import MemoryPredictor, Prediction, PredictionUnsupported
from batchfit.train.plan import plan, planned_elsewhere
from batchfit.train.run import memory_figures

CPU = torch.device("cpu")
A100 = gpu("A100-40GB")
PLANNED_A100 = DeviceSpec("cuda", A100.total_bytes, A100, AllocatorSettings(), local=False)
WIDTH, DEPTH = 256, 8
EXAMPLE = (torch.zeros(4, WIDTH), torch.zeros(4, dtype=torch.long))


def _stack() -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)))


def _sgd(params: list[nn.Parameter], **kwargs: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4, **kwargs)


def _trainer(batch: int = 4, precision: str = "fp32") -> TrainerConfig:
    return TrainerConfig(batch_size=batch, accum_steps=1, precision=precision)


# ---------------------------------------------------------------- the optimizer CUDA runs


def test_a_cuda_target_runs_the_foreach_optimizer_real_cuda_parameters_run() -> None:
    """torch.optim picks foreach only for `type(p) in (Tensor, Parameter)`: on FakeTensors
    it ran the for-loop path, which holds one weight-decayed gradient at a time where CUDA's
    foreach holds all of them at once."""
    cpu = MemoryPredictor(_stack, _sgd, EXAMPLE, CPU)
    cuda = MemoryPredictor(_stack, _sgd, EXAMPLE, PLANNED_A100)
    assert cpu.optimizer.param_groups[0]["foreach"] is False  # as on real CPU tensors
    assert cuda.optimizer.param_groups[0]["foreach"] is True  # as on real CUDA tensors
    weight = WIDTH * WIDTH * 4
    # The step is the peak at batch 4: the foreach step's grads + weight decay are all live.
    more = cuda.predict(_trainer(), 64).tensor_bytes - cpu.predict(_trainer(), 64).tensor_bytes
    assert more == (DEPTH - 1) * weight


def test_an_explicit_implementation_is_left_as_configured() -> None:
    loop = MemoryPredictor(_stack, lambda p: _sgd(p, foreach=False), EXAMPLE, PLANNED_A100)
    assert loop.optimizer.param_groups[0]["foreach"] is False


# ----------------------------------------------------------------- models built fake


def test_a_model_larger_than_this_machine_is_predicted_without_allocating_it() -> None:
    """4.3 billion fp32 weights (16 GiB; with gradients and momentum, 48 GiB): the builder
    runs under the predictor's fake mode, so the weights never exist."""
    side = 65536

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(side, side, bias=False))

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    predictor = MemoryPredictor(
        build, _sgd, (torch.zeros(2, side), torch.zeros(2, dtype=torch.long)), CPU
    )
    prediction = predictor.predict(_trainer(batch=2), 16)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    weights = side * side * 4
    assert prediction.peak_bytes >= 3 * weights  # weights, gradients, momentum
    assert grown < 2**30, f"the process grew by {grown / 2**30:.1f} GiB"


# ------------------------------------------------------------- the reserve under a limit


def test_the_reserve_under_the_runs_limit_is_what_max_memory_reserved_would_read() -> None:
    """memory/prediction_error compared the unlimited peak reserve with max_memory_reserved,
    which the limit caps when it binds (the allocator frees cached segments and retries):
    the prediction now carries the reserve under the run's limit."""
    predictor = MemoryPredictor(_stack, _sgd, EXAMPLE, PLANNED_A100)
    trainer = _trainer(batch=512)
    unlimited = predictor.predict(trainer, 4096, limit_bytes=None)
    assert unlimited.reserved_bytes is None  # no limit asked for
    roomy = predictor.predict(trainer, 4096, limit_bytes=A100.total_bytes)
    tight = predictor.predict(trainer, 4096, limit_bytes=unlimited.peak_bytes)
    assert roomy.peak_bytes == tight.peak_bytes == unlimited.peak_bytes  # the smallest limit
    assert tight.reserved_bytes <= unlimited.peak_bytes <= roomy.reserved_bytes
    measured = MemoryStats(peak_bytes=tight.tensor_bytes, reserved_bytes=tight.reserved_bytes)
    assert tight.error(measured) == 0.0


# ------------------------------------------------------------------------- search.gpu


def test_search_gpu_plans_for_a_card_this_machine_does_not_have(hydra_conf) -> None:  # noqa: ANN001
    spec = plan(hydra_conf(["search.gpu=A100-40GB"]), "90%")
    assert spec.device == CPU and spec.target.type == "cuda" and not spec.target.local
    assert spec.target.total_bytes == A100.total_bytes
    assert spec.budget_bytes == int(A100.total_bytes * 0.9)  # a share of the GPU's memory
    assert "does not have" in planned_elsewhere(spec)
    assert planned_elsewhere(plan(hydra_conf([]), None)) is None


def test_search_gpu_names_a_known_card(hydra_conf) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match=r"search\.gpu='?A100'? is ambiguous"):
        plan(hydra_conf(["search.gpu=A100"]), None)
    with pytest.raises(ConfigError, match=r"search\.gpu='?4090'? is not a known GPU"):
        plan(hydra_conf(["search.gpu=4090"]), None)  # an int in the config: not a crash
    # Every problem at once: the precision the card cannot run beside the budget it lacks.
    overrides = ["search.gpu=V100-16GB", "trainer.precision=bf16"]
    with pytest.raises(ConfigError) as raised:
        plan(hydra_conf(overrides), "1TiB")
    text = str(raised.value)
    assert "bf16 cannot run on V100-16GB" in text and "trainer.precision=fp32 or fp16" in text
    assert "search.memory_budget='1TiB'" in text and "that V100-16GB has" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_trainer_device_cuda_without_one_is_a_config_error(hydra_conf) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="trainer.device=cuda but no CUDA device is visible"):
        plan(hydra_conf(["trainer.device=cuda"]), "90%")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_builder_that_places_tensors_on_cuda_is_built_for_real() -> None:
    """Fake mode makes CUDA tensors without a GPU: such a build is not trusted, and the real
    one says what is wrong (no CUDA here)."""

    def build() -> nn.Module:
        model = _stack()
        model.register_buffer("scale", torch.ones(1, device="cuda"))
        return model

    with pytest.raises(PredictionUnsupported, match="NVIDIA driver|CUDA"):
        MemoryPredictor(build, _sgd, EXAMPLE, CPU)


@pytest.mark.gpu
def test_on_a_gpu_its_card_is_the_target_and_another_card_is_refused(hydra_conf) -> None:  # noqa: ANN001
    spec = plan(hydra_conf(["trainer.device=cuda"]), None)
    props = torch.cuda.get_device_properties(spec.device)
    assert spec.target.local and spec.target.type == "cuda"
    assert spec.target.total_bytes == props.total_memory
    assert spec.target.capability == (props.major, props.minor)
    other = "T4" if "T4" not in props.name else "A100-40GB"
    with pytest.raises(ConfigError, match=rf"search.gpu={other} plans for another GPU"):
        plan(hydra_conf(["trainer.device=cuda", f"search.gpu={other}"]), None)


def test_a_cuda_runs_figures_carry_the_predicted_reserve_beside_the_limit(hydra_conf) -> None:  # noqa: ANN001
    """memory/predicted_bytes is what the budget is compared with (the smallest limit);
    memory/predicted_reserved_bytes the reserve under the run's limit, which
    memory/prediction_error compares with the measured reserve."""
    spec = plan(hydra_conf(["search.gpu=A100-40GB"]), "90%")
    prediction = Prediction(peak_bytes=300, tensor_bytes=200, seconds=0.0, reserved_bytes=320)
    measured = MemoryStats(peak_bytes=210, reserved_bytes=400)
    figures = memory_figures(spec, prediction, measured)
    assert figures[PREDICTED_BYTES] == 300
    assert figures[PREDICTED_RESERVED_BYTES] == 320
    assert figures[PREDICTION_ERROR] == pytest.approx((320 - 400) / 400)
    cpu = memory_figures(spec, Prediction(300, 300, 0.0), MemoryStats(250, None))
    assert PREDICTED_RESERVED_BYTES not in cpu
    assert cpu[PREDICTION_ERROR] == pytest.approx((300 - 250) / 250)
