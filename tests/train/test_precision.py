"""Precision: support per device, autocast dtype, loss scaling, TF32 flags."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchfit.train.precision import PRECISIONS, Precision, unsupported_reason

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_every_precision_is_accepted_and_an_unknown_one_is_refused_with_the_list():
    from batchfit.common.checks import ConfigError
    from batchfit.train.config import TrainerConfig

    for name in PRECISIONS:  # each one a run may use, and each with autocast behind it
        assert TrainerConfig(precision=name, device="cpu").precision == name
    with pytest.raises(ConfigError, match=r"must be one of fp32, tf32, bf16, fp16, got 'fp8'"):
        TrainerConfig(precision="fp8")
    # On the CPU, only tf32 (a CUDA tensor-core mode) cannot run.
    assert [p for p in PRECISIONS if unsupported_reason(p, CPU)] == ["tf32"]


def test_tf32_is_unsupported_on_cpu():
    reason = unsupported_reason("tf32", CPU)
    assert reason is not None
    assert "tf32" in reason and "cpu" in reason


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_other_precisions_are_supported_on_cpu(name):
    assert unsupported_reason(name, CPU) is None


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("fp32", None), ("tf32", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)],
)
def test_autocast_dtype(name, dtype):
    assert Precision(name, "cpu").autocast_dtype is dtype


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("fp32", torch.float32),
        ("tf32", torch.float32),
        ("bf16", torch.bfloat16),
        ("fp16", torch.float16),
    ],
)
def test_autocast_runs_matmuls_in_the_precision_dtype(name, dtype):
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with Precision(name, "cpu").autocast():
        out = layer(x)
    assert out.dtype == dtype
    assert layer.weight.dtype == torch.float32  # only the computation is cast
    # Outside the context, fp32 again.
    assert layer(x).dtype == torch.float32


@pytest.mark.parametrize(("name", "enabled"), [("fp32", False), ("tf32", False),
                                               ("bf16", False), ("fp16", True)])  # fmt: skip
def test_grad_scaler_only_for_fp16(name, enabled):
    scaler = Precision(name, "cpu").grad_scaler()
    assert scaler.is_enabled() is enabled
    loss = torch.tensor(2.0)
    scaled = scaler.scale(loss)
    if enabled:
        assert scaled.item() > loss.item()  # the loss is multiplied by the scale
    else:
        assert scaled is loss


@pytest.fixture
def tf32_flags():
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.mark.parametrize("initial", [(False, True), (True, False), (True, True), (False, False)])
@pytest.mark.parametrize("name", ["fp32", "tf32", "bf16", "fp16"])
def test_matmul_mode_sets_and_restores_tf32_flags(tf32_flags, name, initial):
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = initial
    use_tf32 = name == "tf32"
    with Precision(name, "cpu").matmul_mode():
        assert _flags() == (use_tf32, use_tf32)
    assert _flags() == initial


def test_matmul_mode_restores_flags_after_an_error(tf32_flags):
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = (False, True)
    with pytest.raises(RuntimeError, match="inside"), Precision("tf32", "cpu").matmul_mode():
        assert _flags() == (True, True)
        raise RuntimeError("inside")
    assert _flags() == (False, True)


def test_matmul_mode_nests(tf32_flags):
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = (False, True)
    with Precision("tf32", "cpu").matmul_mode():
        with Precision("fp32", "cpu").matmul_mode():
            assert _flags() == (False, False)
        assert _flags() == (True, True)
    assert _flags() == (False, True)


@pytest.mark.gpu
@needs_cuda
def test_unsupported_reason_on_cuda():
    device = torch.device("cuda")
    major, _ = torch.cuda.get_device_capability(device)
    assert unsupported_reason("fp32", device) is None
    assert unsupported_reason("fp16", device) is None
    assert (unsupported_reason("tf32", device) is None) == (major >= 8)
    assert (unsupported_reason("bf16", device) is None) == torch.cuda.is_bf16_supported()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("name", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_autocast_on_cuda(name, dtype):
    layer = nn.Linear(4, 3).cuda()
    with Precision(name, "cuda").autocast():
        out = layer(torch.randn(2, 4, device="cuda"))
    assert out.dtype == dtype
    assert Precision(name, "cuda").grad_scaler().is_enabled() is (name == "fp16")
