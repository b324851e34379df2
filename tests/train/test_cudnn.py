"""cuDNN convolutions' workspaces in a predicted CUDA step (train/memory/cudnn.py): the events
each convolution adds, in CUDA's order, from PyTorch's source; the cap batchfit exports and
counts; and, on a GPU, the workspaces measured there."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tracking.config import ConfigError
from tracking.metrics import CUDNN_WORKSPACE_BYTES
from train.config import RunSpec, TrainerConfig
from train.memory.allocator_settings import AllocatorSettings
from train.memory.budget import TensorMemoryTracker
from train.memory.cudnn import (
    WSCAP_ENV,
    CudnnWorkspaces,
    MiB,
    apply_cap,
    cap_problems,
    conv_composites,
)
from train.memory.device import DeviceSpec
from train.memory.gpus import gpu
from train.memory.predict import MemoryPredictor
from train.run import memory_figures, plan

CONF = Path(__file__).resolve().parents[2] / "conf"
TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "cuda-traces"
A100 = gpu("A100-40GB")
# per kind of cuDNN call, a workspace no tensor of these steps has (to find them by size)
SIZES = {
    "forward": 3 * 1000 * 512,
    "backward_data": 5 * 1000 * 512,
    "backward_filter": 7 * 1000 * 512,
}


def _by_kind(signature: tuple, _args: tuple) -> int:
    return SIZES[signature[0]]


def _step(model: nn.Module, x: torch.Tensor, workspaces: CudnnWorkspaces) -> list[tuple[int, int]]:
    tracker = TensorMemoryTracker(record=True, composites=conv_composites(workspaces))
    tracker.register(model.parameters())
    with tracker:
        model(x).sum().backward()
    assert tracker.events is not None
    return tracker.events


def _sizes(events: list[tuple[int, int]]) -> list[int]:
    """Allocation sizes in order, a free as -1 (what the allocator model is given)."""
    return [nbytes for _, nbytes in events]


def test_a_convolution_allocates_its_workspace_after_its_output_and_frees_it_at_once() -> None:
    """Convolution.cpp/ConvShared.cpp/Conv_v8.cpp: the forward allocates the output, then
    run_conv_plan's workspace, freed when it returns. The backward of a convolution whose
    input needs no gradient is the weight-gradient alone (output_mask[0] false: no
    backward-data call); the summed loss's gradient reaches it expanded (stride 0), so cuDNN
    gets a contiguous copy; then the weight-gradient, its workspace, and the bias gradient."""
    with FakeTensorMode():
        conv = nn.Conv2d(3, 4, 3, padding=1)
        x = torch.empty(2, 3, 8, 8)
        workspaces = CudnnWorkspaces(cap_bytes=None, measure=_by_kind)
        sizes = _sizes(_step(conv, x, workspaces))
    out = 2 * 4 * 8 * 8 * 4  # fp32 output, (2, 4, 8, 8)
    weight, bias = 4 * 3 * 3 * 3 * 4, 4 * 4
    forward = sizes.index(SIZES["forward"])
    assert sizes[forward - 1 : forward + 2] == [out, SIZES["forward"], -1]
    filter_ = sizes.index(SIZES["backward_filter"])
    # the gradient's contiguous copy, the weight-gradient, its workspace (freed), the bias's
    assert sizes[filter_ - 2 : filter_ + 3] == [out, weight, SIZES["backward_filter"], -1, bias]
    assert SIZES["backward_data"] not in sizes
    assert sorted(s[0] for s in workspaces.seen) == ["backward_filter", "forward"]


def test_a_second_convolution_also_takes_the_backward_data_call_before_its_filter() -> None:
    """A convolution whose input needs a gradient (here the second layer's): its input
    gradient first (cudnn_convolution_backward_input), then its weight gradient."""
    with FakeTensorMode():
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1))
        x = torch.empty(2, 3, 8, 8)
        workspaces = CudnnWorkspaces(cap_bytes=None, measure=_by_kind)
        sizes = _sizes(_step(model, x, workspaces))
    grad_input, grad_weight = 2 * 4 * 8 * 8 * 4, 4 * 4 * 3 * 3 * 4
    data = sizes.index(SIZES["backward_data"])
    assert sizes[data - 1 : data + 4] == [
        grad_input, SIZES["backward_data"], -1, grad_weight, SIZES["backward_filter"],
    ]  # fmt: skip
    kinds = [s[0] for s in workspaces.seen]
    assert sorted(kinds) == ["backward_data"] + ["backward_filter"] * 2 + ["forward"] * 2


def test_the_order_matches_a_real_cudnn_training_trace() -> None:
    """In a real CNN's training trace (tests/fixtures/cuda-traces/eor_nn_snapshot, cuDNN on a
    GPU), the allocations freed at once (cuDNN workspaces) come right after another
    allocation, as in the prediction: the output the call fills. Calibrated on the trace:
    91 of its 100 such blocks over 4 KiB; the 9 others are one 7.5 MiB block per step that
    follows the step's frees (not a convolution's)."""
    with gzip.open(TRACES / "eor_nn_snapshot.json.gz", "rt") as file:
        snapshot = json.load(file)
    trace = [e for e in snapshot["device_traces"][0] if e["action"] in ("alloc", "free_requested")]
    at_once = [
        i
        for i in range(1, len(trace) - 1)
        if trace[i]["action"] == "alloc"
        and trace[i + 1]["action"] == "free_requested"
        and trace[i + 1]["addr"] == trace[i]["addr"]
        and trace[i]["size"] > 4096  # not a scalar's
    ]
    after_an_allocation = [i for i in at_once if trace[i - 1]["action"] == "alloc"]
    assert len(at_once) == 100 and len(after_an_allocation) == 91


def _small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
        nn.Flatten(), nn.Linear(16 * 8 * 8, 10),
    )  # fmt: skip


def _planned(cap_bytes: int | None) -> DeviceSpec:
    cudnn = CudnnWorkspaces(cap_bytes=cap_bytes)
    return DeviceSpec("cuda", A100.total_bytes, A100, AllocatorSettings(), False, cudnn)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def test_a_planned_card_counts_every_call_at_the_cap_and_says_it_is_a_bound() -> None:
    """Without the card, each cuDNN call's workspace is the cap, and the prediction carries
    the cap it assumed: the live peak is then inside a call (the cap over what is live
    there, at most the uncapped peak), and the reserve holds one more segment of exactly the
    cap (an allocation over 10 MiB gets a segment of its own size, rounded to 2 MiB; each
    call's workspace reuses the block the last one freed)."""
    example = (torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))
    trainer = TrainerConfig(batch_size=4, accum_steps=1, precision="fp32")
    capped = MemoryPredictor(_small_cnn, _sgd, example, _planned(64 * MiB)).predict(trainer, 64)
    free = MemoryPredictor(_small_cnn, _sgd, example, _planned(None)).predict(trainer, 64)
    assert capped.has_convolutions and capped.workspace_cap_bytes == 64 * MiB
    assert free.has_convolutions and free.workspace_cap_bytes is None
    assert 64 * MiB - free.tensor_bytes <= capped.tensor_bytes - free.tensor_bytes <= 64 * MiB
    assert capped.peak_bytes == free.peak_bytes + 64 * MiB


