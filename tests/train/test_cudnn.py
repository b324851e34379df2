"""cuDNN convolutions' workspaces in a predicted CUDA step (train/memory/cudnn.py): the events
each convolution adds, in CUDA's order, from PyTorch's source; the cap batchfit exports and
counts; and, on a GPU, the workspaces measured there."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.common.checks import ConfigError
from batchfit.tracking.metrics import CUDNN_WORKSPACE_BYTES
from batchfit.train.config import RunSpec, TrainerConfig
from batchfit.train.device.allocator_settings import AllocatorSettings
from batchfit.train.device.cudnn_workspaces import (
    WSCAP_ENV,
    CudnnWorkspaces,
    ElasticKey,
    MeasureOnDevice,
    MiB,
    apply_cap,
    cap_problems,
    operands,
    run_call,
    transient_bytes,
)
from batchfit.train.device.gpus import gpu
from batchfit.train.device.spec import DeviceSpec
from batchfit.train.measure.memory import TensorMemoryTracker
from batchfit.train.memory.allocator import CachingAllocatorModel
from batchfit.train.memory.cudnn import conv_composites
from batchfit.train.memory.predict import CudnnBenchmarkOn, MemoryPredictor
from batchfit.train.memory.reserve import predict_reserved, replay
from batchfit.train.plan import plan
from batchfit.train.run import memory_figures
from batchfit.train.workload import Workloads

CONF = Path(__file__).resolve().parents[2] / "conf"
TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "cuda-traces"
A100 = gpu("A100-40GB")
# per kind of cuDNN call, a workspace no tensor of these steps has (to find them by size)
SIZES = {
    "forward": 3 * 1000 * 512,
    "backward_data": 5 * 1000 * 512,
    "backward_filter": 7 * 1000 * 512,
}


def _by_kind(signature: tuple) -> int:
    return SIZES[signature[0]]


def _step(
    model: nn.Module, x: torch.Tensor, workspaces: CudnnWorkspaces, calls: dict
) -> list[tuple[int, int]]:
    tracker = TensorMemoryTracker(record=True, composites=conv_composites(workspaces, calls))
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
    gets it as it is; cudnn_convolution_backward_weight copies it contiguous, allocates the
    weight-gradient, runs with its workspace, and frees the copy on return; the bias
    gradient comes after."""
    with FakeTensorMode():
        conv = nn.Conv2d(3, 4, 3, padding=1)
        x = torch.empty(2, 3, 8, 8)
        workspaces, calls = CudnnWorkspaces(cap_bytes=None, measure=_by_kind), {}
        sizes = _sizes(_step(conv, x, workspaces, calls))
    out = 2 * 4 * 8 * 8 * 4  # fp32 output, (2, 4, 8, 8)
    weight, bias = 4 * 3 * 3 * 3 * 4, 4 * 4
    forward = sizes.index(SIZES["forward"])
    assert sizes[forward - 1 : forward + 2] == [out, SIZES["forward"], -1]
    filter_ = sizes.index(SIZES["backward_filter"])
    # the gradient's contiguous copy, the weight-gradient, its workspace (freed), the copy
    # freed, the bias's gradient
    assert sizes[filter_ - 2 : filter_ + 4] == [
        out, weight, SIZES["backward_filter"], -1, -1, bias,
    ]  # fmt: skip
    assert SIZES["backward_data"] not in sizes
    assert sorted(s[0] for s in calls) == ["backward_filter", "forward"]
    assert calls == {s: SIZES[s[0]] for s in calls}


