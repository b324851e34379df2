"""Invariants of the CUDA caching allocator model (CachingAllocatorModel.check: blocks tile
their segments, the free-block indexes agree with the blocks, segments are disjoint, the
counters agree, the limit holds) under random sequences of malloc (on several CUDA streams),
free, empty_cache and a trace's segment_free and segment_unmap with random settings, limits
and caller-given segment addresses (Hypothesis), and after the events of every real trace of
tests/fixtures/cuda-traces."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from batchfit.train.device.allocator_settings import AllocatorSettings
from batchfit.train.memory.allocator import AllocatorOutOfMemory, CachingAllocatorModel
from batchfit.train.memory.reserve import _replay_rounded, _rounded, _Runs, live_peak_bytes
from bench.gpu.cuda_trace import device_traces, load_snapshot, replay_device

FIXTURES = Path(__file__).parents[1] / "fixtures" / "cuda-traces"

MiB, GiB = 2**20, 2**30

# Requests across c10's size classes: under 512 B, the small pool (<= 1 MiB), 20 MiB segments
# (1-10 MiB), segments of their own (> 10 MiB), and some larger than any limit drawn below.
SIZES = st.one_of(
    st.integers(1, 511),
    st.integers(512, MiB),
    st.integers(MiB + 1, 10 * MiB),
    st.integers(10 * MiB, 120 * MiB),
    st.integers(120 * MiB, 2 * GiB),
)
DIVISIONS = st.sampled_from([0, 1, 2, 4, 8])
ROUNDUPS = st.one_of(
    DIVISIONS.map(lambda d: (d,) * 16), st.lists(DIVISIONS, min_size=16, max_size=16).map(tuple)
)
LIMITS = st.none() | st.integers(10, 300).map(lambda n: n * 2 * MiB)
STREAMS = st.sampled_from([0, 0, 1, 0x55D0C0DE])  # the default stream most often
# Real-looking segment addresses (2 MiB aligned, as cudaMalloc returns them), few enough that
# they repeat and overlap the model's segments.
ADDRESSES = st.integers(0, 64).map(lambda n: (1 << 40) + n * 2 * MiB)


class AllocatorMachine(RuleBasedStateMachine):
    """Drives one model; `check()` after every step."""

    def __init__(self):
        super().__init__()
        self.model: CachingAllocatorModel | None = None
        self.num_keys = 0

    @initialize(
        expandable=st.booleans(),
        max_split=st.sampled_from([None, 20 * MiB, 40 * MiB, 100 * MiB]),
        roundup=ROUNDUPS,
        gc_threshold=st.sampled_from([0.0, 0.5, 0.8]),
        limit_bytes=LIMITS,
        device_bytes=LIMITS,
    )
    def build(self, expandable, max_split, roundup, gc_threshold, limit_bytes, device_bytes):
        allocator = AllocatorSettings(
            expandable_segments=expandable,
            max_split_size_bytes=max_split,
            roundup_power2_divisions=roundup,
            garbage_collection_threshold=gc_threshold,
        )
        self.model = CachingAllocatorModel(allocator, limit_bytes, device_bytes)

    @rule(nbytes=SIZES, address=st.none() | ADDRESSES, stream=STREAMS)
    def malloc(self, nbytes, address, stream):
        model, key = self.model, self.num_keys
        self.num_keys += 1
        try:
            model.malloc(key, nbytes, address, stream)
        except AllocatorOutOfMemory:
            # only a limit or the device's memory refuses, and the request is not live
            assert model.limit_bytes is not None or model.device_bytes is not None
            assert key not in model.live
            return
        block = model.live[key]
        assert block.size >= model.settings.round_size(nbytes)
        assert block.segment.stream == stream  # never another stream's block

    @precondition(lambda self: self.model.live)
    @rule(data=st.data())
    def free(self, data):
        self.model.free(data.draw(st.sampled_from(sorted(self.model.live))))

    @rule()
    def empty_cache(self):
        self.model.release_cached_blocks()

    @precondition(lambda self: self.model.segment_blocks())
    @rule(data=st.data())
    def segment_free(self, data):
        # a trace's segment_free: a segment's address, or any (then the model holds none)
        starts = [segment[0][0] for segment in self.model.segment_blocks()]
        address = data.draw(st.sampled_from(starts) | ADDRESSES)
        reserved = self.model.reserved_bytes
        released = self.model.release_segment(address)
        assert (self.model.reserved_bytes < reserved) == released

    @precondition(lambda self: self.model.segment_blocks())
    @rule(data=st.data(), nbytes=st.sampled_from([2 * MiB, 4 * MiB, 20 * MiB, 40 * MiB]))
    def segment_unmap(self, data, nbytes):
        # a trace's segment_unmap: pages (2 MiB small, 20 MiB large) from a block's address,
        # mapped or not, free or not
        blocks = [block for segment in self.model.segment_blocks() for block in segment]
        address, _, _ = data.draw(st.sampled_from(blocks))
        reserved = self.model.reserved_bytes
        unmapped = self.model.unmap(address, nbytes)
        assert self.model.reserved_bytes == reserved - (nbytes if unmapped else 0)

    @rule()
    def copy(self):
        # a bisection's run starts from a copy (_Runs): the copy shares nothing with the
        # original, which changing the copy leaves as it was; the machine goes on with it
        original = self.model
        before = (original.segment_blocks(), original.reserved_bytes, sorted(original.live))
        copied = original.copy()
        copied.check()
        for key in list(copied.live):
            copied.free(key)
        copied.release_cached_blocks()
        copied.malloc(self.num_keys, MiB)
        original.check()
        assert (original.segment_blocks(), original.reserved_bytes, sorted(original.live)) == (
            before
        )
        self.model = original.copy()

    @invariant()
    def invariants_hold(self):
        self.model.check()


# Derandomized and without a database: CI runs the same examples every time (4-7 s here, on
# 2 busy cores; 2,000 random examples found nothing more).
AllocatorMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorMachine = AllocatorMachine.TestCase


# ------------------------------------------------------- runs from a shared state (_Runs)


@st.composite
def _steps(draw) -> list[tuple[int, int]]:
    """A step's events: allocations of SIZES up to 120 MiB, frees of live ones."""
    events, live = [], []
    for key in range(draw(st.integers(1, 60))):
        if live and draw(st.booleans()):
            events.append((live.pop(draw(st.integers(0, len(live) - 1))), -1))
        events.append((key, draw(SIZES.filter(lambda n: n <= 120 * MiB))))
        live.append(key)
    return events


