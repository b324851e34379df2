"""Real CUDA memory traces (`torch.cuda.memory._dump_snapshot` files) replayed through the
caching allocator model of train/memory/allocator.py: the ground truth the model is checked with.

A trace often starts mid-run. The allocator's state at its first event is rebuilt from the
final `segments` and the events run backwards; the model, seeded with it, replays every
`alloc` and `free_completed`, and after each its reserved bytes and segment count are compared
with the real ones, which the `segment_*` events give. It also tells the smallest per-process
limit the step runs in (model and real), and how much of it transient allocations (kernel
workspaces a fake-tensor step cannot see) take.

    python -m bench.gpu.cuda_trace tests/fixtures/cuda-traces
"""

from __future__ import annotations

import bisect
import gzip
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from batchfit.train.device.allocator_settings import AllocatorSettings, allocation_size
from batchfit.train.memory.allocator import (
    AllocatorOutOfMemory,
    CachingAllocatorModel,
    SegmentState,
)
from batchfit.train.memory.reserve import (
    expandable_slack_bytes,
    live_peak_bytes,
    smallest_fitting_limit,
)

GiB = 1 << 30
_MAPS = ("segment_alloc", "segment_map")
_UNMAPS = ("segment_free", "segment_unmap")


@dataclass(frozen=True)
class DeviceTrace:
    """One device's events and final segments, with the run's allocator settings."""

    name: str
    device: int
    events: list[dict]
    segments: list[dict]
    settings: AllocatorSettings