def test_a_second_convolution_also_takes_the_backward_data_call_before_its_filter() -> None:
    """A convolution whose input needs a gradient (here the second layer's): its input
    gradient first (cudnn_convolution_backward_input: the gradient allocated, then the
    operands' copies, the workspace, the copies freed), then its weight gradient
    (cudnn_convolution_backward_weight: the copies first, then the gradient)."""
    with FakeTensorMode():
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1))
        x = torch.empty(2, 3, 8, 8)
        workspaces, calls = CudnnWorkspaces(cap_bytes=None, measure=_by_kind), {}
        sizes = _sizes(_step(model, x, workspaces, calls))
    grad_input, grad_weight = 2 * 4 * 8 * 8 * 4, 4 * 4 * 3 * 3 * 4
    copy = grad_input  # the summed loss's gradient, expanded, made contiguous: (2, 4, 8, 8)
    data = sizes.index(SIZES["backward_data"])
    assert sizes[data - 2 : data + 6] == [
        grad_input, copy, SIZES["backward_data"], -1, -1,
        copy, grad_weight, SIZES["backward_filter"],
    ]  # fmt: skip
    kinds = [s[0] for s in calls]
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


def test_a_workspace_gives_way_under_a_limit_as_pytorch_runs_another_engine() -> None:
    """A workspace the allocator cannot serve under the limit, even after releasing its
    cache, is left out with its free (Conv_v8.cpp runs the next engine config): the step
    runs, the smallest limit is the step's without it; a plain allocation of the same size
    in its place runs out of memory. With room it is counted."""
    step = [(1, 100 * MiB), (ElasticKey(2), 64 * MiB), (2, -1), (3, 10 * MiB), (1, -1), (3, -1)]
    rigid = [(int(key), nbytes) for key, nbytes in step]
    settings = AllocatorSettings()
    # 100 MiB held, no room for 64 more under 120: the workspace is left out, then 10 MiB
    tight = predict_reserved(step, settings, limit_bytes=120 * MiB)
    assert tight.peak_reserved_under_limit_bytes == tight.smallest_limit_bytes == 110 * MiB
    roomy = predict_reserved(step, settings, limit_bytes=1024 * MiB)
    assert roomy.peak_reserved_under_limit_bytes == 164 * MiB  # its own segment; 10 MiB reuses it
    plain = predict_reserved(rigid, settings, limit_bytes=120 * MiB)
    assert plain.peak_reserved_under_limit_bytes is None and plain.smallest_limit_bytes == 164 * MiB
    model = CachingAllocatorModel(settings, limit_bytes=120 * MiB)
    replay(model, step)  # no AllocatorOutOfMemory
    assert not model.live and model.peak_reserved_bytes == 110 * MiB


def test_cudnn_benchmark_on_is_refused_for_a_prediction() -> None:
    """torch.backends.cudnn.benchmark set by a model's code: a CUDA step with convolutions
    is not predicted (its first call of each shape may take nearly all free memory), with a
    line that says how it changes memory and what to do; one without convolutions is."""
    example = (torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))
    trainer = TrainerConfig(batch_size=4, accum_steps=1, precision="fp32")

    def benchmarking() -> nn.Module:
        torch.backends.cudnn.benchmark = True  # as much CNN code does
        return _small_cnn()

    try:
        predictor = MemoryPredictor(benchmarking, _sgd, example, _planned(64 * MiB))
        with pytest.raises(CudnnBenchmarkOn) as raised:
            predictor.predict(trainer, 64)
        assert "largest workspace that fits the free memory" in raised.value.because()
        assert "torch.backends.cudnn.benchmark = False" in raised.value.because()
        linear = MemoryPredictor(
            lambda: nn.Sequential(nn.Linear(32, 10)),
            _sgd,
            (torch.zeros(4, 32), torch.zeros(4, dtype=torch.long)),
            _planned(64 * MiB),
        )
        assert linear.predict(trainer, 64).peak_bytes > 0
    finally:
        torch.backends.cudnn.benchmark = False