def test_the_workspace_counted_is_logged_with_the_prediction() -> None:
    """memory/cudnn_workspace_bytes: the largest call's workspace counted (here the cap);
    a step without convolutions logs none."""
    example = (torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))
    trainer = TrainerConfig(batch_size=4, accum_steps=1, precision="fp32")
    capped = MemoryPredictor(_small_cnn, _sgd, example, _planned(64 * MiB)).predict(trainer, 64)
    spec = RunSpec(trainer, torch.device("cpu"), _planned(64 * MiB), None, 0.1, 0.1)
    assert memory_figures(spec, capped, None)[CUDNN_WORKSPACE_BYTES] == 64 * MiB
    measured = CudnnWorkspaces(cap_bytes=64 * MiB, measure=_by_kind)
    spec_measured = DeviceSpec("cuda", A100.total_bytes, A100, AllocatorSettings(), True, measured)
    on_card = MemoryPredictor(_small_cnn, _sgd, example, spec_measured).predict(trainer, 64)
    assert on_card.workspace_cap_bytes is None  # measured: not a bound
    assert memory_figures(spec, on_card, None)[CUDNN_WORKSPACE_BYTES] == max(SIZES.values())
    linear = MemoryPredictor(
        lambda: nn.Sequential(nn.Linear(32, 10)),
        _sgd,
        (torch.zeros(4, 32), torch.zeros(4, dtype=torch.long)),
        _planned(64 * MiB),
    ).predict(trainer, 64)
    assert CUDNN_WORKSPACE_BYTES not in memory_figures(spec, linear, None)