def load_snapshot(path: str | Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def device_traces(snapshot: dict, name: str = "") -> list[DeviceTrace]:
    """The devices of a snapshot that have events."""
    settings = AllocatorSettings.from_snapshot(snapshot)
    return [
        DeviceTrace(
            name,
            device,
            events,
            [s for s in snapshot["segments"] if s.get("device", 0) == device],
            settings,
        )
        for device, events in enumerate(snapshot["device_traces"])
        if events
    ]


# ------------------------------------------------------------------ the state at the start


@dataclass(frozen=True)
class StartState:
    segments: list[SegmentState]
    live_blocks: list[tuple[int, int]]  # (address, size)


def start_state(trace: DeviceTrace) -> StartState:
    """The final state run backwards: segments created in the trace removed, freed ones added;
    blocks allocated in it removed, freed ones added (their size rounded as c10 does)."""
    return StartState(_start_segments(trace), _start_live_blocks(trace))


def _start_live_blocks(trace: DeviceTrace) -> list[tuple[int, int]]:
    live = {
        b["address"]: b["size"]
        for s in trace.segments
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    }
    for event in reversed(trace.events):
        if event["action"] == "alloc":
            live.pop(event["addr"], None)
        elif event["action"] == "free_completed":
            live[event["addr"]] = trace.settings.round_size(event["size"])
    return sorted(live.items())


def _start_segments(trace: DeviceTrace) -> list[SegmentState]:
    kinds = sorted(
        (s["address"], s["segment_type"] == "small", s["stream"]) for s in trace.segments
    )
    if not trace.settings.expandable_segments:
        return _start_plain_segments(trace)
    runs = _Runs()
    for s in trace.segments:
        runs.map(s["address"], s["total_size"])
    for event in reversed(trace.events):
        if event["action"] in _MAPS:
            runs.unmap(event["addr"], event["size"])
        elif event["action"] in _UNMAPS:
            runs.map(event["addr"], event["size"])
    segments = []
    for start, end in runs.items():
        small, stream = _kind_at(kinds, start)
        segments.append(SegmentState(start, end - start, small, expandable=True, stream=stream))
    return segments


def _kind_at(kinds: list[tuple[int, bool, int]], address: int) -> tuple[bool, int]:
    """The pool and stream of a mapped range: those of the final segment at or below its
    address."""
    if not kinds:
        return False, 0
    i = bisect.bisect_right(kinds, (address, True, float("inf"))) - 1
    _, small, stream = kinds[max(i, 0)]
    return small, stream


def _start_plain_segments(trace: DeviceTrace) -> list[SegmentState]:
    segments = {
        s["address"]: (s["total_size"], s["segment_type"] == "small", s["stream"])
        for s in trace.segments
    }
    for event in reversed(trace.events):
        if event["action"] == "segment_alloc":
            segments.pop(event["addr"], None)
        elif event["action"] == "segment_free":
            # a small-pool segment is always kSmallBuffer, a large one at least 10 MiB
            segments[event["addr"]] = (event["size"], event["size"] == 2 << 20, event["stream"])
    return [
        SegmentState(a, size, small, stream=stream)
        for a, (size, small, stream) in sorted(segments.items())
    ]


class _Runs:
    """Disjoint address ranges, adjacent ones merged: an expandable segment's mapped ranges,
    each of which a snapshot reports as one segment."""

    def __init__(self):
        self.starts: list[int] = []
        self.ends: dict[int, int] = {}
        self.total_bytes = 0

    def map(self, address: int, nbytes: int) -> None:
        start, end = address, address + nbytes
        i = bisect.bisect_left(self.starts, start)
        if i > 0 and self.ends[self.starts[i - 1]] == start:  # joins the run before
            i -= 1
            start = self.starts.pop(i)
            del self.ends[start]
        if i < len(self.starts) and self.starts[i] == end:  # and the run after
            end = self.ends.pop(self.starts.pop(i))
        self.starts.insert(i, start)
        self.ends[start] = end
        self.total_bytes += nbytes

    def unmap(self, address: int, nbytes: int) -> None:
        i = bisect.bisect_right(self.starts, address) - 1
        start = self.starts.pop(i)
        end = self.ends.pop(start)
        for piece_start, piece_end in ((start, address), (address + nbytes, end)):
            if piece_end > piece_start:
                bisect.insort(self.starts, piece_start)
                self.ends[piece_start] = piece_end
        self.total_bytes -= nbytes

    def items(self) -> Iterator[tuple[int, int]]:
        return ((s, self.ends[s]) for s in self.starts)


# ------------------------------------------------------------------ replay


@dataclass(frozen=True)
class Replay:
    """A seeded replay of one device against its real events."""

    num_events: int  # alloc, free_completed and oom events compared
    num_matching: int  # those after which reserved bytes and segment count equal the real
    real_peak_reserved_bytes: int
    model_peak_reserved_bytes: int
    real_oom: bool
    model_oom: bool  # the model failed at the real OOM event, and not before

    @property
    def match_share(self) -> float:
        return self.num_matching / self.num_events


class _RealTally:
    """The real reserved bytes and segment count, from the segment_* events."""

    def __init__(self, state: StartState, expandable: bool):
        self.expandable = expandable
        self.runs = _Runs()
        self.num_plain = 0
        self.peak_reserved_bytes = 0
        for s in state.segments:
            self.map(s.address, s.size_bytes)

    def map(self, address: int, nbytes: int) -> None:
        if self.expandable:
            self.runs.map(address, nbytes)
        else:  # cudaMalloc may return adjacent segments: count, do not merge
            self.num_plain += 1
            self.runs.total_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved)

    def unmap(self, address: int, nbytes: int) -> None:
        if self.expandable:
            self.runs.unmap(address, nbytes)
        else:
            self.num_plain -= 1
            self.runs.total_bytes -= nbytes

    @property
    def reserved(self) -> int:
        return self.runs.total_bytes

    @property
    def num_segments(self) -> int:
        return len(self.runs.starts) if self.expandable else self.num_plain


def oom_device_bytes(trace: DeviceTrace) -> int | None:
    """The memory a device that ran out had: the real reserved bytes at the `oom` event plus
    the free memory c10 recorded in it (record_trace(OOM, device_free, ...) puts it in `addr`;
    these compacted traces dropped it, so 0: the run could not map one more page)."""
    tally = _RealTally(start_state(trace), trace.settings.expandable_segments)
    for event in trace.events:
        if event["action"] in _MAPS:
            tally.map(event["addr"], event["size"])
        elif event["action"] in _UNMAPS:
            tally.unmap(event["addr"], event["size"])
        elif event["action"] == "oom":
            return tally.reserved + event.get("device_free", event.get("addr", 0))
    return None


