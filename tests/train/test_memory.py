"""Memory budget: parsing, the CPU tensor tracker, OOM handling and release after an OOM."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from batchfit.train.batches import steps_plan
from batchfit.train.config import TrainerConfig
from batchfit.train.data import Splits, synthetic
from batchfit.train.device.sizes import device_total_bytes, format_bytes, parse_budget
from batchfit.train.loop import Run, fit
from batchfit.train.lr import constant
from batchfit.train.measure.memory import (
    MemoryMeter,
    OutOfMemory,
    TensorMemoryTracker,
    is_oom_error,
)
from batchfit.train.memory.reserve import live_peak_bytes
from batchfit.train.models import param_bytes, small_cnn
from batchfit.train.precision import Precision
from batchfit.train.step import optimizer_step

CPU = torch.device("cpu")
GiB, MiB = 2**30, 2**20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# --------------------------------------------------------------------------- parse_budget


@pytest.mark.parametrize(
    ("value", "total", "expected"),
    [
        (None, 10 * GiB, None),
        (8589934592, 0, 8589934592),
        (1, 0, 1),
        (1024.0, 0, 1024),
        ("8GiB", 0, 8 * GiB),
        ("512MiB", 0, 512 * MiB),
        ("1.5KiB", 0, 1536),
        ("16GB", 0, 16 * 10**9),  # decimal units
        ("250 MB", 0, 250 * 10**6),
        ("8gib", 0, 8 * GiB),  # units are case-insensitive
        (" 2TiB ", 0, 2 * 2**40),
        ("4096", 0, 4096),
        ("4096B", 0, 4096),
        ("90%", 1000, 900),
        ("100%", 12345, 12345),
        ("12.5 %", 80 * GiB, 10 * GiB),
    ],
)
def test_parse_budget_accepted_forms(value, total, expected):
    assert parse_budget(value, total) == expected


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("8GB?", r"is not a memory size; use bytes .*8GiB.*90%"),
        ("0", "is not a memory size"),
        ("0GiB", "is not a memory size"),
        ("-1", "is not a memory size"),
        ("-1GiB", "is not a memory size"),
        ("8 parsecs", "is not a memory size"),
        ("", "is not a memory size"),
        ("1e9", "is not a memory size"),
        ("150%", "not a share between 0% and 100%"),
        ("0%", "not a share between 0% and 100%"),
        (0, "not a positive number of bytes"),
        (-1, "not a positive number of bytes"),
        (-0.5, "not a positive number of bytes"),
        (True, "is not a memory size"),
        (False, "is not a memory size"),
    ],
)
def test_parse_budget_rejects(value, match):
    with pytest.raises(ValueError, match=match):
        parse_budget(value, 1000)


def test_parse_budget_rejects_infinity_with_value_error():
    with pytest.raises(ValueError):
        parse_budget(float("inf"), 1000)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (0.5, "not a positive number of bytes"),  # would round to a budget of 0 bytes
        ("0.5", "not a memory size"),  # bytes as a string need no fraction
        ("0.0001%", "not a share"),  # 0.0001% of 1000 bytes is under one byte
    ],
)
def test_parse_budget_refuses_what_would_be_a_zero_budget(value, match):
    with pytest.raises(ValueError, match=match):
        parse_budget(value, 1000)
    assert parse_budget("0.1%", 1000) == 1  # the smallest share that is a byte is accepted


def test_format_bytes():
    assert format_bytes(None) == "-"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(150 * MiB) == "150.0 MiB"
    assert format_bytes(3 * GiB) == "3.0 GiB"
    assert format_bytes(4096 * GiB) == "4.0 TiB"
    assert format_bytes(1e30) == "888178419700125.2 PiB"  # a typo's size, still readable


def test_device_total_bytes_cpu_is_physical_memory():
    total = device_total_bytes(CPU)
    assert total > 256 * MiB
    assert parse_budget("50%", total) == total // 2


# --------------------------------------------------------------------------- tracker: ops


def test_tracker_counts_allocations_and_frees():
    tracker = TensorMemoryTracker()
    with tracker:
        a = torch.empty(100)  # 400 B
        b = torch.empty(50, dtype=torch.float64)  # 400 B
        assert tracker.live_bytes == 800
        del a
        assert tracker.live_bytes == 400
        c = torch.ones(10, dtype=torch.bfloat16)  # 20 B
        assert tracker.live_bytes == 420
        d = b + 1  # 400 B
        assert tracker.live_bytes == 820
    assert tracker.peak_bytes == 820
    del b, c, d
    assert tracker.live_bytes == 0  # frees after the tracker exits are still seen
    assert tracker.peak_bytes == 820


def test_tracker_peak_includes_temporaries():
    tracker = TensorMemoryTracker()
    with tracker:
        x = torch.ones(25)  # 100 B
        y = (x * 2) * 3  # temporary x * 2 (100 B) lives while (.) * 3 (100 B) is made
    assert tracker.live_bytes == 200  # x and y
    assert tracker.peak_bytes == 300
    del x, y


def test_tracker_views_and_in_place_ops_are_not_counted_again():
    tracker = TensorMemoryTracker()
    with tracker:
        a = torch.zeros(10, 10)  # 400 B
        views = [a.view(100), a[2:5], a.t(), a[:, ::2], a.reshape(4, 25), a.detach(), a[0]]
        a.add_(1)
        a[3].mul_(2)
        views[1].zero_()
        assert tracker.live_bytes == 400
        copy = a.t().contiguous()  # a real copy: 400 B
        assert tracker.live_bytes == 800
    assert tracker.peak_bytes == 800
    del views, copy, a


def test_tracker_multi_output_ops_count_each_output():
    values = torch.randn(10)  # pre-existing and unregistered: 0 B
    tracker = TensorMemoryTracker()
    with tracker:
        sorted_values, indices = torch.sort(values)  # float32 40 B + int64 80 B
    assert tracker.live_bytes == 120
    del sorted_values, indices
    assert tracker.live_bytes == 0


def test_tracker_pre_existing_storages_count_only_when_registered():
    dataset = torch.ones(1000)  # 4000 B on the host, not registered
    weights = torch.ones(250)  # 1000 B, registered
    tracker = TensorMemoryTracker()
    tracker.register([weights, weights[:10], weights.view(25, 10)])  # one storage, once
    assert tracker.live_bytes == 1000
    with tracker:
        batch_view = dataset[:100]  # a view of an unregistered storage: 0 B
        dataset.mul_(2)  # in place on it: 0 B
        weights.add_(1)  # in place on a registered one: no change
        assert tracker.live_bytes == 1000
        doubled = dataset[:100] * 2  # new memory: 400 B
        assert tracker.live_bytes == 1400
        tracker.register([dataset])  # already seen as uncounted: stays 0 B
        assert tracker.live_bytes == 1400
        del weights  # a registered storage freed inside
        assert tracker.live_bytes == 400
    assert tracker.peak_bytes == 1400
    del batch_view, doubled


def test_tracker_registered_after_free_by_gc():
    tracker = TensorMemoryTracker()
    tensor = torch.empty(64)
    tracker.register([tensor])
    assert tracker.live_bytes == 256
    ref = weakref.ref(tensor)
    del tensor
    gc.collect()
    assert ref() is None
    assert tracker.live_bytes == 0


def test_tracker_follows_in_place_resize():
    tracker = TensorMemoryTracker()
    with tracker:
        grown = torch.empty(10)  # 40 B
        grown.resize_(100)  # 400 B
        assert tracker.live_bytes == 400
        del grown
        assert tracker.live_bytes == 0  # actual: 360 (the free subtracts 40)
        empty = torch.empty(0)
        empty.resize_(100)
        assert tracker.live_bytes == 400  # actual: 0 (a 0-byte storage is never counted)
        del empty


def test_tracker_records_a_resize_as_alloc_then_free():
    """resize_ allocates the new buffer before it frees the old one (both live while it
    copies), as the caching allocator sees it; a 0-byte storage resized later is a plain
    allocation (its free used to be recorded for a number never allocated: KeyError)."""
    tracker = TensorMemoryTracker(record=True)
    with tracker:
        grown = torch.empty(10)  # 40 B
        grown.resize_(100)  # 400 B
        empty = torch.empty(0)
        empty.resize_(25)  # 100 B
        del grown, empty
    old, new = tracker.events[0][0], tracker.events[1][0]
    assert tracker.events[:3] == [(old, 40), (new, 400), (old, -1)]
    assert new != old
    assert tracker.peak_bytes == max(40 + 400, 400 + 100)  # old and new together; then both
    assert live_peak_bytes(tracker.events) == tracker.peak_bytes
    assert tracker.live_bytes == 0


# --------------------------------------------------------------------------- tracker: a step


def _linear_step_peak(n: int, d: int, c: int) -> int:
    """Hand count of the peak of one fp32 step of nn.Linear(d, c, bias=False), plain SGD,
    cross-entropy on a single micro-batch of n samples, as train.step.optimizer_step runs it.

    The peak is reached in the backward of log_softmax (aten._log_softmax_backward_data),
    when these storages are live:
      weight                               4*c*d  registered (parameters)
      step_loss accumulator                4      torch.zeros(()) in optimizer_step
      logits (n, c)                        4*n*c  held by the local `logits`
      log_softmax(logits) (n, c)           4*n*c  saved by LogSoftmaxBackward / NllLossBackward
      total_weight of nll_loss_forward     4      saved by NllLossBackward
      loss = sum / num_samples             4      held by the local `loss`
      grad of log_softmax output (n, c)    4*n*c  from nll_loss_backward
      grad of logits (n, c)                4*n*c  being produced
    The batch x (n, d) and labels y (n,) are not counted here: they are created before the
    tracker starts and are not registered (train.loop._fit gathers them inside it). The
    backward's 4-byte seed gradient and the grad of the division are already freed, the
    nll_loss output (4 B) was freed right after the division, and the weight gradient
    (4*c*d) is only allocated after the (n, c) gradients above are released: for d <= 2*n
    it never raises the peak, and SGD without momentum updates the weight in place.
    """
    assert d <= 2 * n
    return 4 * c * d + 16 * n * c + 12


def _linear_setup(n: int, d: int, c: int):
    """A batch of n samples, nn.Linear(d, c, bias=False) and plain SGD, in fp32 on CPU."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=gen)
    y = torch.randint(0, c, (n,), generator=gen)
    model = nn.Linear(d, c, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return x, y, model, optimizer, Precision("fp32", "cpu")


@pytest.mark.parametrize(("n", "d", "c"), [(7, 5, 3), (16, 8, 10), (4, 8, 2)])
def test_tracker_exact_peak_of_a_linear_sgd_step(n, d, c):
    x, y, model, optimizer, precision = _linear_setup(n, d, c)
    scaler = precision.grad_scaler()
    for _ in range(2):  # identical peak on a second step: no state is kept between steps
        tracker = TensorMemoryTracker()
        tracker.register(model.parameters())
        with tracker:
            optimizer_step(model, optimizer, scaler, precision, [(x, y)])
        assert tracker.peak_bytes == _linear_step_peak(n, d, c)
        # Everything but the weight is freed by the end of the step (grads set to None; the
        # returned loss was not kept).
        assert tracker.live_bytes == 4 * c * d


def test_tracker_counts_a_batch_created_inside_it():
    # A batch copied inside the tracker (what .to('cuda') would do) is counted for the whole
    # step: + 4*n*d for x and + 8*n for the int64 labels.
    n, d, c = 7, 5, 3
    x, y, model, optimizer, precision = _linear_setup(n, d, c)
    tracker = TensorMemoryTracker()
    tracker.register(model.parameters())
    with tracker:
        micro = [(x.clone(), y.clone())]
        optimizer_step(model, optimizer, precision.grad_scaler(), precision, micro)
    assert tracker.peak_bytes == _linear_step_peak(n, d, c) + 4 * n * d + 8 * n


def _vector_splits(n: int, d: int, c: int, num_val: int = 4) -> Splits:
    gen = torch.Generator().manual_seed(0)
    return Splits(
        torch.randn(n, d, 1, 1, generator=gen),
        torch.randint(0, c, (n,), generator=gen),
        torch.randn(num_val, d, 1, 1, generator=gen),
        torch.randint(0, c, (num_val,), generator=gen),
        c,
    )


def _linear_fit(n, d, c, momentum=0.0, budget=None, steps=3):
    data = _vector_splits(n, d, c)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(d, c, bias=False))  # flatten: a view
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    cfg = TrainerConfig(batch_size=n, max_steps=steps, max_epochs=None)
    return fit(
        Run(model, optimizer, constant(optimizer, steps), data, cfg, CPU, MemoryMeter(CPU, budget))
    )