def test_a_measured_call_has_the_signatures_shapes_and_strides() -> None:
    """The signature holds the weight's strides; the call measured on the card is built
    with them (a channels-last weight stays channels-last), the input's likewise."""
    model = nn.Conv2d(3, 8, 3, padding=1).to(memory_format=torch.channels_last)
    x = torch.zeros(2, 3, 8, 8).to(memory_format=torch.channels_last)
    calls: dict = {}
    _step(model, x, CudnnWorkspaces(cap_bytes=None), calls)
    forward = next(s for s in calls if s[0] == "forward")
    x2, w2, grad = operands(forward, "cpu")
    assert (x2.shape, x2.stride()) == (forward[1], forward[2])
    assert (w2.shape, w2.stride()) == (forward[3], forward[4])
    assert w2.is_contiguous(memory_format=torch.channels_last) and not w2.is_contiguous()
    assert run_call(forward, x2, w2, grad).shape == grad.shape


def test_the_workspace_read_off_the_allocator_history_of_a_real_call() -> None:
    """transient_bytes over a real cuDNN call's entries (eor_nn_snapshot: the output
    allocated, the workspace allocated and freed at once) is the workspace's block."""
    with gzip.open(TRACES / "eor_nn_snapshot.json.gz", "rt") as file:
        trace = json.load(file)["device_traces"][0]
    i = next(
        i
        for i in range(1, len(trace) - 1)
        if trace[i]["action"] == "alloc" == trace[i - 1]["action"]
        and trace[i + 1]["action"] == "free_requested"
        and trace[i + 1]["addr"] == trace[i]["addr"]
        and trace[i]["size"] > 4096
    )
    assert transient_bytes(trace[i - 1 : i + 2]) == trace[i]["size"] > 0
    assert transient_bytes(trace[i - 1 : i + 1]) == 0  # still allocated: not transient


def test_measuring_reads_the_history_and_leaves_the_peak_statistics(monkeypatch) -> None:
    """The window of a call (_history) reads the allocator history, turned on for it and off
    after when it was off, and never resets the peak statistics or empties the cache; a
    history the user records stays on, and with its ring buffer full (the count no longer
    grows) the entries stamped after the last one before are the call's; unstamped, the
    window says nothing (the cap is counted). torch.cuda is stood in for (no GPU here)."""
    from batchfit.train.device import cudnn_workspaces as module

    trace: list[dict] = [{"action": "alloc", "addr": 1, "size": 512, "stream": 0}]
    state = {"on": False, "calls": []}

    def record(enabled, context=None, device=None, **_):  # noqa: ANN001, ANN202
        state["on"] = enabled is not None
        state["calls"].append(enabled)

    def forbidden(*_, **__):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the peak statistics or the cache were touched")

    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: state["on"], raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda d: {"device_traces": [trace]})
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", forbidden)
    monkeypatch.setattr(torch.cuda, "empty_cache", forbidden)
    call = [
        {"action": "alloc", "addr": 2, "size": 4096, "stream": 0},
        {"action": "alloc", "addr": 3, "size": 2 << 20, "stream": 0},
        {"action": "free_requested", "addr": 3, "size": 2 << 20, "stream": 0},
    ]
    device = torch.device("cuda", 0)
    with module._history(device) as window:
        trace.extend(call)
    assert window.transient() == 2 << 20 and state["calls"] == ["all", None]
    state["on"], state["calls"] = True, []  # the user records, its ring buffer full
    stamped = [{**e, "time_us": 10 + i} for i, e in enumerate([*trace, *call])]
    trace[:] = stamped[:4]
    with module._history(device) as window:
        trace[:] = stamped[3:]  # as many entries as before: the oldest overwritten
    assert window.entries == stamped[4:] and window.transient() == 2 << 20
    assert state["calls"] == [] and state["on"]
    trace[:] = [*call, *call]
    with module._history(device) as window:
        trace[:] = [*call[1:], *call, call[0]]
    assert window.entries is None and window.transient() is None


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


