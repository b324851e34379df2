"""A step's events as the predictor (train/memory/predict.py) computes them on fake tensors
(`FakeStepTracker`), and as it reuses them instead of computing a step: `BatchSizeLine`, the
line through steps of one micro-batch pattern that any other micro-batch size is read off,
and `first_micro_batch`, the step of a first micro-batch alone cut from a step of several.
(train/memory/stack.py reads a step off a line through depths of a layer stack the same
way.)"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from batchfit.train.measure.memory import TensorMemoryTracker

Events = list[tuple[int, int]]  # (storage number, bytes) allocated, (number, -1) freed
_DEVICE = torch.ops.prim.device.default


class FakeStepTracker(TensorMemoryTracker):
    """The tracker of a step on fake tensors, answering a fake tensor's device itself. C++
    asks every fake tensor its device through the dispatcher (`prim.device`, a query that
    allocates nothing): the autograd engine for each gradient it passes on, the foreach
    optimizers for each tensor of their lists. That is two thirds of the ops a fake LoRA
    step dispatches, each through this mode and then the fake mode; answered here as the
    fake mode answers it (`FakeTensor.device`: meta within a fake kernel, else its fake
    device), the step costs a fifth less and its events are the same."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is _DEVICE and len(args) == 1 and isinstance(args[0], FakeTensor):
            return args[0].device
        return super().__torch_dispatch__(func, types, args, kwargs)


class BatchSizeLine:
    """A step's allocations as a function of the micro-batch size n. Every tensor of a step
    has a size a + b*n (parameters and state: b = 0; activations: a = 0), so once three
    steps computed at different n have the same sequence of allocations and frees, and the
    third is exactly where the line through the first two puts it, any other n is read off
    the line without computing. A sequence that changes with n between the computed sizes
    (a model that branches on the batch size) leaves the line unused: every n is then
    computed. A branch beyond the three computed sizes is not seen: such a model is
    mispredicted there (none of the bundled ones branches on the batch size)."""

    def __init__(self) -> None:
        self.points: dict[int, Events] = {}
        self.verified = False
        self.failed = False

    def add(self, n: int, events: Events) -> None:
        if self.failed or self.verified or n in self.points:
            return
        self.points[n] = events
        if len(self.points) == 3:
            (n1, _), (n2, _), (n3, e3) = sorted(self.points.items())
            self.verified = self._through(n1, n2, n3) == e3
            self.failed = not self.verified

    def at(self, n: int) -> Events | None:
        if not self.verified:
            return None
        n1, n2 = sorted(self.points)[:2]
        return self._through(n1, n2, n)

    def _through(self, n1: int, n2: int, n: int) -> Events | None:
        first, second = self.points[n1], self.points[n2]
        if len(first) != len(second):
            return None
        events = []
        for (key, b1), (key2, b2) in zip(first, second, strict=True):
            if key != key2 or (b1 < 0) != (b2 < 0):
                return None
            if b1 < 0:
                events.append((key, -1))
                continue
            step, rest = divmod((b2 - b1) * (n - n1), n2 - n1)
            if rest or b1 + step < 0:
                return None
            events.append((key, b1 + step))
        return events


def first_micro_batch(events: Events, marks: list[int]) -> Events:
    """The events of a step of the first micro-batch alone, from those of a step of
    several: everything until the second micro-batch begins, then the optimizer's part
    (from where the last micro-batch ended). The first micro-batch's tensors are alive
    there, as they are when it is the only one: the frees of the micro-batches between
    are left out with their allocations. Exact: the optimizer's part allocates the same
    whatever micro-batch came last (its tensors have the parameters' shapes)."""
    second, end = marks[0], marks[-1]
    between = {key for key, nbytes in events[second:end] if nbytes >= 0}
    tail = [(key, nbytes) for key, nbytes in events[end:] if key not in between]
    return events[:second] + tail