@given(
    events=_steps(),
    expandable=st.booleans(),
    max_split=st.sampled_from([None, 20 * MiB, 40 * MiB]),
    roundup=ROUNDUPS,
    gc_threshold=st.sampled_from([0.0, 0.0, 0.5]),
    shares=st.lists(st.integers(0, 140), min_size=1, max_size=12),
)
@settings(max_examples=150, deadline=None, derandomize=True, database=None)
def test_a_run_from_a_shared_state_is_the_run_from_the_first_event(
    events, expandable, max_split, roundup, gc_threshold, shares
):
    """_Runs.under(limit): the state after the step under the limit, started from a copy of
    the state where it leaves the unlimited run, is the state a run from the first event
    reaches (or both run out of memory), for limits around the step's peak, asked for in
    any order (each may start from a state an earlier one left)."""
    allocator = AllocatorSettings(
        expandable_segments=expandable,
        max_split_size_bytes=max_split,
        roundup_power2_divisions=roundup,
        garbage_collection_threshold=gc_threshold,
    )
    steps = _rounded(events, allocator)
    runs = _Runs(steps, allocator)
    low, high = live_peak_bytes(steps), runs.unlimited.peak_reserved_bytes
    for share in shares:  # 0-140% of the way from the live peak to the unlimited one
        limit = low + (high - low) * share // 100
        fresh = CachingAllocatorModel(allocator, limit)
        try:
            _replay_rounded(fresh, steps)
        except AllocatorOutOfMemory:
            fresh = None
        got = runs.under(limit)
        if fresh is None:
            assert got is None, limit
            continue
        assert got is not None, limit
        got.check()
        figures = ("peak_reserved_bytes", "reserved_bytes", "num_segments")
        assert [getattr(got, f) for f in figures] == [getattr(fresh, f) for f in figures]
        assert got.segment_blocks() == fresh.segment_blocks()