def replay_device(
    trace: DeviceTrace,
    limit_bytes: int | None = None,
    device_bytes: int | None = None,
    on_event: Callable[[int, CachingAllocatorModel], None] | None = None,
) -> Replay:
    """Replays one device seeded at its first event; a device that ran out of memory runs
    with the memory it had (oom_device_bytes) unless `device_bytes` is given. A segment the
    real allocator freed (segment_free) or pages it unmapped (segment_unmap) are released
    in the model too if it holds them free: user code may call empty_cache, which the
    allocations alone do not show. `on_event(i, model)` runs after each event `i` the model
    acted on (tests check its invariants there)."""
    state = start_state(trace)
    if device_bytes is None:
        device_bytes = oom_device_bytes(trace)
    model = CachingAllocatorModel(trace.settings, limit_bytes, device_bytes)
    model.seed(state.segments, state.live_blocks)
    real = _RealTally(state, trace.settings.expandable_segments)
    num_events = num_matching = 0
    real_oom = model_oom = False
    pending_address = None
    for i, event in enumerate(trace.events):
        action, address = event["action"], event.get("addr")
        if action in _MAPS:
            real.map(address, event["size"])
            pending_address = address if pending_address is None else pending_address
            continue
        if action in _UNMAPS:
            real.unmap(address, event["size"])
            if action == "segment_free":
                model.release_segment(address)
            else:
                model.unmap(address, event["size"])
            if on_event is not None:
                on_event(i, model)
            continue
        if action == "alloc":
            model.malloc(address, event["size"], pending_address, event["stream"])
            pending_address = None
        elif action == "free_completed":
            model.free(address)
        elif action == "oom":
            real_oom = True
            model_oom = not _fits_one_more(model, ("oom", i), event["size"], event["stream"])
        else:
            continue
        if on_event is not None:
            on_event(i, model)
        num_events += 1
        num_matching += (model.reserved_bytes, model.num_segments) == (
            real.reserved,
            real.num_segments,
        )
    return Replay(
        num_events,
        num_matching,
        real.peak_reserved_bytes,
        model.peak_reserved_bytes,
        real_oom,
        model_oom,
    )


def _fits_one_more(model: CachingAllocatorModel, key: object, nbytes: int, stream: int) -> bool:
    """Whether the model holds the request the real run failed; if so it is freed again (the
    real run never got it)."""
    try:
        model.malloc(key, nbytes, stream=stream)
    except AllocatorOutOfMemory:
        return False
    model.free(key)
    return True


# ------------------------------------------------------------------ smallest limits


def _steps(trace: DeviceTrace, skip: frozenset[int] = frozenset()) -> list[tuple[int, int, int]]:
    """The trace as allocator events: `(address, size, stream)` and `(address, -1, stream)`;
    an OOM's request is left out (the run never got it)."""
    steps = []
    for i, event in enumerate(trace.events):
        if i in skip:
            continue
        if event["action"] == "alloc":
            steps.append((event["addr"], event["size"], event["stream"]))
        elif event["action"] == "free_completed":
            steps.append((event["addr"], -1, event["stream"]))
    return steps


def _replay_steps(model: CachingAllocatorModel, steps: list[tuple[int, int, int]]) -> None:
    """reserve.replay with each allocation on its stream."""
    malloc, free = model.malloc, model.free
    for address, nbytes, stream in steps:
        if nbytes < 0:
            free(address)
        else:
            malloc(address, nbytes, None, stream)


def _runs_under(trace: DeviceTrace, steps: list, state: StartState, limit_bytes: int) -> bool:
    """Whether the seeded model replays `steps` under a per-process limit. A seed above the
    limit first releases its cached segments, as a run under that limit would have."""
    model = CachingAllocatorModel(trace.settings, limit_bytes)
    model.seed(state.segments, state.live_blocks)
    if model.reserved_bytes > limit_bytes:
        model.release_cached_blocks()
        if model.reserved_bytes > limit_bytes:
            return False
    try:
        _replay_steps(model, steps)
    except AllocatorOutOfMemory:
        return False
    return True


