"""The allocator model against real CUDA traces (bench/gpu/cuda_trace.py, the snapshots in
tests/fixtures/cuda-traces): event-by-event agreement, peaks, the real OOM, smallest limits,
the cuBLAS workspaces and the share of transient allocations. Every figure is the model's,
deterministic, so exact; the real-events limit is an estimate, compared within a tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from batchfit.search.core.study_config import SearchConfig
from batchfit.train.device.allocator_settings import AllocatorSettings
from batchfit.train.memory.allocator import SegmentState
from batchfit.train.memory.preflight import UNMEASURED_MARGIN
from batchfit.train.memory.reserve import cublas_workspaces
from bench.gpu.cuda_trace import (
    DeviceTrace,
    StartState,
    device_traces,
    load_snapshot,
    replay_device,
    reports,
    start_state,
    table,
    transient_events,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "cuda-traces"
CONF = Path(__file__).parents[2] / "conf"
MiB = 2**20

# name, device, compared events, real peak reserved (bytes), model's smallest limit, real-events
# limit, unlimited peak, smallest limit and unlimited peak without transient allocations (MiB)
FIGURES = [
    ("constructorsun_memory_snapshot", 0, 4352, 8541700096, 8120, 8124, 8146, 8120, 8146),
    ("constructorsun_memory_snapshot", 1, 375, 84202749952, 80306, 80306, 84082, 78350, 79022),
    ("constructorsun_memory_snapshot", 2, 598, 21883781120, 20772, 20770, 20870, 20772, 20870),
    ("eor_nn_snapshot", 0, 3861, 134217728, 126, 126, 128, 126, 128),
    ("magma27_memory_snapshot", 0, 3442, 14180941824, 13522, 13524, 13524, 13522, 13524),
    ("wedsonlin_medium_1024_training", 0, 14961, 25178406912, 23334, 23756, 24012, 23334, 24012),
    ("wedsonlin_medium_128_inference", 0, 2560, 1763704832, 1678, 1678, 1682, 1678, 1682),
    ("wedsonlin_medium_128_training", 0, 12831, 7235174400, 6836, 6816, 6900, 6836, 6900),
    ("wedsonlin_medium_256_training", 0, 13027, 9265217536, 8716, 8716, 8836, 8716, 8836),
    ("wedsonlin_medium_512_training", 0, 14961, 12660506624, 11926, 12074, 12074, 11926, 12074),
]
IDS = [f"{name}-{device}" for name, device, *_ in FIGURES]


@pytest.fixture(scope="module")
def by_trace():
    """Every report once for the module (~9 s: the bisections, twice with transients)."""
    return {(r.trace.name, r.trace.device): r for r in reports(FIXTURES)}


def test_the_fixtures_hold_every_trace(by_trace):
    assert sorted(by_trace) == sorted((name, device) for name, device, *_ in FIGURES)


@pytest.mark.parametrize("figures", FIGURES, ids=IDS)
def test_the_model_agrees_with_every_event_of_every_trace(by_trace, figures):
    # With the expandable tail rule of get_free_block and c10's unmapping on release, the
    # constructorsun devices agree at 100% too (44-65% without the rule).
    name, device, num_events, real_peak, *_ = figures
    replay = by_trace[name, device].replay
    assert replay.num_events == num_events
    assert replay.num_matching == num_events
    assert replay.real_peak_reserved_bytes == replay.model_peak_reserved_bytes == real_peak


@pytest.mark.parametrize("figures", FIGURES, ids=IDS)
def test_only_the_device_that_ran_out_is_predicted_to(by_trace, figures):
    # constructorsun device 1 failed a 4.94 GiB request at 78.4 GiB reserved on an 80 GB card;
    # with the memory it had the model fails there too, not before (it would raise).
    name, device, *_ = figures
    replay = by_trace[name, device].replay
    ran_out = (name, device) == ("constructorsun_memory_snapshot", 1)
    assert replay.real_oom is replay.model_oom is ran_out


@pytest.mark.parametrize("figures", FIGURES, ids=IDS)
def test_smallest_limits(by_trace, figures):
    name, device, _, _, model_limit, real_limit, peak, *_ = figures
    r = by_trace[name, device]
    assert r.limits.model_smallest_limit_bytes == model_limit * MiB
    assert r.limits.unlimited_peak_reserved_bytes == peak * MiB
    assert r.real_limit_bytes == real_limit * MiB
    # The real-events figure assumes the real placement, which a limit changes; across these
    # traces it is within 1.8% of the model's (wedsonlin 1024: -1.78%): 2% tolerance.
    assert abs(model_limit / real_limit - 1) <= 0.02
    # The unlimited peak over-predicts: up to 4.7% above the smallest limit here.
    assert model_limit <= peak <= model_limit * 1.05


@pytest.mark.parametrize("figures", FIGURES, ids=IDS)
def test_transient_share(by_trace, figures):
    name, device, _, _, model_limit, _, peak, limit_without, peak_without = figures
    share = by_trace[name, device].transient
    assert share.smallest_limit_without_bytes == limit_without * MiB
    assert share.peak_reserved_without_bytes == peak_without * MiB
    assert share.limit_share == pytest.approx(1 - limit_without / model_limit)
    assert share.peak_share == pytest.approx(1 - peak_without / peak)


def test_the_start_state_is_rebuilt_from_the_end_and_the_events():
    # constructorsun was recorded from an empty allocator; magma27 created no segment in its
    # trace, so its start has the final 216 segments.
    constructorsun = device_traces(
        load_snapshot(FIXTURES / "constructorsun_memory_snapshot.json.gz")
    )
    assert [start_state(t).segments for t in constructorsun] == [[], [], []]
    assert [start_state(t).live_blocks for t in constructorsun] == [[], [], []]
    (magma,) = device_traces(load_snapshot(FIXTURES / "magma27_memory_snapshot.json.gz"))
    assert len(start_state(magma).segments) == 216


@pytest.mark.parametrize(
    ("name", "training"),
    [
        ("wedsonlin_medium_128_inference", False),
        ("wedsonlin_medium_128_training", True),
        ("wedsonlin_medium_1024_training", True),
        ("magma27_memory_snapshot", True),
    ],
)
def test_a_training_step_holds_two_cublas_workspaces(name, training):
    # The blocks of the default size (8320 KiB: these GPUs are not sm 9.0) live through the
    # whole trace: one per handle, the autograd thread's in training. (eor_nn, a CNN whose
    # backward runs on cuDNN, holds one: the rule is for steps with backward matmuls.)
    (trace,) = device_traces(load_snapshot(FIXTURES / f"{name}.json.gz"))
    allocated = {e["addr"] for e in trace.events if e["action"] == "alloc"}
    through = [
        b["size"]
        for s in trace.segments
        for b in s["blocks"]
        if b["state"] == "active_allocated" and b["address"] not in allocated
    ]
    workspaces = cublas_workspaces((8, 0), training, environ={}, release=(2, 6))  # 2025's torch
    assert through.count(workspaces[0]) == len(workspaces)


def test_transient_allocations_are_those_freed_before_the_next_allocation():
    (trace,) = device_traces(load_snapshot(FIXTURES / "wedsonlin_medium_128_inference.json.gz"))
    skipped = transient_events(trace)
    actions = [trace.events[i]["action"] for i in sorted(skipped)]
    assert actions.count("alloc") == actions.count("free_completed") == 25


def test_the_table_has_a_row_per_device(by_trace):
    console = Console(width=160, record=True)
    console.print(table(list(by_trace.values())))
    out = console.export_text()
    assert out.count("constructorsun_memory_snapshot") == 3
    assert "78.424" in out  # constructorsun device 1's smallest limit, GiB


def test_the_default_preflight_margin_covers_what_fake_tensors_cannot_see(by_trace):
    """The margin is decided from these traces: allocations made inside kernels (transient:
    freed before the next allocation) raised the smallest limit by at most 2.44%, and the
    margin of a kind of step no GPU has measured must cover the largest of them
    (docs/design.md); the default (null) takes it from the kind of step."""
    worst = max(report.transient.limit_share for report in by_trace.values())
    assert worst == pytest.approx(0.0244, abs=5e-4)
    assert worst <= UNMEASURED_MARGIN
    assert SearchConfig.__dataclass_fields__["preflight_margin"].default is None
    assert OmegaConf.load(CONF / "search" / "default.yaml").preflight_margin is None


# ------------------------------------------------------------------ released segments


def _event(action: str, address: int, nbytes: int, stream: int = 0) -> dict:
    return {"action": action, "addr": address, "size": nbytes, "stream": stream}


def _alloc_free(address: int, nbytes: int) -> list[dict]:
    return [_event(a, address, nbytes) for a in ("alloc", "free_requested", "free_completed")]


def _segment(
    address: int, nbytes: int, blocks: list[tuple[int, int, str]], stream: int = 0, **kind
) -> dict:
    return {
        "address": address,
        "total_size": nbytes,
        "segment_type": "large",
        "stream": stream,
        "blocks": [{"address": a, "size": n, "state": state} for a, n, state in blocks],
        **kind,
    }


def test_a_segment_that_empty_cache_freed_is_freed_in_the_replay_too():
    # torch.cuda.empty_cache() between two steps: the trace shows segment_free, and cudaMalloc
    # returns the freed address for the next, larger segment. The replay frees it in the
    # model too. Before, the model kept it cached, placed the new segment over it (the trace's
    # address), and the 18 MiB allocation raised KeyError (_get_free_block).
    x, y = 0x7F0000000000, 0x7F0040000000
    events = [
        _event("segment_alloc", x, 20 * MiB),
        *_alloc_free(x, 5 * MiB),
        _event("segment_free", x, 20 * MiB),  # empty_cache
        _event("segment_alloc", x, 30 * MiB),
        *_alloc_free(x, 30 * MiB),
        _event("alloc", x, 15 * MiB),  # the cached 30 MiB block, split
        _event("segment_alloc", y, 18 * MiB),
        _event("alloc", y, 18 * MiB),
    ]
    segments = [
        _segment(
            x, 30 * MiB, [(x, 15 * MiB, "active_allocated"), (x + 15 * MiB, 15 * MiB, "inactive")]
        ),
        _segment(y, 18 * MiB, [(y, 18 * MiB, "active_allocated")]),
    ]
    trace = DeviceTrace("empty_cache", 0, events, segments, AllocatorSettings())
    assert start_state(trace) == StartState([], [])
    replay = replay_device(trace, on_event=lambda i, model: model.check())
    assert (replay.num_events, replay.num_matching) == (6, 6)
    assert replay.real_peak_reserved_bytes == replay.model_peak_reserved_bytes == 48 * MiB


def test_pages_that_empty_cache_unmapped_are_unmapped_in_the_replay_too():
    # Expandable segments: empty_cache unmaps the free first page (segment_unmap); when the
    # second page's block is freed the real run holds one mapped page, not two.
    a = 0x7F0000000000
    events = [
        _event("segment_map", a, 20 * MiB),
        _event("alloc", a, 20 * MiB),
        _event("segment_map", a + 20 * MiB, 20 * MiB),
        _event("alloc", a + 20 * MiB, 20 * MiB),
        _event("free_requested", a, 20 * MiB),
        _event("free_completed", a, 20 * MiB),
        _event("segment_unmap", a, 20 * MiB),  # empty_cache
        _event("free_requested", a + 20 * MiB, 20 * MiB),
        _event("free_completed", a + 20 * MiB, 20 * MiB),
        _event("alloc", a + 20 * MiB, 10 * MiB),
    ]
    blocks = [(a + 20 * MiB, 10 * MiB, "active_allocated"), (a + 30 * MiB, 10 * MiB, "inactive")]
    segments = [_segment(a + 20 * MiB, 20 * MiB, blocks, is_expandable=True)]
    trace = DeviceTrace("unmap", 0, events, segments, AllocatorSettings(expandable_segments=True))
    assert start_state(trace) == StartState([], [])
    replay = replay_device(trace, on_event=lambda i, model: model.check())
    assert (replay.num_events, replay.num_matching) == (5, 5)


@pytest.mark.parametrize("expandable", [False, True])
def test_each_allocation_is_replayed_on_its_stream(expandable):
    # The trace starts with a block of a side stream's segment live; freed, it does not serve
    # the default stream, which gets a segment of its own, but the side stream's next request.
    a, b, side = 0x7F0000000000, 0x7F0040000000, 0x55D0C0DE
    events = [
        _event("free_requested", a, 4 * MiB, side),
        _event("free_completed", a, 4 * MiB, side),
        _event("segment_map" if expandable else "segment_alloc", b, 20 * MiB),
        _event("alloc", b, 4 * MiB),
        _event("alloc", a, 4 * MiB, side),
    ]

    def used(address: int, stream: int) -> dict:  # 4 MiB live, 16 MiB free
        blocks = [(address, 4 * MiB, "active_allocated"), (address + 4 * MiB, 16 * MiB, "inactive")]
        return _segment(address, 20 * MiB, blocks, stream, is_expandable=expandable)

    segments = [used(a, side), used(b, 0)]
    settings = AllocatorSettings(expandable_segments=expandable)
    trace = DeviceTrace("streams", 0, events, segments, settings)
    seeded = SegmentState(a, 20 * MiB, small=False, expandable=expandable, stream=side)
    assert start_state(trace) == StartState([seeded], [(a, 4 * MiB)])
    replay = replay_device(trace, on_event=lambda i, model: model.check())
    assert (replay.num_events, replay.num_matching) == (3, 3)