def test_a_planned_card_counts_every_call_at_the_cap_where_it_fits_and_never_for_an_oom() -> None:
    """Without the card, each cuDNN call's workspace is the cap, and the predictor says so:
    the live peak is then inside a call (the cap over what is live there, at most the
    uncapped peak), and with room the reserve holds one more segment of exactly the cap (an
    allocation over 10 MiB gets a segment of its own size, rounded to 2 MiB; each call's
    workspace reuses the block the last one freed). A workspace never makes the step run out
    of memory (PyTorch runs another engine: ElasticKey), so the smallest limit it runs in is
    the uncapped step's, and under it the capped step still runs."""
    example = (torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))
    trainer = TrainerConfig(batch_size=4, accum_steps=1, precision="fp32")
    capping = MemoryPredictor(_small_cnn, _sgd, example, _planned(64 * MiB))
    uncapped = MemoryPredictor(_small_cnn, _sgd, example, _planned(None))
    roomy = 8 * 1024 * MiB
    capped, free = capping.predict(trainer, 64, roomy), uncapped.predict(trainer, 64, roomy)
    assert capping.has_convolutions and capping.workspace_source == "cap"
    assert uncapped.has_convolutions and uncapped.workspace_source == "none"
    assert (capped.workspace_max_bytes, free.workspace_max_bytes) == (64 * MiB, 0)
    assert 64 * MiB - free.tensor_bytes <= capped.tensor_bytes - free.tensor_bytes <= 64 * MiB
    assert capped.reserved_bytes == free.reserved_bytes + 64 * MiB  # with room: the cap
    assert capped.peak_bytes == free.peak_bytes  # what it needs: no workspace
    tight = capping.predict(trainer, 64, free.peak_bytes)
    assert tight.reserved_bytes is not None and tight.reserved_bytes <= free.peak_bytes


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
    measuring = MemoryPredictor(_small_cnn, _sgd, example, spec_measured)
    on_card = measuring.predict(trainer, 64)
    assert measuring.workspace_source == "measured"  # not a bound
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
    predictor = MemoryPredictor(
        lambda: nn.Sequential(nn.Linear(32, 10)), _sgd, example, _planned(64 * MiB)
    )
    prediction = predictor.predict(trainer, 64)
    assert not predictor.has_convolutions and predictor.workspace_source == ""
    assert prediction.workspace_max_bytes is None


def test_a_call_that_cannot_run_alone_on_the_card_is_counted_at_the_cap() -> None:
    """MeasureOnDevice answers None when a call runs out of memory alone: the cap counts."""
    workspaces = CudnnWorkspaces(cap_bytes=8 * MiB, measure=lambda signature: None)
    assert workspaces.bytes_of(("forward",)) == 8 * MiB
    assert workspaces.measured == {("forward",): 8 * MiB}


def test_a_device_spec_that_measures_travels_to_ranks_by_pickle() -> None:
    """DDP/FSDP ranks get the run's spec by pickle: its measurer is a class, not a closure
    (constructing it touches no GPU)."""
    cudnn = CudnnWorkspaces(measure=MeasureOnDevice(torch.device("cuda", 0)))
    cudnn.measured[("forward",)] = 3
    spec = DeviceSpec("cuda", A100.total_bytes, A100, AllocatorSettings(), True, cudnn)
    back = pickle.loads(pickle.dumps(spec))
    assert back.cudnn is not None and back.cudnn.measured == {("forward",): 3}
    assert back.cudnn.measure.device == torch.device("cuda", 0)


def test_the_workload_keeps_one_predictor_whatever_the_card_measured(hydra_conf) -> None:
    """What the card measured is shared by a run's predictors, not part of their key: a
    second `predictor(spec)` after a prediction is the same predictor (it was rebuilt, or
    failed to serialise its key, while the measurements were in it)."""
    cfg = hydra_conf(["model=small_cnn", "data=digits", "search.gpu=A100-40GB"])
    spec = plan(cfg, cfg.search.memory_budget)
    assert spec.target.cudnn is not None
    spec.target.cudnn.measure = _by_kind  # as on the card
    workloads = Workloads()
    first = workloads.of(cfg).predictor(spec, cfg.optimizer)
    workloads.of(cfg).predict(spec, cfg.optimizer)
    assert spec.target.cudnn.measured  # it measured
    assert workloads.of(cfg).predictor(spec, cfg.optimizer) is first


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