@dataclass(frozen=True)
class Limits:
    model_smallest_limit_bytes: int
    unlimited_peak_reserved_bytes: int


def model_limits(trace: DeviceTrace, skip: frozenset[int] = frozenset()) -> Limits:
    """The smallest per-process limit the seeded model replays the trace in (bisection to
    2 MiB, exact: see smallest_fitting_limit), and its unlimited peak."""
    steps, state = _steps(trace, skip), start_state(trace)
    unlimited = CachingAllocatorModel(trace.settings)
    unlimited.seed(state.segments, state.live_blocks)
    _replay_steps(unlimited, steps)
    sizes = [(address, nbytes) for address, nbytes, _ in steps]
    high = unlimited.peak_reserved_bytes + expandable_slack_bytes(sizes, trace.settings)
    low = live_peak_bytes(sizes, trace.settings.round_size, state.live_blocks) - 1
    least = smallest_fitting_limit(lambda limit: _runs_under(trace, steps, state, limit), low, high)
    return Limits(least, unlimited.peak_reserved_bytes)


def real_smallest_limit(trace: DeviceTrace) -> int:
    """The smallest per-process limit the real events alone call for: the most bytes of
    segments holding a live block at any moment (with expandable segments: of pages holding
    one, and at an allocation that maps pages those plus its get_allocation_size, which c10's
    alloc_block checks against the limit). Under a limit c10 releases every wholly free
    segment (or page) before failing, so this is what the real placement needed; a run under
    the limit may place blocks differently, so it is an estimate, not a bound."""
    if trace.settings.expandable_segments:
        return _real_limit_expandable(trace)
    state = start_state(trace)
    starts = [s.address for s in state.segments]
    sizes = {s.address: s.size_bytes for s in state.segments}
    counts = dict.fromkeys(starts, 0)
    occupied = 0

    def touch(address: int, delta: int) -> int:
        segment = starts[bisect.bisect_right(starts, address) - 1]
        counts[segment] += delta
        if counts[segment] == (1 if delta > 0 else 0):
            return delta * sizes[segment]
        return 0

    for address, _ in state.live_blocks:
        occupied += touch(address, 1)
    peak = occupied
    for event in trace.events:
        action, address = event["action"], event.get("addr")
        if action == "segment_alloc":
            bisect.insort(starts, address)
            sizes[address], counts[address] = event["size"], 0
        elif action == "segment_free":
            del starts[bisect.bisect_left(starts, address)]
        elif action in ("alloc", "free_completed"):
            occupied += touch(address, 1 if action == "alloc" else -1)
            peak = max(peak, occupied)
    return peak


def _real_limit_expandable(trace: DeviceTrace) -> int:
    """real_smallest_limit with expandable segments: pages counted from each pool's base (the
    lowest final segment of its type; these traces start from an empty allocator)."""
    bases = {}
    for s in sorted(trace.segments, key=lambda s: s["address"]):
        bases.setdefault(s["segment_type"] == "small", s["address"])
    pages: dict[tuple[bool, int], int] = {}
    sizes: dict[int, int] = {}
    peak = occupied = 0
    mapping = False
    for event in trace.events:
        action = event["action"]
        if action == "segment_map":
            mapping = True
        elif action in ("alloc", "free_completed"):
            address = event["addr"]
            size = sizes.pop(address) if action == "free_completed" else None
            if size is None:
                size = sizes[address] = trace.settings.round_size(event["size"])
                if mapping:
                    peak = max(peak, occupied + allocation_size(size))
            occupied += _touch_pages(pages, bases, address, size, action == "alloc")
            peak, mapping = max(peak, occupied), False
    return peak


def _touch_pages(pages: dict, bases: dict, address: int, size: int, alloc: bool) -> int:
    small = size <= 1 << 20
    page = 2 << 20 if small else 20 << 20
    base = bases[small]
    first, last = (address - base) // page, (address + size - 1 - base) // page
    change = 0
    for index in range(first, last + 1):
        key = (small, index)
        pages[key] = pages.get(key, 0) + (1 if alloc else -1)
        if pages[key] == (1 if alloc else 0):
            change += page if alloc else -page
    return change