def test_fit_reports_the_hand_counted_cpu_peak():
    n, d, c = 7, 5, 3
    result = _linear_fit(n, d, c)
    # fit gathers the micro-batch inside the tracked step (on a GPU it lives on the device):
    # + 4*n*d for x and + 8*n for the int64 labels.
    assert result.peak_bytes == _linear_step_peak(n, d, c) + 4 * n * d + 8 * n
    assert result.reserved_bytes is None


def test_fit_peak_includes_optimizer_state_of_the_second_step():
    # With momentum the buffer (4*c*d) exists from step 1 on and is registered there: the
    # meter's peak is the steady-state step's, one weight-sized buffer above the first.
    n, d, c = 7, 5, 3
    result = _linear_fit(n, d, c, momentum=0.9)
    assert result.peak_bytes == _linear_step_peak(n, d, c) + 4 * c * d + 4 * n * d + 8 * n


def test_memory_meter_cpu():
    meter = MemoryMeter(CPU, 100)
    meter.start()
    assert meter.needs_tracker
    assert meter.stats().peak_bytes == 0
    tracker = TensorMemoryTracker()
    with tracker:
        kept = torch.empty(20)  # 80 B
    meter.record_tracked_peak(tracker)
    assert meter.stats().peak_bytes == 80
    assert meter.stats().reserved_bytes is None
    big = TensorMemoryTracker()
    with big:
        kept2 = torch.empty(30)  # 120 B > 100 B
    with pytest.raises(OutOfMemory, match="over the budget") as info:
        meter.record_tracked_peak(big)
    assert (info.value.peak_bytes, info.value.budget_bytes) == (120, 100)
    meter.start()  # a new run resets the peak
    assert meter.stats().peak_bytes == 0
    del kept, kept2