def test_a_model_without_convolutions_has_none() -> None:
    example = (torch.zeros(4, 32), torch.zeros(4, dtype=torch.long))
    trainer = TrainerConfig(batch_size=4, accum_steps=1, precision="fp32")
    prediction = MemoryPredictor(
        lambda: nn.Sequential(nn.Linear(32, 10)), _sgd, example, _planned(64 * MiB)
    ).predict(trainer, 64)
    assert not prediction.has_convolutions and prediction.workspace_cap_bytes is None


def test_the_cap_is_exported_for_cudnn_and_taken_back_only_where_batchfit_set_it() -> None:
    environ: dict[str, str] = {}
    apply_cap(32, environ)
    assert environ == {WSCAP_ENV: "32"}
    assert CudnnWorkspaces.from_env(environ).cap_bytes == 32 * MiB
    apply_cap(None, environ)  # null: batchfit's own cap taken back
    assert environ == {}
    by_hand = {WSCAP_ENV: "128"}
    apply_cap(None, by_hand)  # one the user set stays
    assert by_hand == {WSCAP_ENV: "128"}
    assert CudnnWorkspaces.from_env({}).cap_bytes is None


@pytest.mark.parametrize("bad", [-1, 1.5, "lots", True])
def test_a_bad_cap_is_refused_naming_the_key_and_a_fix(bad: object) -> None:
    (problem,) = cap_problems(bad)
    assert "cudnn_workspace_mib must be a whole number of MiB" in problem
    assert "override with cudnn_workspace_mib=64" in problem


def test_a_bad_cap_stops_the_run_before_it_starts() -> None:
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("config", overrides=["cudnn_workspace_mib=lots", "search.gpu=A100-40GB"])
    with pytest.raises(ConfigError, match="cudnn_workspace_mib must be a whole number"):
        plan(cfg, "90%")


def test_the_default_cap_reaches_a_planned_card() -> None:
    """The config's default (64 MiB, conf/config.yaml) is exported and in the DeviceSpec."""
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("config", overrides=["search.gpu=A100-40GB"])
    spec = plan(cfg, "90%")
    assert spec.target is not None and spec.target.cudnn is not None
    assert spec.target.cudnn.cap_bytes == cfg.cudnn_workspace_mib * MiB == 64 * MiB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_each_workspace_is_measured_and_within_the_cap() -> None:
    """On the card, each call is measured (train/memory/cudnn.py measure_on_device); cuDNN
    honours CUDNN_CONV_WSCAP_DBG, so no measured workspace passes the cap exported."""
    from train.memory.device import device_spec

    apply_cap(16)
    device = torch.device("cuda", torch.cuda.current_device())
    spec = device_spec(device, None)
    assert spec.cudnn is not None and spec.cudnn.measure is not None
    example = (torch.zeros(64, 3, 32, 32), torch.zeros(64, dtype=torch.long))
    model = lambda: nn.Sequential(  # noqa: E731
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1),
        nn.Flatten(), nn.Linear(64 * 32 * 32, 10),
    )  # fmt: skip
    trainer = TrainerConfig(batch_size=64, accum_steps=1, precision="fp32")
    prediction = MemoryPredictor(model, _sgd, example, spec).predict(trainer, 256)
    assert prediction.has_convolutions and prediction.workspace_cap_bytes is None
    assert spec.cudnn.measured and max(spec.cudnn.measured.values()) <= 16 * MiB