# ------------------------------------------------------------------ check() itself


def _cached_segment() -> CachingAllocatorModel:
    model = CachingAllocatorModel()
    model.malloc("a", 5 * MiB)
    model.malloc("b", 5 * MiB)
    model.free("a")  # a 20 MiB segment: 5 MiB free, 5 MiB live, 10 MiB free
    model.check()
    return model


def test_check_finds_a_free_block_missing_from_its_index():
    model = _cached_segment()
    model.pools[False].keys[0].pop()  # stream 0's sorted (size, address) keys
    with pytest.raises(AssertionError, match="large pool: 1 index keys, 2 free blocks"):
        model.check()


def test_check_finds_a_block_freed_behind_the_models_back():
    model = _cached_segment()
    model.live["b"].allocated = False
    with pytest.raises(AssertionError, match="0 allocated blocks in the segments, 1 live keys"):
        model.check()


def test_check_finds_a_wrong_reserved_count():
    model = _cached_segment()
    model.reserved_bytes += 2 * MiB
    with pytest.raises(AssertionError, match="reserved bytes and segments are"):
        model.check()


def test_check_finds_two_segments_over_one_address(monkeypatch):
    # The state behind the KeyError of real replays: a segment placed where the model holds
    # one (as before _place looked for overlaps).
    monkeypatch.setattr(CachingAllocatorModel, "_overlapping", lambda self, address, n: None)
    model = CachingAllocatorModel()
    model.malloc("a", 5 * MiB, segment_address=100 * MiB)
    model.free("a")
    model.malloc("b", 30 * MiB, segment_address=110 * MiB)
    with pytest.raises(AssertionError, match="overlap"):
        model.check()


# ------------------------------------------------------------------ real traces

TRACES = sorted(FIXTURES.glob("*.json.gz"))
# The four wedsonlin training traces are one model's step (forward, backward, AdamW) at four
# context lengths, ~14k events and ~1,100 blocks each: checked after every event whole they
# take 57 s of CPU here, so each is checked after every event of its own quarter of the step
# (128: the first ... 1024: the last; ~15 s in all), which together cover every phase once.
# The other traces are checked after every event (~5 s).
QUARTERS = {f"wedsonlin_medium_{n}_training": i for i, n in enumerate((128, 256, 512, 1024))}


def test_the_traces_are_found():
    names = {p.name.removesuffix(".json.gz") for p in TRACES}
    assert len(names) == 8 and set(QUARTERS) <= names


class _CheckEvents:
    """replay_device's on_event: check() after every event in `window`."""

    def __init__(self, window: range):
        self.window, self.num_checked = window, 0

    def __call__(self, i: int, model: CachingAllocatorModel) -> None:
        if i in self.window:
            model.check()
            self.num_checked += 1


@pytest.mark.parametrize("path", TRACES, ids=[p.name.removesuffix(".json.gz") for p in TRACES])
def test_every_trace_keeps_the_invariants_event_by_event(path):
    name = path.name.removesuffix(".json.gz")
    for trace in device_traces(load_snapshot(path), name):
        window, quarter = range(len(trace.events)), QUARTERS.get(name)
        if quarter is not None:
            step = len(window) // 4
            window = range(quarter * step, len(window) if quarter == 3 else (quarter + 1) * step)
        check = _CheckEvents(window)
        replay = replay_device(trace, on_event=check)
        assert replay.num_matching == replay.num_events
        assert check.num_checked > len(window) / 3  # all but free_requested: ~2 in 3