# --------------------------------------------------------------------------- OOM on CPU


def test_budget_below_the_measured_peak_raises_out_of_memory():
    n, d, c = 7, 5, 3
    peak = _linear_fit(n, d, c).peak_bytes
    # Exactly the peak fits ...
    assert _linear_fit(n, d, c, budget=peak).peak_bytes == peak
    # ... one byte less does not.
    with pytest.raises(OutOfMemory, match="over the budget") as info:
        _linear_fit(n, d, c, budget=peak - 1)
    assert info.value.peak_bytes == peak
    assert info.value.budget_bytes == peak - 1
    assert info.value.peak_bytes > info.value.budget_bytes


def test_budget_oom_with_a_real_model():
    data = synthetic(num_samples=64, num_classes=4, channels=3, image_size=8, seed=0)
    torch.manual_seed(0)
    model = small_cnn(num_classes=4, in_channels=3, width=4)
    budget = 2 * param_bytes(model)  # far below one step's activations
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = TrainerConfig(batch_size=16, max_epochs=1)
    with pytest.raises(OutOfMemory) as info:
        fit(Run(model, optimizer, constant(optimizer, 4), data, cfg, CPU, MemoryMeter(CPU, budget)))
    assert info.value.budget_bytes == budget
    assert info.value.peak_bytes > budget


