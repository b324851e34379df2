"""cuDNN batch norms in a predicted CUDA step (train/memory/cudnn.py norm_composites): which
batch norms CUDA runs on cuDNN, and the buffers aten/src/ATen/native/cudnn/BatchNorm.cpp
allocates for them, replayed event by event with sizes as a card measures them."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.search.fit.render import NORMS_UNKNOWN, notes
from batchfit.search.fit.report import Cell, FitReport
from batchfit.train.config import TrainerConfig
from batchfit.train.device.allocator_settings import AllocatorSettings
from batchfit.train.device.cudnn_workspaces import CudnnWorkspaces
from batchfit.train.device.gpus import gpu
from batchfit.train.device.spec import DeviceSpec
from batchfit.train.measure.memory import TensorMemoryTracker
from batchfit.train.memory.cudnn import cudnn_batch_norm, norm_composites, norm_signature
from batchfit.train.memory.predict import MemoryPredictor

A100 = gpu("A100-40GB")
# sizes no tensor of these steps has, to find each buffer by its size
FORWARD, RESERVE, BACKWARD = 3 * 7 * 1000, 5 * 7 * 1000, 11 * 7 * 1000


def _measured(signature: tuple) -> tuple[int, int, int]:
    return FORWARD, RESERVE, BACKWARD


def _events(model: nn.Module, x: torch.Tensor, workspaces: CudnnWorkspaces, met: dict) -> list:
    tracker = TensorMemoryTracker(record=True, composites=norm_composites(workspaces, met))
    tracker.register(model.parameters())
    with tracker:
        model(x).sum().backward()
    return tracker.events


def test_the_reserve_lives_to_the_backward_pass_and_workspaces_end_with_their_calls() -> None:
    """Forward: the output and saved statistics, then the workspace and the reserve, the
    workspace freed when the call returns, the reserve kept; backward: the gradients (the
    weight's and bias's even where autograd wants none: cuDNN computes all three), a
    workspace allocated and freed, and the reserve freed only once the backward pass is
    done with the saved statistics."""
    workspaces = CudnnWorkspaces(cap_bytes=None, measure_norm=_measured)
    met: dict = {}
    with FakeTensorMode():
        norm = nn.BatchNorm2d(4)
        norm.weight.requires_grad_(False)  # frozen: autograd wants no weight gradient
        norm.bias.requires_grad_(False)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), norm, nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
        events = _events(model, torch.empty(2, 3, 8, 8), workspaces, met)
    sizes = [n for _, n in events]
    key = {n: k for k, n in events if n > 0}
    forward, reserve, backward = (sizes.index(n) for n in (FORWARD, RESERVE, BACKWARD))
    assert reserve == forward + 1 < backward
    assert events[forward + 2] == (key[FORWARD], -1)  # at the call's return
    assert events[backward + 1] == (key[BACKWARD], -1)
    freed = events.index((key[RESERVE], -1))
    assert freed > backward + 1  # the reserve outlives the backward's workspace
    channel = 4 * 4  # a {C} float32 tensor
    assert sizes[backward - 2 : backward] == [channel, channel]  # weight and bias gradients
    assert list(met.values()) == [(FORWARD, RESERVE, BACKWARD)]


def test_which_batch_norms_run_on_cudnn_and_how_they_are_keyed() -> None:
    with FakeTensorMode():
        x, w = torch.empty(8, 4, 5, 5), torch.empty(4)
        assert cudnn_batch_norm(x, w, w, training=True)
        assert not cudnn_batch_norm(x, w, w, training=False)  # eval: inference, no reserve
        assert not cudnn_batch_norm(x.bfloat16(), w, w, True)  # bf16 autocast: ATen's own
        assert cudnn_batch_norm(x.half(), w, w, True)  # half over float weights
        assert not cudnn_batch_norm(x.half(), w.half(), w.half(), True)
        assert not cudnn_batch_norm(torch.empty(8, 4), w, w, True)  # 2-D: ATen's own
        assert not cudnn_batch_norm(x, None, None, True)
        last = x.to(memory_format=torch.channels_last)
        assert norm_signature(x, w)[-1] is False and norm_signature(last, w)[-1] is True


def test_off_the_card_spatial_needs_none_and_channels_last_is_said_unknown() -> None:
    """Planned for a card this machine lacks: a contiguous batch norm (SPATIAL) counts no
    buffer; one over channels-last input (SPATIAL_PERSISTENT) is not known, and the fit
    report says so."""
    workspaces = CudnnWorkspaces(cap_bytes=None)
    assert workspaces.norm_bytes_of(("batch_norm", (), (), None, None, False)) == (0, 0, 0)
    assert workspaces.norm_bytes_of(("batch_norm", (), (), None, None, True)) is None
    spec = DeviceSpec("cuda", A100.total_bytes, A100, AllocatorSettings(), False, workspaces)
    trainer = TrainerConfig(batch_size=4, accum_steps=1, precision="fp32")

    def model(layout: torch.memory_format):  # noqa: ANN202
        return lambda: nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 6 * 6, 2)
        ).to(memory_format=layout)

    def example(layout: torch.memory_format) -> tuple:
        images = torch.zeros(4, 3, 8, 8).to(memory_format=layout)
        return images, torch.zeros(4, dtype=torch.long)

    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    plain = MemoryPredictor(model(torch.contiguous_format), sgd, example(torch.contiguous_format),
                            spec)  # fmt: skip
    plain.predict(trainer, 64)
    assert not plain.norms_unknown
    last = MemoryPredictor(model(torch.channels_last), sgd, example(torch.channels_last), spec)
    last.predict(trainer, 64)
    assert last.norms_unknown
    report = FitReport(None, 0.0, False, ["fp32"], {}, [4], [1], cuda=True)
    report.cells[("fp32", 4, 1)] = Cell(4, 4, 1, 1024, True)
    assert NORMS_UNKNOWN not in notes(report)
    report.norms_unknown = True  # as tabulate sets it from the predictor
    assert NORMS_UNKNOWN in notes(report)