def test_a_bad_cap_stops_the_run_before_it_starts(monkeypatch) -> None:
    monkeypatch.delenv(WSCAP_ENV, raising=False)
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("config", overrides=["cudnn_workspace_mib=lots", "search.gpu=A100-40GB"])
    with pytest.raises(ConfigError, match="cudnn_workspace_mib must be a whole number"):
        plan(cfg, "90%")


def test_the_default_cap_reaches_a_planned_card(monkeypatch) -> None:
    """The config's default (64 MiB, conf/config.yaml) is exported and in the DeviceSpec."""
    monkeypatch.delenv(WSCAP_ENV, raising=False)  # a shell's own cap would win
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("config", overrides=["search.gpu=A100-40GB"])
    spec = plan(cfg, "90%")
    assert spec.target is not None and spec.target.cudnn is not None
    assert spec.target.cudnn.cap_bytes == cfg.cudnn_workspace_mib * MiB == 64 * MiB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_each_workspace_is_measured_and_the_peak_statistics_are_left() -> None:
    """On the card, each call is measured (MeasureOnDevice) from the allocator's history: a
    peak the process reached before (here a 256 MiB tensor, freed) is still what
    max_memory_allocated reads after, and the history is off again. Whether cuDNN honours
    the cap is the conv-cap section of bench/gpu_checks.sh."""
    from batchfit.train.device.spec import device_spec

    device = torch.device("cuda", torch.cuda.current_device())
    spec = device_spec(device, None)
    assert spec.cudnn is not None and spec.cudnn.measure is not None
    big = torch.empty(256 * MiB, dtype=torch.uint8, device=device)
    del big
    peak = torch.cuda.max_memory_allocated(device)
    example = (torch.zeros(64, 3, 32, 32), torch.zeros(64, dtype=torch.long))
    model = lambda: nn.Sequential(  # noqa: E731
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1),
        nn.Flatten(), nn.Linear(64 * 32 * 32, 10),
    )  # fmt: skip
    trainer = TrainerConfig(batch_size=64, accum_steps=1, precision="fp32")
    predictor = MemoryPredictor(model, _sgd, example, spec)
    prediction = predictor.predict(trainer, 256)
    assert predictor.workspace_source == "measured" and prediction.workspace_max_bytes is not None
    assert spec.cudnn.measured and all(n >= 0 for n in spec.cudnn.measured.values())
    assert torch.cuda.max_memory_allocated(device) == peak >= 256 * MiB
    assert not torch._C._cuda_isHistoryEnabled()


_BENCHMARKING_MODEL = """
import torch
from batchfit.train.models import small_cnn


def small(num_classes, in_channels=3, width=32):
    torch.backends.cudnn.benchmark = True  # as much CNN code does
    return small_cnn(num_classes, in_channels, width)
"""


@pytest.mark.slow
def test_a_fit_report_for_a_model_that_sets_cudnn_benchmark_stops_with_why(tmp_path) -> None:
    """A user's model file that turns cudnn.benchmark on: the fit report for a card (its
    default space too, which predicts the largest batch first) stops with the line that
    says how it changes memory and the fix, exit 3, no traceback."""
    import os
    import subprocess
    import sys

    (tmp_path / "bmmodel.py").write_text(_BENCHMARKING_MODEL)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    command = [sys.executable, "-m", "search.fit", "model=small_cnn", "data=digits",
               "search.gpu=A100-40GB", "model._target_=bmmodel.small"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 3, out
    assert "Memory cannot be predicted for this model torch.backends.cudnn.benchmark is on" in out
    assert "set torch.backends.cudnn.benchmark = False where it is set" in out
    assert "Traceback" not in out