class BigForward(nn.Module):
    """Allocates a large tensor in forward, then fails as an allocator would."""

    def __init__(self, error_type: type[BaseException], message: str, refs: list | None = None):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        # The error is made in forward: an instance kept here would pin its own traceback.
        self.error_type = error_type
        self.message = message
        self.refs = refs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = torch.ones(1 << 20)  # 4 MiB, pinned by the traceback of the error below
        if self.refs is not None:
            self.refs.append(weakref.ref(big))
        raise self.error_type(self.message)


def _oom_data() -> Splits:
    return _vector_splits(32, 4, 2, num_val=8)


def _fit_oom(model: nn.Module, data: Splits, budget=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = TrainerConfig(batch_size=8, max_epochs=1)
    meter = MemoryMeter(CPU, budget)
    return fit(Run(model, optimizer, constant(optimizer, 4), data, cfg, CPU, meter))


@pytest.mark.parametrize(
    ("error_type", "message"),
    [
        (torch.OutOfMemoryError, "CUDA out of memory. Tried to allocate 4.00 MiB\nmore detail"),
        (MemoryError, "out of memory"),
        (RuntimeError, "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4194304"),
    ],
    ids=["torch.OutOfMemoryError", "MemoryError", "cpu-allocator"],
)
def test_device_oom_becomes_out_of_memory(error_type, message):
    with pytest.raises(OutOfMemory) as info:
        _fit_oom(BigForward(error_type, message), _oom_data())
    assert not isinstance(info.value, torch.OutOfMemoryError)
    # The message names the error and its first line.
    assert str(info.value) == f"{error_type.__name__}: {message.splitlines()[0]}"
    # Raised after the device error was dropped: nothing chains back to its traceback.
    assert info.value.__context__ is None and info.value.__cause__ is None
    assert info.value.budget_bytes is None


def test_oom_error_without_a_message_becomes_out_of_memory():
    with pytest.raises(OutOfMemory):
        _fit_oom(BigForward(MemoryError, ""), _oom_data())


class NotAnOOM(Exception):
    pass


@pytest.mark.parametrize(
    ("error_type", "message"),
    [(NotAnOOM, "boom"), (RuntimeError, "shape mismatch"), (ValueError, "bad value")],
)
def test_other_errors_pass_through_unchanged(error_type, message):
    with pytest.raises(error_type, match=message) as info:
        _fit_oom(BigForward(error_type, message), _oom_data())
    assert type(info.value) is error_type


def test_is_oom_error():
    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_oom_error(MemoryError())
    assert is_oom_error(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory"))
    assert not is_oom_error(RuntimeError("CUDA error: an illegal memory access"))
    assert not is_oom_error(OutOfMemory("budget", 2, 1))
    assert not is_oom_error(ValueError("can't allocate memory"))


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector can see."""
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(): avoids proxies' __class__ lookups
            storage = obj.untyped_storage()
            key = storage.data_ptr()
            if key and key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


@pytest.fixture
def frozen_gc():
    """Move every object that exists now to the collector's permanent generation, so that the
    gc.collect() in each fit (and gc.get_objects() here) only walks objects made afterwards:
    20 runs in a fraction of a second instead of ~0.5 s each. A leak of anything the runs
    create stays visible: those objects are made after the freeze."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def test_repeated_oom_runs_release_everything(frozen_gc):
    data = _oom_data()
    baseline = _live_tensor_bytes()
    for run in range(20):
        refs: list[weakref.ref] = []
        model = BigForward(torch.OutOfMemoryError, f"CUDA out of memory (run {run})", refs)
        model_ref = weakref.ref(model)
        caught = None
        try:
            _fit_oom(model, data)
        except OutOfMemory as error:
            caught = (type(error), str(error))
            # fit dropped the device error (and the activations its traceback pinned) and
            # released memory before raising: the big tensor is already gone here.
            assert refs and refs[0]() is None
        assert caught is not None and caught[0] is OutOfMemory
        assert f"run {run}" in caught[1]
        del model
        # After the except block the caller holds nothing: the model (whose parameters the
        # optimizer in fit referenced) and every tensor of the failed step are freed.
        assert model_ref() is None, f"model of run {run} still alive"
        assert refs[0]() is None
        assert _live_tensor_bytes() == baseline, f"run {run} left tensors behind"


def test_repeated_budget_oom_runs_release_everything(frozen_gc):
    n, d, c = 7, 5, 3
    peak = _linear_fit(n, d, c).peak_bytes
    baseline = _live_tensor_bytes()
    for _ in range(5):
        try:
            _linear_fit(n, d, c, budget=peak - 1)
        except OutOfMemory as error:
            assert error.peak_bytes == peak
        else:
            pytest.fail("no OutOfMemory")
        assert _live_tensor_bytes() == baseline


# --------------------------------------------------------------------------- CUDA


@pytest.fixture
def cuda_clean():
    """Leave the device as found: no memory fraction, no cached blocks."""
    device = torch.device("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    yield device
    torch.cuda.set_per_process_memory_fraction(1.0, device)
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.gpu
@needs_cuda
def test_cuda_oom_under_a_tiny_budget_becomes_out_of_memory(cuda_clean):
    device = cuda_clean
    data = synthetic(num_samples=2048, num_classes=10, channels=3, image_size=32, seed=0)
    # Warm up first: the first conv/matmul creates library workspaces (cuBLAS keeps its own
    # for the life of the process), which are not the run's to release.
    warm = small_cnn(num_classes=10, in_channels=3, width=64).to(device)
    warm(data.train_x[:2].to(device)).sum().backward()
    del warm
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    budget = parse_budget("64MiB", device_total_bytes(device))
    for _ in range(3):  # repeatable: each OOM leaves the device clean for the next run
        torch.manual_seed(0)
        # One micro-batch of 2048 32x32 images through 64 channels: 512 MiB of activations.
        model = small_cnn(num_classes=10, in_channels=3, width=64).to(device)
        model_ref = weakref.ref(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = TrainerConfig(batch_size=2048, max_steps=2, max_epochs=None)
        caught = None
        try:
            meter = MemoryMeter(device, budget)
            fit(Run(model, optimizer, constant(optimizer, 2), data, cfg, device, meter))
        except OutOfMemory as error:
            caught = (error.peak_bytes, error.budget_bytes, str(error))
        assert caught is not None
        peak, budget_bytes, message = caught
        assert budget_bytes == budget
        assert "OutOfMemoryError" in message
        assert 0 < peak <= budget  # the allocator never went past the budget
        del model, optimizer
        assert model_ref() is None
        torch.cuda.synchronize(device)
        assert torch.cuda.memory_allocated(device) == baseline

    # The device is usable afterwards: a run that fits the (removed) budget trains.
    torch.manual_seed(0)
    model = small_cnn(num_classes=10, in_channels=3, width=8).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = TrainerConfig(batch_size=64, max_steps=3, max_epochs=None)
    meter = MemoryMeter(device, None)
    result = fit(Run(model, optimizer, constant(optimizer, 3), data, cfg, device, meter))
    assert result.num_steps == 3


@pytest.mark.gpu
@needs_cuda
def test_cuda_peak_statistics_are_reported(cuda_clean):
    device = cuda_clean
    data = synthetic(num_samples=256, num_classes=10, channels=3, image_size=16, seed=0)
    torch.manual_seed(0)
    model = small_cnn(num_classes=10, in_channels=3, width=16).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = TrainerConfig(batch_size=64, accum_steps=2, max_epochs=2, precision="bf16")
    _, num_steps = steps_plan(len(data.train_y), cfg)
    meter = MemoryMeter(device, parse_budget("1GiB", device_total_bytes(device)))
    result = fit(Run(model, optimizer, constant(optimizer, num_steps), data, cfg, device, meter))
    assert result.num_steps == num_steps
    # Parameters, gradients and momentum are all resident at once.
    assert result.peak_bytes >= 3 * param_bytes(model)
    assert result.reserved_bytes is not None and result.reserved_bytes >= result.peak_bytes
    assert result.peak_bytes <= GiB
    assert result.throughput_samples_per_sec > 0 and result.step_ms > 0
    assert 0.0 <= result.val_acc <= 1.0


@pytest.mark.gpu
@needs_cuda
def test_cuda_meter_does_not_need_the_tracker(cuda_clean):
    meter = MemoryMeter(cuda_clean, None)
    meter.start()
    assert not meter.needs_tracker
    kept = torch.empty(MiB, device=cuda_clean)  # 4 MiB
    assert meter.stats().peak_bytes >= 4 * MiB
    del kept


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_without_index_is_accepted_by_the_meter():
    # torch.device("cuda") has no index; set_per_process_memory_fraction needs one.
    from batchfit.train.plan import resolve_device

    assert resolve_device("auto").index is not None
    meter = MemoryMeter(torch.device("cuda"), 2**30)
    meter.start()
    kept = torch.empty(MiB, dtype=torch.uint8, device="cuda")
    assert meter.stats().peak_bytes >= MiB  # the allocation is seen on the indexed device
    del kept