# ------------------------------------------------------------------ transient allocations


def transient_events(trace: DeviceTrace) -> frozenset[int]:
    """The events of allocations freed before any other allocation happens, with their
    frees: kernel workspaces and staging buffers, which a fake-tensor step does not see."""
    events, skip = trace.events, set()
    last_alloc, awaiting = None, {}  # address -> a transient alloc awaiting free_completed
    for i, event in enumerate(events):
        action = event["action"]
        if action == "alloc":
            last_alloc = i
        elif (
            action.startswith("free_")
            and last_alloc is not None
            and (events[last_alloc]["addr"] == event["addr"])
        ):
            awaiting[event["addr"]] = last_alloc
            skip.add(last_alloc)
            last_alloc = None
        if action == "free_completed" and event["addr"] in awaiting:
            del awaiting[event["addr"]]
            skip.add(i)
    return frozenset(skip)


@dataclass(frozen=True)
class TransientShare:
    """How much of the smallest limit and of the unlimited peak transient allocations take."""

    smallest_limit_bytes: int
    smallest_limit_without_bytes: int
    peak_reserved_bytes: int
    peak_reserved_without_bytes: int

    @property
    def limit_share(self) -> float:
        return 1 - self.smallest_limit_without_bytes / self.smallest_limit_bytes

    @property
    def peak_share(self) -> float:
        return 1 - self.peak_reserved_without_bytes / self.peak_reserved_bytes


def transient_share(trace: DeviceTrace, limits: Limits | None = None) -> TransientShare:
    limits = limits or model_limits(trace)
    without = model_limits(trace, transient_events(trace))
    return TransientShare(
        limits.model_smallest_limit_bytes,
        without.model_smallest_limit_bytes,
        limits.unlimited_peak_reserved_bytes,
        without.unlimited_peak_reserved_bytes,
    )


# ------------------------------------------------------------------ report


@dataclass(frozen=True)
class TraceReport:
    trace: DeviceTrace
    replay: Replay
    limits: Limits
    real_limit_bytes: int
    transient: TransientShare


def report(trace: DeviceTrace) -> TraceReport:
    limits = model_limits(trace)
    return TraceReport(
        trace,
        replay_device(trace),
        limits,
        real_smallest_limit(trace),
        transient_share(trace, limits),
    )


def reports(folder: str | Path) -> list[TraceReport]:
    paths = sorted(Path(folder).glob("*.json.gz"))
    if not paths:
        raise ValueError(f"no *.json.gz snapshot in {folder}; give the folder of the traces")
    name = lambda p: p.name.removesuffix(".json.gz")  # noqa: E731
    return [report(t) for p in paths for t in device_traces(load_snapshot(p), name(p))]


def table(rows: list[TraceReport]) -> Table:
    out = Table(title="CUDA caching allocator model against real traces (GiB)")
    for column in (
        "trace",
        "dev",
        "events",
        "exact",
        "limit real",
        "limit model",
        "peak unlimited",
        "OOM real/model",
        "transient limit",
        "transient peak",
    ):
        out.add_column(column, justify="left" if column == "trace" else "right")
    for r in rows:
        out.add_row(
            r.trace.name,
            str(r.trace.device),
            str(r.replay.num_events),
            f"{r.replay.match_share:.1%}",
            f"{r.real_limit_bytes / GiB:.3f}",
            f"{r.limits.model_smallest_limit_bytes / GiB:.3f}",
            f"{r.limits.unlimited_peak_reserved_bytes / GiB:.3f}",
            f"{'yes' if r.replay.real_oom else 'no'}/{'yes' if r.replay.model_oom else 'no'}",
            f"{r.transient.limit_share:.2%}",
            f"{r.transient.peak_share:.2%}",
        )
    return out


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    folder = args[0] if args else "tests/fixtures/cuda-traces"
    Console(width=160).print(table(reports(folder)))


if __name__ == "__main__":
    main()
